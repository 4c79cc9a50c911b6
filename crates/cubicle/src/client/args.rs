//! Command-line arguments of `cubicle sandbox …` and where the connection settings come
//! from (flags, `E2B_*` environment variables, the server's admin key file).

use std::path::Path;

use clap::{Args, Subcommand};

use super::{ClientError, http::BaseUrl};
use crate::output::FormatArg;

/// Default address of `cubicle serve`.
pub const DEFAULT_API_URL: &str = "http://127.0.0.1:3000";
/// File (in the state directory) where `cubicle serve` leaves the admin team's key.
pub const ADMIN_KEY_FILE: &str = "admin-api-key";

/// `cubicle sandbox …`: sandboxes of a running `cubicle serve`, through its REST API and
/// router, as an E2B SDK would use them.
#[derive(Args, Debug)]
pub struct SandboxArgs {
    /// REST API of `cubicle serve` (http:// or https://).
    #[arg(long, global = true, env = "E2B_API_URL", value_name = "URL")]
    pub api_url: Option<String>,
    /// API key (default: `<state-dir>/admin-api-key`, written by `cubicle serve`).
    #[arg(
        long,
        global = true,
        env = "E2B_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub api_key: Option<String>,
    /// Data-plane (router) URL for exec/shell (default: the API URL).
    #[arg(long, global = true, env = "E2B_SANDBOX_URL", value_name = "URL")]
    pub sandbox_url: Option<String>,
    #[command(subcommand)]
    pub command: SandboxCommand,
}

/// Sandbox subcommands.
#[derive(Subcommand, Debug)]
pub enum SandboxCommand {
    /// Create a sandbox; prints its id.
    Create {
        /// Template (name, alias or `name:tag`).
        #[arg(long, short, default_value = "base")]
        template: String,
        /// Seconds until the sandbox is killed (server default: 300).
        #[arg(long, value_name = "SECS")]
        timeout: Option<u64>,
        /// Metadata `KEY=VALUE` (repeatable).
        #[arg(long = "metadata", short = 'm', value_name = "KEY=VALUE", value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
        /// Environment variable for every process in the sandbox, `KEY=VALUE` (repeatable).
        #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Mount a volume: `NAME:/path`, or `NAME:/path:ro` read-only (repeatable).
        #[arg(long = "volume", short = 'v', value_name = "NAME:PATH[:ro]", value_parser = parse_volume_mount)]
        volumes: Vec<serde_json::Value>,
        #[command(flatten)]
        network: NetworkFlags,
        /// vCPUs (CPU share) instead of the template's; up to the server's CPUs.
        #[arg(long, value_name = "N")]
        cpus: Option<u32>,
        /// Memory limit in MiB instead of the template's; up to the server's memory.
        #[arg(long, value_name = "MIB")]
        memory_mb: Option<u64>,
        /// Writable-layer quota in MiB instead of the template's.
        #[arg(long, value_name = "MIB")]
        disk_mb: Option<u64>,
        /// Print the server's whole JSON answer instead of the id.
        #[arg(long)]
        json: bool,
    },
    /// Replace a running sandbox's egress policy (`PUT /sandboxes/{id}/network`: what
    /// is not given is cleared).
    Network {
        /// Sandbox id.
        id: String,
        #[command(flatten)]
        network: NetworkFlags,
    },
    /// Print a sandbox's network audit trail: DNS questions and answers, connection
    /// attempts with their verdicts, bytes of closed connections.
    Netlog {
        /// Sandbox id.
        id: String,
        /// Keep printing new events until the sandbox goes away (or Ctrl-C).
        #[arg(long, short)]
        follow: bool,
        /// Print events as JSON lines.
        #[arg(long)]
        json: bool,
        /// Print the allow list that would have permitted everything in the trail
        /// (after a run in learn mode), as the `network` options of a create.
        #[arg(long)]
        allowlist: bool,
    },
    /// List sandboxes (running and paused).
    #[command(alias = "ls")]
    List {
        #[command(flatten)]
        filter: Filter,
        /// Every team's sandboxes on the host, with their team (the operator's key only).
        #[arg(long)]
        all_teams: bool,
        #[command(flatten)]
        format: FormatArg,
    },
    /// Show one sandbox.
    Info {
        /// Sandbox id.
        id: String,
        /// Print the server's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Kill sandboxes: the ones named, or with --all every one the filters select.
    #[command(alias = "rm")]
    Kill {
        /// Sandbox ids.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<String>,
        /// Kill every sandbox that --state/--metadata/--template select (all by default).
        #[arg(long, short)]
        all: bool,
        #[command(flatten)]
        filter: Filter,
        /// With --all: every team's sandboxes on the host (the operator's key only).
        #[arg(long, requires = "all")]
        all_teams: bool,
    },
    /// Pause a sandbox: its processes and memory go to disk (no host memory, no CPU
    /// while paused); `resume` brings them back.
    Pause {
        /// Sandbox id.
        id: String,
        /// Keep only the disk (a resume boots the template again over it).
        #[arg(long)]
        filesystem: bool,
    },
    /// Resume a paused sandbox (a running one only gets its end time extended).
    Resume {
        /// Sandbox id.
        id: String,
        /// Seconds until the resumed sandbox ends (server default: 300).
        #[arg(long, value_name = "SECS")]
        timeout: Option<u64>,
        /// Boot from the disk instead of restoring memory.
        #[arg(long)]
        reboot: bool,
    },
    /// Snapshot a running sandbox (it runs on); prints the snapshot id, which works as a
    /// template (`create -t ID`) and for `rollback`.
    Snapshot {
        /// Sandbox id.
        id: String,
        /// Name (`name` or `name:tag`).
        #[arg(long)]
        name: Option<String>,
        /// Keep only the disk (sandboxes made from it boot).
        #[arg(long)]
        filesystem: bool,
        /// Print the server's whole JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// List snapshots (`--sandbox` of one sandbox only).
    Snapshots {
        /// Only this sandbox's.
        #[arg(long)]
        sandbox: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot.
    DeleteSnapshot {
        /// Snapshot id or name.
        id: String,
    },
    /// Fork a running sandbox: COUNT new sandboxes with its memory and disk; prints their
    /// ids.
    Fork {
        /// Sandbox id.
        id: String,
        /// How many (1-100).
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Seconds until the forks end (server default: 15, as E2B).
        #[arg(long, value_name = "SECS")]
        timeout: Option<u64>,
        /// Print the server's whole JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// Put a sandbox back to one of its snapshots, in place (same id and address).
    Rollback {
        /// Sandbox id.
        id: String,
        /// Snapshot id or name.
        snapshot: String,
    },
    /// Run a command in a sandbox (`/bin/bash -l -c CMD`), stream its output, exit with
    /// its exit code. Several words are joined with spaces, as ssh does; `--` before
    /// CMD is optional. Exit codes of Cubicle's own: 125 (Cubicle failed: server,
    /// sandbox, connection), 126 (the command could not be started, e.g. no such
    /// --cwd or --user), 127 (command not found).
    Exec {
        /// Sandbox id.
        id: String,
        /// Stream this terminal's stdin to the command (closed at end of input). Without
        /// it the command's stdin is empty.
        #[arg(long, short)]
        interactive: bool,
        /// Run as this user (default: the sandbox's default user).
        #[arg(long, short)]
        user: Option<String>,
        /// Working directory.
        #[arg(long, short = 'w')]
        cwd: Option<String>,
        /// Environment variable for this command, `KEY=VALUE` (repeatable).
        #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Kill the command after this many seconds (0: never).
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        timeout: u64,
        /// The command.
        #[arg(
            required = true,
            value_name = "CMD",
            trailing_var_arg = true,
            allow_hyphen_values = true
        )]
        cmd: Vec<String>,
    },
    /// Copy files or directories into or out of a sandbox: `cp PATH ID:DEST` or
    /// `cp ID:PATH DEST` (`-` is stdin or stdout, for one file).
    Cp {
        /// Source: a local path, `-`, or `ID:PATH`.
        src: String,
        /// Destination: a local path, `-`, or `ID:PATH`.
        dst: String,
        /// Act in the sandbox as this user (owner of what is written; `~` and relative
        /// paths are its home).
        #[arg(long, short)]
        user: Option<String>,
    },
    /// A sandbox's CPU, memory and disk use (samples every 5 s).
    Metrics {
        /// Sandbox id.
        id: String,
        /// Keep printing new samples until the sandbox goes away (or Ctrl-C).
        #[arg(long, short)]
        follow: bool,
        #[command(flatten)]
        format: FormatArg,
    },
    /// Set when a sandbox ends: SECS from now (0 ends it now).
    #[command(alias = "timeout")]
    SetTimeout {
        /// Sandbox id.
        id: String,
        /// Seconds from now.
        secs: u64,
    },
    /// Print a sandbox's logs (envd and start-command output).
    Logs {
        /// Sandbox id.
        id: String,
        /// Keep printing new lines until the sandbox goes away (or Ctrl-C).
        #[arg(long, short)]
        follow: bool,
        /// Prefix each line with its timestamp.
        #[arg(long)]
        timestamps: bool,
    },
    /// Interactive shell in a sandbox (a PTY through the router).
    Shell {
        /// Sandbox id.
        id: String,
        /// Run as this user (default: the sandbox's default user).
        #[arg(long, short)]
        user: Option<String>,
        /// Working directory.
        #[arg(long)]
        cwd: Option<String>,
    },
}

/// E2B `network` options on the command line.
#[derive(Args, Debug, Default, Clone)]
pub struct NetworkFlags {
    /// Allow outbound traffic to an address, CIDR, domain or `*.domain` (repeatable;
    /// wins over --deny-out).
    #[arg(long = "allow-out", value_name = "DEST")]
    pub allow_out: Vec<String>,
    /// Deny outbound traffic to an address or CIDR (repeatable; `0.0.0.0/0`: all).
    #[arg(long = "deny-out", value_name = "CIDR")]
    pub deny_out: Vec<String>,
    /// No internet, except what --allow-out names.
    #[arg(long)]
    pub no_internet: bool,
    /// Upstream DNS server for the sandbox (repeatable).
    #[arg(long = "dns", value_name = "IP")]
    pub dns_servers: Vec<String>,
    /// Tunnel outbound TCP through this SOCKS5 proxy (`host:port`).
    #[arg(long, value_name = "HOST:PORT")]
    pub egress_proxy: Option<String>,
    /// Learn mode: deny nothing, record what the policy would deny (see `netlog
    /// --allowlist`).
    #[arg(long)]
    pub learn: bool,
}

impl NetworkFlags {
    /// Whether any option was given.
    pub fn any(&self) -> bool {
        !self.allow_out.is_empty()
            || !self.deny_out.is_empty()
            || self.no_internet
            || !self.dns_servers.is_empty()
            || self.egress_proxy.is_some()
            || self.learn
    }

    /// The JSON the API takes (`network` of a create; the body of a network update).
    pub fn body(&self) -> serde_json::Value {
        let mut v = serde_json::json!({});
        if !self.allow_out.is_empty() {
            v["allowOut"] = serde_json::json!(self.allow_out);
        }
        let mut deny = self.deny_out.clone();
        if self.no_internet && !deny.iter().any(|d| d == "0.0.0.0/0") {
            deny.push("0.0.0.0/0".into());
        }
        if !deny.is_empty() {
            v["denyOut"] = serde_json::json!(deny);
        }
        if !self.dns_servers.is_empty() {
            v["dnsServers"] = serde_json::json!(self.dns_servers);
        }
        if let Some(p) = &self.egress_proxy {
            v["egressProxy"] = serde_json::json!({ "address": p });
        }
        if self.learn {
            v["learn"] = true.into();
        }
        v
    }
}

/// Which sandboxes a list or `kill --all` selects.
#[derive(Args, Debug, Clone, Default)]
pub struct Filter {
    /// Only sandboxes with this metadata `KEY=VALUE` (repeatable; all must match).
    #[arg(long = "metadata", short = 'm', value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
    /// Only sandboxes in this state (`running`, `paused`; repeatable).
    #[arg(long = "state", value_name = "STATE")]
    pub states: Vec<String>,
    /// Only sandboxes of this template (id or alias).
    #[arg(long, value_name = "TEMPLATE")]
    pub template: Option<String>,
}

/// Parses `KEY=VALUE` (the value may contain `=`; the key may not be empty).
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Parses `NAME:/path[:ro]` into a `volumeMounts` item.
pub fn parse_volume_mount(s: &str) -> Result<serde_json::Value, String> {
    let (name, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("expected NAME:/path[:ro], got {s:?}"))?;
    let (path, ro) = match rest.strip_suffix(":ro") {
        Some(p) => (p, true),
        None => (rest.strip_suffix(":rw").unwrap_or(rest), false),
    };
    if name.is_empty() || !path.starts_with('/') {
        return Err(format!(
            "expected NAME:/path[:ro] with an absolute path, got {s:?}"
        ));
    }
    let mut v = serde_json::json!({"name": name, "path": path});
    if ro {
        v["readOnly"] = true.into();
    }
    Ok(v)
}

/// Resolved connection settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub api: BaseUrl,
    pub sandbox: BaseUrl,
    pub api_key: String,
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

impl SandboxArgs {
    /// Resolves URLs and the API key (flag/env, else `<state_dir>/admin-api-key`).
    pub fn settings(&self, state_dir: &Path) -> Result<Settings, ClientError> {
        settings_from(&self.api_url, &self.api_key, &self.sandbox_url, state_dir)
    }
}

/// Resolves URLs and the API key from flags/env values, else the defaults and
/// `<state_dir>/admin-api-key` (for every client command group).
pub fn settings_from(
    api_url: &Option<String>,
    api_key: &Option<String>,
    sandbox_url: &Option<String>,
    state_dir: &Path,
) -> Result<Settings, ClientError> {
    let api = BaseUrl::parse(non_empty(api_url).unwrap_or(DEFAULT_API_URL))?;
    let sandbox = match non_empty(sandbox_url) {
        Some(u) => BaseUrl::parse(u)?,
        None => api.clone(),
    };
    let api_key = match non_empty(api_key) {
        Some(k) => k.to_string(),
        None => read_admin_key(state_dir)?,
    };
    Ok(Settings {
        api,
        sandbox,
        api_key,
    })
}

fn read_admin_key(state_dir: &Path) -> Result<String, ClientError> {
    let path = state_dir.join(ADMIN_KEY_FILE);
    let missing = |why: String| {
        ClientError::Config(format!(
            "no API key: set E2B_API_KEY or --api-key ({why}; `cubicle serve` writes the \
             admin key to {} on its first start, `cubicle apikey create` makes more)",
            path.display()
        ))
    };
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let key = s.trim();
            if key.is_empty() {
                Err(missing(format!("{} is empty", path.display())))
            } else {
                Ok(key.to_string())
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(missing(format!("{} does not exist", path.display())))
        }
        Err(e) => Err(missing(format!("cannot read {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Top {
        #[command(subcommand)]
        cmd: Top2,
    }
    #[derive(Subcommand, Debug)]
    enum Top2 {
        Sandbox(SandboxArgs),
    }

    fn parse(args: &[&str]) -> Result<SandboxArgs, clap::Error> {
        let mut v = vec!["cubicle", "sandbox"];
        v.extend_from_slice(args);
        Top::try_parse_from(v).map(|t| match t.cmd {
            Top2::Sandbox(a) => a,
        })
    }

    #[test]
    fn parses_create() {
        let a = parse(&[
            "create",
            "--template",
            "tiny",
            "--timeout",
            "60",
            "--metadata",
            "a=b=c",
            "-m",
            "x=",
            "--env",
            "K=V",
            "-v",
            "data:/mnt/d:ro",
            "--cpus",
            "2",
            "--memory-mb",
            "1024",
            "--no-internet",
        ])
        .unwrap();
        match a.command {
            SandboxCommand::Create {
                template,
                timeout,
                metadata,
                env,
                volumes,
                cpus,
                memory_mb,
                disk_mb,
                network,
                json,
            } => {
                assert_eq!(
                    volumes,
                    vec![serde_json::json!({"name": "data", "path": "/mnt/d", "readOnly": true})]
                );
                assert_eq!(template, "tiny");
                assert_eq!(timeout, Some(60));
                assert_eq!(
                    metadata,
                    vec![("a".into(), "b=c".into()), ("x".into(), String::new())]
                );
                assert_eq!(env, vec![("K".into(), "V".into())]);
                assert_eq!((cpus, memory_mb, disk_mb), (Some(2), Some(1024), None));
                assert!(network.no_internet && network.any());
                assert!(!json);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["create"]).unwrap().command {
            SandboxCommand::Create {
                template, timeout, ..
            } => {
                assert_eq!((template.as_str(), timeout), ("base", None))
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["create", "--metadata", "novalue"]).is_err());
        assert!(parse(&["create", "--metadata", "=v"]).is_err());
        assert!(parse(&["create", "--timeout", "-1"]).is_err());
    }

    #[test]
    fn parses_exec_with_global_options_anywhere() {
        let a = parse(&[
            "exec",
            "abc",
            "--user",
            "root",
            "--api-url",
            "http://127.0.0.1:9",
            "--",
            "echo",
            "--user",
            "x y",
        ])
        .unwrap();
        assert_eq!(a.api_url.as_deref(), Some("http://127.0.0.1:9"));
        match a.command {
            SandboxCommand::Exec {
                id,
                user,
                cmd,
                timeout,
                ..
            } => {
                assert_eq!(id, "abc");
                assert_eq!(user.as_deref(), Some("root"));
                assert_eq!(cmd, vec!["echo", "--user", "x y"]);
                assert_eq!(timeout, 0);
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["exec", "abc"]).is_err(), "a command is required");
        let a = parse(&["--api-key", "k", "kill", "a", "b"]).unwrap();
        assert_eq!(a.api_key.as_deref(), Some("k"));
        assert!(
            matches!(a.command, SandboxCommand::Kill { ref ids, all: false, .. } if ids == &["a", "b"])
        );
        assert!(parse(&["kill"]).is_err(), "ids or --all");
        assert!(parse(&["kill", "--all", "a"]).is_err(), "not both");
        assert!(matches!(
            parse(&["kill", "--all", "--template", "base", "-m", "k=v"]).unwrap().command,
            SandboxCommand::Kill { all: true, ref filter, .. }
                if filter.template.as_deref() == Some("base") && filter.metadata.len() == 1
        ));
        assert!(matches!(
            parse(&["logs", "-f", "abc"]).unwrap().command,
            SandboxCommand::Logs { follow: true, .. }
        ));
        assert!(matches!(
            parse(&["ls", "--json", "--state", "running"]).unwrap().command,
            SandboxCommand::List { ref format, ref filter, .. }
                if format.is_json() && filter.states == ["running"]
        ));
        assert!(matches!(
            parse(&["ls", "--format", "json"]).unwrap().command,
            SandboxCommand::List { ref format, .. } if format.is_json()
        ));
        // No `--` needed before the command, and `-i` streams stdin.
        assert!(matches!(
            parse(&["exec", "-i", "abc", "cat", "-n"]).unwrap().command,
            SandboxCommand::Exec { interactive: true, ref cmd, .. } if cmd == &["cat", "-n"]
        ));
        assert!(matches!(
            parse(&["shell", "abc", "--user", "root"]).unwrap().command,
            SandboxCommand::Shell { ref user, .. } if user.as_deref() == Some("root")
        ));
    }

    #[test]
    fn settings_defaults_and_key_file() {
        let dir = std::env::temp_dir().join(format!("cb-client-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut a = SandboxArgs {
            api_url: None,
            api_key: None,
            sandbox_url: None,
            command: SandboxCommand::List {
                filter: Filter::default(),
                all_teams: false,
                format: FormatArg::default(),
            },
        };
        let e = a.settings(&dir).unwrap_err().to_string();
        assert!(
            e.contains("no API key") && e.contains("admin-api-key"),
            "{e}"
        );
        std::fs::write(dir.join(ADMIN_KEY_FILE), "e2b_secret\n").unwrap();
        let s = a.settings(&dir).unwrap();
        assert_eq!(s.api_key, "e2b_secret");
        assert_eq!(s.api.to_string(), DEFAULT_API_URL);
        assert_eq!(s.sandbox, s.api);
        a.api_key = Some("flag".into());
        a.api_url = Some("http://10.0.0.1:80/".into());
        a.sandbox_url = Some("http://10.0.0.2:81".into());
        let s = a.settings(&dir).unwrap();
        assert_eq!(s.api_key, "flag");
        assert_eq!(s.api.url("/x"), "http://10.0.0.1:80/x");
        assert_eq!(s.sandbox.url("/x"), "http://10.0.0.2:81/x");
        // Empty values count as unset.
        a.api_url = Some(String::new());
        a.sandbox_url = Some(" ".into());
        let s = a.settings(&dir).unwrap();
        assert_eq!(s.sandbox.to_string(), DEFAULT_API_URL);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
