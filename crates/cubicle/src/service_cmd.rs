//! `cubicle service install|uninstall|unit`: run `cubicle serve` under systemd.
//!
//! The unit relies on three things the server guarantees:
//! - **Sandboxes live outside the unit's cgroup.** Every sandbox's processes are moved
//!   to `cubicle/<id>` at the root of every cgroup hierarchy — including the ones
//!   systemd tracks services by (`name=systemd` and the unified hierarchy on a hybrid
//!   host, the only one on a cgroup-v2 host) — before the sandbox's first process starts.
//!   So `KillMode=mixed` (SIGTERM to the server, then SIGKILL to whatever is left in the
//!   unit's cgroup) never reaches a sandbox: a stop or restart leaves them running.
//! - **A restart adopts them.** The next start finds the records in the state
//!   directory, checks each init is still the same process, and serves them again.
//! - **Readiness is reported** (`Type=notify`): `READY=1` once the templates are built
//!   and the listener is open (the first start builds `base`: minutes, hence the long
//!   start timeout).
//!
//! `Delegate=` is left off: the server creates no cgroups below its own; the accounting
//! settings keep the memory, CPU and pids controllers enabled at the root on cgroup v2,
//! where the sandboxes' `cubicle/` subtree needs them.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;

/// Where `install` puts the unit by default.
pub const UNIT_DIR: &str = "/etc/systemd/system";
/// The unit's name.
pub const UNIT: &str = "cubicle.service";

/// `cubicle service …`.
#[derive(Subcommand, Debug)]
pub enum ServiceCommand {
    /// Install the systemd unit (and a config file when there is none), then enable
    /// and start it when systemd runs this machine.
    Install(InstallArgs),
    /// Stop, disable and remove the unit (sandboxes keep running until they end; the
    /// config file and the state directory stay).
    Uninstall {
        /// Directory the unit was installed in.
        #[arg(long, default_value = UNIT_DIR)]
        unit_dir: PathBuf,
    },
    /// Print the unit `install` would write.
    Unit(UnitArgs),
}

/// What the unit runs.
#[derive(clap::Args, Debug, Clone)]
pub struct UnitArgs {
    /// The cubicle binary the unit runs (default: this one; `cubicle-envd` must sit
    /// next to it).
    #[arg(long, value_name = "PATH")]
    pub binary: Option<PathBuf>,
    /// The config file the unit passes (`--config`).
    #[arg(long = "config-file", default_value = crate::config::DEFAULT_CONFIG, value_name = "PATH")]
    pub config_file: PathBuf,
}

/// `cubicle service install` options.
#[derive(clap::Args, Debug)]
pub struct InstallArgs {
    #[command(flatten)]
    pub unit: UnitArgs,
    /// Directory to write `cubicle.service` to.
    #[arg(long, default_value = UNIT_DIR, value_name = "DIR")]
    pub unit_dir: PathBuf,
    /// Write the files only (no `systemctl daemon-reload/enable --now`).
    #[arg(long)]
    pub no_start: bool,
}

/// The unit file's text.
pub fn unit_text(binary: &Path, config: &Path) -> String {
    format!(
        "\
# Installed by `cubicle service install`; see docs/operations.md.
[Unit]
Description=Cubicle: E2B-compatible sandboxes (cubicle serve)
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={binary} --config {config} serve
# Sandboxes run in cgroups outside this unit's (cubicle/<id> in every hierarchy), so a
# stop or restart never kills them; the next start adopts them. mixed: SIGTERM to the
# server, and after TimeoutStopSec SIGKILL to what is left in the unit's own cgroup
# (template builds, never a sandbox).
KillMode=mixed
TimeoutStopSec=90
# The first start builds the base template (a few minutes).
TimeoutStartSec=30min
Restart=on-failure
RestartSec=2
LimitNOFILE=1048576
TasksMax=infinity
# Keep the memory, CPU and pids controllers enabled at the root (cgroup v2): the
# sandboxes' cubicle/ subtree needs them.
MemoryAccounting=yes
CPUAccounting=yes
TasksAccounting=yes

[Install]
WantedBy=multi-user.target
",
        binary = binary.display(),
        config = config.display(),
    )
}

/// A config file to start from (written by `install` when there is none).
fn default_config(state_dir: &Path) -> String {
    format!(
        "\
# Cubicle's config file: keys are the long flags of `cubicle` (top level) and of
# `cubicle serve` ([serve]). Flags and CUBICLE_* environment variables override it.
# See docs/operations.md.
state-dir = \"{}\"
log-format = \"json\"

[serve]
listen = \"127.0.0.1:3000\"
# domain = \"sandbox.example.com\"        # <port>-<id>.<domain> (wildcard DNS)
# tls-cert = \"/etc/cubicle/tls/fullchain.pem\"
# tls-key = \"/etc/cubicle/tls/privkey.pem\"
# pool = {{ base = 4 }}                  # default: sized from host memory; \"\" = none
# metrics-listen = \"127.0.0.1:9464\"     # Prometheus without a key, on its own address
",
        state_dir.display()
    )
}

fn binary(args: &UnitArgs) -> anyhow::Result<PathBuf> {
    match &args.binary {
        Some(b) => Ok(b.clone()),
        None => std::env::current_exe().context("finding the cubicle binary"),
    }
}

/// Whether systemd manages this machine (`/run/systemd/system` exists).
fn systemd_running() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

fn systemctl(args: &[&str]) -> anyhow::Result<()> {
    let st = std::process::Command::new("systemctl")
        .args(args)
        .status()
        .with_context(|| format!("running systemctl {}", args.join(" ")))?;
    anyhow::ensure!(st.success(), "systemctl {} failed ({st})", args.join(" "));
    Ok(())
}

pub fn run(state_dir: &Path, cmd: ServiceCommand) -> anyhow::Result<i32> {
    match cmd {
        ServiceCommand::Unit(u) => {
            print!("{}", unit_text(&binary(&u)?, &u.config_file));
        }
        ServiceCommand::Install(a) => {
            let bin = binary(&a.unit)?;
            if !bin.is_file() {
                anyhow::bail!("{} does not exist (--binary)", bin.display());
            }
            let cfg = &a.unit.config_file;
            if !cfg.exists() {
                if let Some(dir) = cfg.parent() {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
                std::fs::write(cfg, default_config(state_dir))
                    .with_context(|| format!("writing {}", cfg.display()))?;
                eprintln!("cubicle: wrote {}", cfg.display());
            } else {
                eprintln!("cubicle: keeping the existing {}", cfg.display());
            }
            std::fs::create_dir_all(&a.unit_dir)
                .with_context(|| format!("creating {}", a.unit_dir.display()))?;
            let unit = a.unit_dir.join(UNIT);
            std::fs::write(&unit, unit_text(&bin, cfg))
                .with_context(|| format!("writing {}", unit.display()))?;
            eprintln!("cubicle: wrote {}", unit.display());
            if a.no_start {
                eprintln!(
                    "cubicle: not started (--no-start): systemctl daemon-reload && systemctl enable --now cubicle"
                );
            } else if !systemd_running() {
                eprintln!(
                    "cubicle: systemd does not run this machine: start `{} --config {} serve` another way",
                    bin.display(),
                    cfg.display()
                );
            } else {
                systemctl(&["daemon-reload"])?;
                systemctl(&["enable", "--now", "cubicle"])?;
                eprintln!(
                    "cubicle: started; the admin key: `cubicle apikey`; logs: journalctl -u cubicle"
                );
            }
        }
        ServiceCommand::Uninstall { unit_dir } => {
            let unit = unit_dir.join(UNIT);
            if systemd_running() {
                // Stopping leaves the sandboxes running (they are outside the unit).
                let _ = systemctl(&["disable", "--now", "cubicle"]);
            }
            match std::fs::remove_file(&unit) {
                Ok(()) => eprintln!("cubicle: removed {}", unit.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    eprintln!("cubicle: {} was not installed", unit.display())
                }
                Err(e) => return Err(e).with_context(|| format!("removing {}", unit.display())),
            }
            if systemd_running() {
                systemctl(&["daemon-reload"])?;
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_names_binary_config_and_kill_mode() {
        let u = unit_text(
            Path::new("/opt/cubicle/cubicle"),
            Path::new("/etc/cubicle/c.toml"),
        );
        assert!(u.contains("ExecStart=/opt/cubicle/cubicle --config /etc/cubicle/c.toml serve"));
        assert!(u.contains("Type=notify"));
        assert!(u.contains("KillMode=mixed"));
        assert!(!u.contains("KillMode=control-group"));
    }

    #[test]
    fn the_default_config_parses_and_names_only_real_options() {
        let t: toml::Table = default_config(Path::new("/var/lib/cubicle"))
            .parse()
            .unwrap();
        assert_eq!(t["state-dir"].as_str(), Some("/var/lib/cubicle"));
        assert_eq!(t["serve"]["listen"].as_str(), Some("127.0.0.1:3000"));
    }
}
