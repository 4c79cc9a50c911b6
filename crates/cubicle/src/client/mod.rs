//! `cubicle sandbox …`: the client of a running `cubicle serve`, speaking to it exactly
//! as an E2B SDK does: the REST control plane (`X-API-KEY`) for create / list / info /
//! kill / logs, and envd's Connect API through the data-plane router (`E2b-Sandbox-Id`,
//! `E2b-Sandbox-Port: 49983`, `X-Access-Token` from `POST /v2/sandboxes/{id}/connect`)
//! for exec and the interactive shell.
//!
//! Layout: `args` (flags, settings), `http` (plain-HTTP/1.1 transport), `rest` (REST
//! calls), `connect` (Connect envelopes and calls), `commands` (create/list/info/kill),
//! `exec`, `shell` + `tty` (PTY session, raw mode), `logs`, `netlog`.

mod args;
mod commands;
mod connect;
mod error;
mod exec;
mod http;
mod logs;
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

use connect::EnvdClient;
pub use rest::ApiClient;
use rest::NewSandbox;

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
            network,
            json,
        } => {
            let req = NewSandbox {
                template_id: template,
                timeout,
                metadata: metadata.into_iter().collect(),
                env_vars: env.into_iter().collect(),
                volume_mounts: volumes,
                network: network.any().then(|| network.body()),
            };
            commands::create(&api, req, json).await
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
            json,
            metadata,
            states,
        } => commands::list(&api, json, metadata, states).await,
        SandboxCommand::Info { id, json } => commands::info(&api, &id, json).await,
        SandboxCommand::Kill { ids } => commands::kill(&api, &ids).await,
        SandboxCommand::Logs {
            id,
            follow,
            timestamps,
        } => logs::run(&api, &id, follow, timestamps).await,
        SandboxCommand::Exec {
            id,
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
            };
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    if tx.send(()).await.is_err() {
                        return;
                    }
                }
            });
            let mut out = tokio::io::stdout();
            let mut err = tokio::io::stderr();
            exec::run(&envd, &spec, &mut out, &mut err, rx).await
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
