//! `cubicle template build|list|rm`.

use std::path::Path;

use anyhow::{Context, bail};
use clap::Subcommand;
use cubicle_node::template::{TemplateStore, human_size};

/// Template subcommands.
#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Build a built-in template (`tiny` or `base`).
    Build {
        /// Template name.
        name: String,
        /// Rebuild even if it is already built (the old one is replaced atomically).
        #[arg(long)]
        force: bool,
    },
    /// List built templates: name, size, build time.
    List,
    /// Remove a template (refused while a sandbox uses it).
    Rm {
        /// Template name.
        name: String,
    },
}

pub async fn run(state_dir: &Path, cmd: TemplateCommand) -> anyhow::Result<i32> {
    let store = TemplateStore::open(state_dir)
        .with_context(|| format!("opening {}", state_dir.display()))?;
    match cmd {
        TemplateCommand::Build { name, force } => {
            let t = tokio::task::spawn_blocking(move || store.build(&name, force, true)).await??;
            println!(
                "{} {} {}",
                t.config.name,
                human_size(t.config.size_bytes),
                t.dir.display()
            );
        }
        TemplateCommand::List => {
            println!("{:<24} {:>10}  BUILT (UTC)", "NAME", "SIZE");
            for t in store.list()? {
                println!(
                    "{:<24} {:>10}  {}",
                    t.config.name,
                    human_size(t.config.size_bytes),
                    format_utc(t.config.built_at)
                );
            }
        }
        TemplateCommand::Rm { name } => {
            let users = cubicle_node::sandboxes_using_template(state_dir, &name);
            if !users.is_empty() {
                bail!(
                    "template '{name}' is used by sandbox(es) {}; kill them first (cubicle sandbox kill ID)",
                    users.join(", ")
                );
            }
            store.remove(&name)?;
            println!("removed template {name}");
        }
    }
    Ok(0)
}

/// `YYYY-MM-DD HH:MM:SS` for a Unix time (UTC).
pub fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::format_utc;

    #[test]
    fn formats_dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00");
        assert_eq!(format_utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(format_utc(1_796_038_282), "2026-11-30 11:31:22");
    }
}
