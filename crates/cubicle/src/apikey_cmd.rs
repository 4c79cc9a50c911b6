//! `cubicle apikey [create|list|revoke]`: API keys in the store of `--state-dir`, or in
//! the database `--database` names (as `cubicle serve --database`), directly (no server
//! needed; works while `cubicle serve` runs — SQLite in WAL mode, or PostgreSQL).
//! Without a subcommand it prints the admin key `cubicle serve` created (kept in
//! `<state>/admin-api-key`, mode 0600: readable by root only), since the server prints
//! it only once, when it creates it.

use anyhow::Context;
use clap::Subcommand;
use cubicle_store::Store;

/// API key subcommands.
#[derive(Subcommand, Debug)]
pub enum ApikeyCommand {
    /// Create a key for a team (created if missing); prints the key once, on stdout.
    Create {
        /// Team the key belongs to (each team sees only its own sandboxes).
        #[arg(long, default_value = "admin")]
        team: String,
    },
    /// List keys (prefix, team, created, last used, revoked).
    List,
    /// Revoke the key starting with PREFIX (as shown by `list`, e.g. e2b_1a2b3c4d).
    Revoke {
        /// Key prefix (at least `e2b_` + 4 characters) or the whole key.
        prefix: String,
    },
}

fn fmt_ms(ms: Option<i64>) -> String {
    ms.map(|ms| crate::template_cmd::format_utc((ms / 1000) as u64))
        .unwrap_or_else(|| "-".into())
}

/// The store `cubicle serve` uses: `database` (`--database`), else `<state>/cubicle.db`.
fn open_store(state_dir: &std::path::Path, database: Option<&str>) -> anyhow::Result<Store> {
    match database {
        Some(url) => Store::open_url(url).context("opening the database --database names"),
        None => {
            let db = state_dir.join("cubicle.db");
            Store::open(&db).with_context(|| format!("opening {}", db.display()))
        }
    }
}

pub fn run(
    state_dir: &std::path::Path,
    database: Option<&str>,
    cmd: Option<ApikeyCommand>,
) -> anyhow::Result<i32> {
    let Some(cmd) = cmd else {
        return show_admin_key(state_dir, database);
    };
    std::fs::create_dir_all(state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let store = open_store(state_dir, database)?;
    match cmd {
        ApikeyCommand::Create { team } => {
            let team = store.ensure_team(&team)?;
            let key = store.create_api_key(team.id)?;
            eprintln!(
                "created API key {}… for team '{}' (shown only now; store it safely)",
                key.info.prefix, team.name
            );
            println!("{}", key.plaintext);
        }
        ApikeyCommand::List => {
            println!(
                "{:<14} {:<16} {:<19}  {:<19}  REVOKED (UTC)",
                "PREFIX", "TEAM", "CREATED (UTC)", "LAST USED (UTC)"
            );
            for k in store.list_api_keys()? {
                println!(
                    "{:<14} {:<16} {:<19}  {:<19}  {}",
                    k.prefix,
                    k.team_name,
                    fmt_ms(Some(k.created_at)),
                    fmt_ms(k.last_used_at),
                    fmt_ms(k.revoked_at)
                );
            }
        }
        ApikeyCommand::Revoke { prefix } => {
            let k = store.revoke_api_key(&prefix)?;
            println!("revoked {} (team '{}')", k.prefix, k.team_name);
        }
    }
    Ok(0)
}

/// Prints the admin key (stdout) if it still authenticates.
fn show_admin_key(state_dir: &std::path::Path, database: Option<&str>) -> anyhow::Result<i32> {
    let path = state_dir.join(crate::serve::ADMIN_KEY_FILE);
    let key = match std::fs::read_to_string(&path) {
        Ok(k) => k.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "no admin key in {}: `cubicle serve` creates one on its first start (or make one: cubicle apikey create --team admin)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => anyhow::bail!(
            "{} is readable by root only: run as root (sudo cubicle apikey)",
            path.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let store = open_store(state_dir, database)?;
    if store.authenticate(&key)?.is_none() {
        anyhow::bail!(
            "the admin key in {} was revoked: the next start of `cubicle serve` makes a new one (or: cubicle apikey create --team admin)",
            path.display()
        );
    }
    println!("{key}");
    Ok(0)
}
