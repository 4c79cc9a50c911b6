//! `cubicle sandbox …`: the client of a running `cubicle serve`, speaking to it exactly
//! as an E2B SDK does: the REST control plane (`X-API-KEY`) for create / list / info /
//! kill / logs, and envd's Connect API through the data-plane router (`E2b-Sandbox-Id`,
//! `E2b-Sandbox-Port: 49983`, `X-Access-Token` from `POST /v2/sandboxes/{id}/connect`)
//! for exec and the interactive shell.
//!
//! Layout: `args` (flags, settings), `http` (HTTP/1.1 transport), `rest` (REST
//! calls), `connect` (Connect envelopes and calls), `commands` (create/list/info/kill),
//! `exec` (with `-i` stdin), `files` (`cp`), `metrics`, `shell` + `tty` (PTY session, raw
//! mode), `logs`, `netlog`.

mod args;
mod commands;
mod connect;
mod error;
mod exec;
mod files;
mod http;
mod logs;
mod metrics;
mod netlog;
mod rest;
mod shell;
pub mod templates;
#[cfg(test)]
mod testserver;
mod tty;
mod volume;

use std::{collections::HashMap, path::Path, time::Duration};

pub use args::{SandboxArgs, SandboxCommand};
pub use error::ClientError;
pub use volume::{VolumeArgs, run_volume};

// For `cubicle bench`, which calls the server as this client does.
pub(crate) use connect::EnvdClient;
pub(crate) use http::{BaseUrl, Connection, full as full_body, read_body};
pub use rest::ApiClient;
pub(crate) use rest::{ListFilter, NewSandbox};

/// Runs one `cubicle sandbox …` command; returns the process exit code.
pub async fn run(args: SandboxArgs, state_dir: &Path) -> anyhow::Result<i32> {
    let settings = args.settings(state_dir)?;
    let api = ApiClient::new(settings.api.clone(), settings.api_key.clone());
    match args.command {
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
            let a = commands::CreateArgs {
                template,
                timeout,
                metadata,
                env,
                volume_mounts: volumes,
                cpus,
                memory_mb,
                disk_mb,
                network,
                json,
            };
            commands::create(&api, a).await
        }
        SandboxCommand::Network { id, network } => {
            api.update_network(&id, &network.body()).await?;
            Ok(0)
        }
        SandboxCommand::Netlog {
            id,
            follow,
            json,
            allowlist,
        } => netlog::run(&api, &id, follow, json, allowlist).await,
        SandboxCommand::List {
            filter,
            all_teams,
            format,
        } => commands::list(&api, &filter, all_teams, &format).await,
        SandboxCommand::Info { id, json } => commands::info(&api, &id, json).await,
        SandboxCommand::Kill {
            ids,
            all,
            filter,
            all_teams,
        } => {
            if all {
                commands::kill_all(&api, &filter, all_teams).await
            } else {
                commands::kill(&api, &ids).await
            }
        }
        SandboxCommand::Pause { id, filesystem } => commands::pause(&api, &id, !filesystem).await,
        SandboxCommand::Resume {
            id,
            timeout,
            reboot,
        } => commands::resume(&api, &id, timeout, !reboot).await,
        SandboxCommand::Snapshot {
            id,
            name,
            filesystem,
            json,
        } => commands::snapshot(&api, &id, name, !filesystem, json).await,
        SandboxCommand::Snapshots { sandbox, json } => {
            commands::snapshots(&api, sandbox.as_deref(), json).await
        }
        SandboxCommand::DeleteSnapshot { id } => commands::delete_snapshot(&api, &id).await,
        SandboxCommand::Fork {
            id,
            count,
            timeout,
            json,
        } => commands::fork(&api, &id, count, timeout, json).await,
        SandboxCommand::Rollback { id, snapshot } => commands::rollback(&api, &id, &snapshot).await,
        SandboxCommand::Logs {
            id,
            follow,
            timestamps,
        } => logs::run(&api, &id, follow, timestamps).await,
        SandboxCommand::Metrics { id, follow, format } => {
            metrics::run(&api, &id, follow, format.is_json()).await
        }
        SandboxCommand::SetTimeout { id, secs } => {
            api.set_timeout(&id, secs).await?;
            println!("{id} ends in {secs} s");
            Ok(0)
        }
        SandboxCommand::Cp { src, dst, user } => {
            let (src, dst) = (files::Location::parse(&src), files::Location::parse(&dst));
            let done = match (&src, &dst) {
                (files::Location::Sandbox { .. }, files::Location::Sandbox { .. }) => {
                    anyhow::bail!("copy between two sandboxes is not supported: copy out, then in")
                }
                (_, files::Location::Sandbox { id, path }) => {
                    let envd = envd_for(&api, &settings.sandbox, id, user).await?;
                    files::copy_in(&envd, &src, path).await?
                }
                (files::Location::Sandbox { id, path }, _) => {
                    let envd = envd_for(&api, &settings.sandbox, id, user).await?;
                    files::copy_out(&envd, path, &dst).await?
                }
                _ => anyhow::bail!(
                    "one side of cp must be in a sandbox: ID:PATH (e.g. cubicle sandbox cp ./f ID:/tmp/)"
                ),
            };
            if dst != files::Location::Std {
                eprintln!("copied {done}");
            }
            Ok(0)
        }
        SandboxCommand::Exec {
            id,
            interactive,
            user,
            cwd,
            env,
            timeout,
            cmd,
        } => {
            let envd = envd_for(&api, &settings.sandbox, &id, user).await?;
            let spec = exec::ExecSpec {
                cmd: cmd.join(" "),
                envs: env.into_iter().collect(),
                cwd,
                timeout: (timeout > 0).then(|| Duration::from_secs(timeout)),
                stdin: interactive,
            };
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    if tx.send(()).await.is_err() {
                        return;
                    }
                }
            });
            let input = interactive.then(exec::stdin_channel);
            let mut out = tokio::io::stdout();
            let mut err = tokio::io::stderr();
            exec::run(&envd, &spec, &mut out, &mut err, rx, input).await
        }
        SandboxCommand::Shell { id, user, cwd } => {
            let envd = envd_for(&api, &settings.sandbox, &id, user).await?;
            shell::run(&envd, HashMap::new(), cwd).await
        }
    }
}

/// The envd client for a sandbox: `POST /v2/sandboxes/{id}/connect` (as the SDK's
/// `Sandbox.connect`) gives the access token; calls go to the sandbox URL.
async fn envd_for(
    api: &ApiClient,
    sandbox_url: &http::BaseUrl,
    id: &str,
    user: Option<String>,
) -> anyhow::Result<EnvdClient> {
    // timeout 1: the server keeps end = max(end, now + 1 s), so running a command does
    // not extend the sandbox's life (the SDK's `{}` would stretch it to 300 s).
    let sbx = api
        .connect(id, Some(1))
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("connecting to sandbox {id}")))?;
    Ok(EnvdClient::new(
        sandbox_url.clone(),
        &sbx.sandbox_id,
        sbx.envd_access_token,
        user,
    ))
}
