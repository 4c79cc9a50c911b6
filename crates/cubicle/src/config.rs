//! The config file: TOML, merged under the command line and the environment.
//!
//! Precedence, highest first: command-line flags, environment variables
//! (`CUBICLE_…`), the config file, built-in defaults. The file is `--config PATH`
//! (`CUBICLE_CONFIG`), else `/etc/cubicle/config.toml` when it exists. Keys are the
//! long flag names (`-` or `_`): top-level keys are the global options (`state-dir`,
//! `log-format`, …), the `[serve]` table holds `cubicle serve`'s:
//!
//! ```toml
//! state-dir = "/var/lib/cubicle"
//! log-format = "json"
//!
//! [serve]
//! listen = "0.0.0.0:443"
//! domain = "sandbox.example.com"
//! tls-cert = "/etc/cubicle/tls/fullchain.pem"
//! tls-key = "/etc/cubicle/tls/privkey.pem"
//! pool = { base = 8 }          # or "base=8,tiny=2"
//! metrics-listen = "127.0.0.1:9464"
//! ```
//!
//! How: the command line is parsed once; every option the file sets that came from
//! neither the command line nor the environment is appended as a flag, and the result
//! parsed again. An unknown key is an error naming the valid ones (a typo must not be
//! silently ignored).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use clap::parser::ValueSource;

/// The file read when `--config` is not given (and it exists).
pub const DEFAULT_CONFIG: &str = "/etc/cubicle/config.toml";

/// Subcommands whose options may come from a table of the same name.
const TABLES: &[&str] = &["serve"];

/// `argv` with the config file's options added where the command line and the
/// environment set nothing. On a parse error (or `--help`), `argv` unchanged: the real
/// parse reports it.
pub fn merge(cmd: clap::Command, argv: Vec<OsString>) -> anyhow::Result<Vec<OsString>> {
    let Ok(matches) = cmd.clone().try_get_matches_from(&argv) else {
        return Ok(argv);
    };
    let explicit = matches.get_one::<PathBuf>("config").cloned();
    let path = match &explicit {
        Some(p) => p.clone(),
        None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
        None => return Ok(argv),
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("parsing the config file {}", path.display()))?;
    let mut extra = Vec::new();
    let sub = matches.subcommand();
    for (key, value) in &table {
        if let toml::Value::Table(t) = value
            && TABLES.contains(&key.as_str())
        {
            let Some((name, sub_matches)) = sub else {
                continue;
            };
            if name != key {
                continue;
            }
            let sub_cmd = cmd
                .find_subcommand(name)
                .ok_or_else(|| anyhow!("no subcommand {name}"))?;
            for (k, v) in t {
                add(
                    sub_cmd,
                    sub_matches,
                    &path,
                    &format!("[{name}] "),
                    k,
                    v,
                    &mut extra,
                )?;
            }
            continue;
        }
        add(&cmd, &matches, &path, "", key, value, &mut extra)?;
    }
    let mut out = argv;
    out.extend(extra);
    Ok(out)
}

/// Appends `--flag value` for `key` unless the command line or environment set it.
fn add(
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
    path: &Path,
    section: &str,
    key: &str,
    value: &toml::Value,
    out: &mut Vec<OsString>,
) -> anyhow::Result<()> {
    let long = key.replace('_', "-");
    let arg = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long.as_str()))
        .filter(|_| !["config", "help", "version"].contains(&long.as_str()))
        .ok_or_else(|| {
            let mut known: Vec<String> = cmd
                .get_arguments()
                .filter(|a| !a.is_hide_set())
                .filter_map(|a| a.get_long())
                .filter(|l| !["help", "version", "config"].contains(l))
                .map(str::to_string)
                .collect();
            known.sort();
            anyhow!(
                "{}: unknown option {section}'{key}' (valid here: {})",
                path.display(),
                known.join(", ")
            )
        })?;
    let id = arg.get_id().as_str();
    match matches.value_source(id) {
        Some(ValueSource::CommandLine) | Some(ValueSource::EnvVariable) => return Ok(()),
        _ => {}
    }
    let flag = format!("--{long}");
    let takes_value = arg.get_action().takes_values();
    match value {
        toml::Value::Boolean(b) if !takes_value => {
            if *b {
                out.push(flag.into());
            }
        }
        toml::Value::Table(t) => {
            // `pool = { base = 8, tiny = 2 }` → `base=8,tiny=2`
            let parts: Vec<String> = t
                .iter()
                .map(|(k, v)| format!("{k}={}", scalar(v)))
                .collect();
            out.push(flag.into());
            out.push(parts.join(",").into());
        }
        toml::Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(scalar).collect();
            out.push(flag.into());
            out.push(parts.join(",").into());
        }
        v if takes_value => {
            out.push(flag.into());
            out.push(scalar(v).into());
        }
        v => bail!(
            "{}: option {section}'{key}' is a switch: write {key} = true or false, not {v}",
            path.display()
        ),
    }
    Ok(())
}

fn scalar(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    fn cli(env: &'static str) -> Command {
        Command::new("cubicle")
            .arg(
                Arg::new("config")
                    .long("config")
                    .global(true)
                    .value_parser(clap::value_parser!(PathBuf)),
            )
            .arg(
                Arg::new("state_dir")
                    .long("state-dir")
                    .global(true)
                    .env(env)
                    .default_value("/var/lib/cubicle"),
            )
            .subcommand(
                Command::new("serve")
                    .arg(
                        Arg::new("listen")
                            .long("listen")
                            .default_value("127.0.0.1:3000"),
                    )
                    .arg(Arg::new("pool").long("pool"))
                    .arg(
                        Arg::new("no_build")
                            .long("no-build-templates")
                            .action(ArgAction::SetTrue),
                    ),
            )
            .subcommand(Command::new("apikey"))
    }

    fn run(args: &[&str], file: &str) -> anyhow::Result<Vec<String>> {
        run_env(args, file, "CUBICLE_TEST_CFG_STATE_UNSET")
    }

    fn run_env(args: &[&str], file: &str, env: &'static str) -> anyhow::Result<Vec<String>> {
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let path =
            std::env::temp_dir().join(format!("cubicle-cfg-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, file).unwrap();
        let mut argv: Vec<OsString> =
            vec!["cubicle".into(), "--config".into(), path.clone().into()];
        argv.extend(args.iter().map(OsString::from));
        let merged = merge(cli(env), argv);
        let _ = std::fs::remove_file(&path);
        Ok(merged?
            .into_iter()
            .skip(3)
            .map(|s| s.into_string().unwrap())
            .collect())
    }

    #[test]
    fn file_fills_what_flags_leave_open() {
        let file = "state_dir = \"/srv/c\"\n[serve]\nlisten = \"0.0.0.0:443\"\npool = { base = 8 }\nno-build-templates = true\n";
        assert_eq!(
            run(&["serve"], file).unwrap(),
            [
                "serve",
                "--listen",
                "0.0.0.0:443",
                "--no-build-templates",
                "--pool",
                "base=8",
                "--state-dir",
                "/srv/c",
            ]
        );
        // A flag wins over the file.
        let out = run(&["serve", "--listen", "127.0.0.1:9"], file).unwrap();
        assert!(!out.contains(&"0.0.0.0:443".to_string()), "{out:?}");
        // Other subcommands take the global keys only.
        assert_eq!(
            run(&["apikey"], file).unwrap(),
            ["apikey", "--state-dir", "/srv/c"]
        );
    }

    #[test]
    fn environment_wins_over_the_file() {
        // SAFETY: this test's variable is read by this test only.
        unsafe { std::env::set_var("CUBICLE_TEST_CFG_STATE", "/from/env") };
        let out = run_env(
            &["apikey"],
            "state-dir = \"/srv/c\"\n",
            "CUBICLE_TEST_CFG_STATE",
        )
        .unwrap();
        // SAFETY: as above.
        unsafe { std::env::remove_var("CUBICLE_TEST_CFG_STATE") };
        assert_eq!(out, ["apikey"]);
    }

    #[test]
    fn typos_are_errors() {
        let e = run(&["serve"], "[serve]\nlisten_on = \"x\"\n").unwrap_err();
        assert!(
            e.to_string().contains("unknown option [serve] 'listen_on'"),
            "{e}"
        );
        assert!(e.to_string().contains("listen"), "{e}");
        let e = run(&["serve"], "[serve]\nno-build-templates = \"yes\"\n").unwrap_err();
        assert!(e.to_string().contains("switch"), "{e}");
        assert!(run(&["serve"], "not toml = = 1").is_err());
    }
}
