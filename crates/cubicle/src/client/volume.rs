//! `cubicle volume …`: volumes of a running `cubicle serve`, as the E2B SDKs use them —
//! the control routes (`/volumes`, API key) and the content API (`/volumecontent`, the
//! volume's token, at `E2B_VOLUME_API_URL` or else the API URL).
//!
//! A volume is named by its id or by its name (looked up in the team's list).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use hyper::Method;
use serde_json::Value;

use super::ClientError;
use super::args::settings_from;
use super::http::BaseUrl;
use super::rest::{ApiClient, QUERY_VALUE, enc, seg};

/// File transfers may take long; everything else answers within a minute.
const FILE_TIMEOUT: Duration = Duration::from_secs(3600);
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// `cubicle volume …`.
#[derive(Args, Debug)]
pub struct VolumeArgs {
    /// REST API of `cubicle serve` (plain http only).
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
    /// The volume content API (default: the API URL; `cubicle serve` serves both).
    #[arg(long, global = true, env = "E2B_VOLUME_API_URL", value_name = "URL")]
    pub volume_api_url: Option<String>,
    #[command(subcommand)]
    pub command: VolumeCommand,
}

/// Volume subcommands.
#[derive(Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create a volume; prints its id.
    Create {
        /// Name (unique in the team; `[a-zA-Z0-9_-]`).
        name: String,
        /// Size limit, e.g. `512M`, `10G` (default: the server's, 10 GiB).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
    },
    /// List the team's volumes.
    #[command(alias = "ls-volumes")]
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a volume (id, name, size, bytes used).
    Info {
        /// Volume id or name.
        volume: String,
        /// Print JSON (includes the content-API token).
        #[arg(long)]
        json: bool,
    },
    /// Delete volumes with everything in them (refused while a sandbox mounts one).
    #[command(alias = "rm-volume")]
    Delete {
        /// Volume ids or names.
        #[arg(required = true)]
        volumes: Vec<String>,
    },
    /// List a directory of a volume.
    Ls {
        /// Volume id or name.
        volume: String,
        /// Directory inside the volume.
        #[arg(default_value = "/")]
        path: String,
        /// Levels to descend.
        #[arg(long, default_value_t = 1)]
        depth: u32,
    },
    /// Print a file of a volume.
    Cat {
        /// Volume id or name.
        volume: String,
        /// File inside the volume.
        path: String,
    },
    /// Upload a local file into a volume (creating parent directories).
    Put {
        /// Volume id or name.
        volume: String,
        /// Local file (`-`: standard input).
        local: PathBuf,
        /// Path inside the volume.
        path: String,
    },
    /// Make a directory in a volume (and its parents).
    Mkdir {
        /// Volume id or name.
        volume: String,
        /// Directory inside the volume.
        path: String,
    },
    /// Remove a file or directory (recursively) from a volume.
    Rm {
        /// Volume id or name.
        volume: String,
        /// Path inside the volume.
        path: String,
    },
}

/// `512M`, `10G`, `1T`, or a plain number of MiB → MiB.
fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'M' => 1,
                'G' => 1 << 10,
                'T' => 1 << 20,
                _ => return Err(format!("unknown size unit in {s:?} (use M, G or T)")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    num.trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("expected a size like 512M or 10G, got {s:?}"))
}

/// Runs one `cubicle volume …` command; returns the process exit code.
pub async fn run_volume(args: VolumeArgs, state_dir: &std::path::Path) -> anyhow::Result<i32> {
    // The same settings `cubicle sandbox` resolves (flags, env, the admin key file).
    let settings = settings_from(&args.api_url, &args.api_key, &None, state_dir)?;
    let api = ApiClient::new(settings.api.clone(), settings.api_key.clone());
    let content_base = match args
        .volume_api_url
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        Some(u) => BaseUrl::parse(u)?,
        None => settings.api.clone(),
    };
    match args.command {
        VolumeCommand::Create { name, size } => {
            let mut body = serde_json::json!({ "name": name });
            if let Some(mb) = size {
                body["sizeMB"] = mb.into();
            }
            let (_, _, b) = api
                .call(
                    Method::POST,
                    "/volumes",
                    Some(serde_json::to_vec(&body)?),
                    CALL_TIMEOUT,
                )
                .await?;
            let v: Value = ApiClient::json("/volumes", &b)?;
            println!("{}", v["volumeID"].as_str().unwrap_or_default());
            Ok(0)
        }
        VolumeCommand::List { json } => {
            let items = list(&api).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&Value::Array(items))?);
            } else {
                println!("{:<38} NAME", "VOLUME ID");
                for v in items {
                    println!(
                        "{:<38} {}",
                        v["volumeID"].as_str().unwrap_or_default(),
                        v["name"].as_str().unwrap_or_default()
                    );
                }
            }
            Ok(0)
        }
        VolumeCommand::Info { volume, json } => {
            let v = info(&api, &volume).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("id:    {}", v["volumeID"].as_str().unwrap_or_default());
                println!("name:  {}", v["name"].as_str().unwrap_or_default());
                if let Some(mb) = v["sizeMB"].as_u64() {
                    println!("size:  {mb} MiB");
                }
                if let Some(used) = v["usedBytes"].as_u64() {
                    println!("used:  {:.1} MiB", used as f64 / (1u64 << 20) as f64);
                }
            }
            Ok(0)
        }
        VolumeCommand::Delete { volumes } => {
            let mut code = 0;
            for vol in volumes {
                let r = async {
                    let id = resolve(&api, &vol).await?;
                    api.call(
                        Method::DELETE,
                        &format!("/volumes/{}", seg(&id)),
                        None,
                        CALL_TIMEOUT,
                    )
                    .await
                }
                .await;
                match r {
                    Ok(_) => eprintln!("deleted volume {vol}"),
                    Err(e) => {
                        eprintln!("cubicle: volume {vol}: {e}");
                        code = 1;
                    }
                }
            }
            Ok(code)
        }
        VolumeCommand::Ls {
            volume,
            path,
            depth,
        } => {
            let c = content(&api, &content_base, &volume).await?;
            let (_, _, b) = c
                .client
                .call(
                    Method::GET,
                    &c.path("dir", &path, &format!("&depth={depth}")),
                    None,
                    CALL_TIMEOUT,
                )
                .await?;
            let entries: Vec<Value> = ApiClient::json("volume listing", &b)?;
            for e in entries {
                let kind = match e["type"].as_str() {
                    Some("directory") => 'd',
                    Some("symlink") => 'l',
                    Some("file") => '-',
                    _ => '?',
                };
                let target = e["target"]
                    .as_str()
                    .map(|t| format!(" -> {t}"))
                    .unwrap_or_default();
                println!(
                    "{kind}{:04o} {:>5} {:>5} {:>10} {}{target}",
                    e["mode"].as_u64().unwrap_or(0),
                    e["uid"].as_u64().unwrap_or(0),
                    e["gid"].as_u64().unwrap_or(0),
                    e["size"].as_u64().unwrap_or(0),
                    e["path"].as_str().unwrap_or_default(),
                );
            }
            Ok(0)
        }
        VolumeCommand::Cat { volume, path } => {
            let c = content(&api, &content_base, &volume).await?;
            let (_, _, b) = c
                .client
                .call(Method::GET, &c.path("file", &path, ""), None, FILE_TIMEOUT)
                .await?;
            use std::io::Write;
            std::io::stdout().write_all(&b)?;
            Ok(0)
        }
        VolumeCommand::Put {
            volume,
            local,
            path,
        } => {
            let data = if local == std::path::Path::new("-") {
                let mut v = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
                v
            } else {
                std::fs::read(&local)
                    .map_err(|e| anyhow::anyhow!("reading {}: {e}", local.display()))?
            };
            let c = content(&api, &content_base, &volume).await?;
            let (_, _, b) = c
                .client
                .call_typed(
                    Method::PUT,
                    &c.path("file", &path, "&force=true"),
                    Some((data, "application/octet-stream")),
                    FILE_TIMEOUT,
                )
                .await?;
            let e: Value = ApiClient::json("volume upload", &b)?;
            eprintln!(
                "wrote {} ({} bytes)",
                e["path"].as_str().unwrap_or_default(),
                e["size"].as_u64().unwrap_or(0)
            );
            Ok(0)
        }
        VolumeCommand::Mkdir { volume, path } => {
            let c = content(&api, &content_base, &volume).await?;
            c.client
                .call(
                    Method::POST,
                    &c.path("dir", &path, "&force=true"),
                    None,
                    CALL_TIMEOUT,
                )
                .await?;
            Ok(0)
        }
        VolumeCommand::Rm { volume, path } => {
            let c = content(&api, &content_base, &volume).await?;
            c.client
                .call(
                    Method::DELETE,
                    &c.path("path", &path, ""),
                    None,
                    CALL_TIMEOUT,
                )
                .await?;
            Ok(0)
        }
    }
}

async fn list(api: &ApiClient) -> Result<Vec<Value>, ClientError> {
    let (_, _, b) = api
        .call(Method::GET, "/volumes", None, CALL_TIMEOUT)
        .await?;
    ApiClient::json("/volumes", &b)
}

/// The id of the volume named by id or name.
async fn resolve(api: &ApiClient, volume: &str) -> Result<String, ClientError> {
    let items = list(api).await?;
    items
        .iter()
        .find(|v| v["volumeID"] == volume)
        .or_else(|| items.iter().find(|v| v["name"] == volume))
        .and_then(|v| v["volumeID"].as_str())
        .map(str::to_string)
        .ok_or_else(|| ClientError::Config(format!("no volume with id or name '{volume}'")))
}

async fn info(api: &ApiClient, volume: &str) -> Result<Value, ClientError> {
    let id = resolve(api, volume).await?;
    let path = format!("/volumes/{}", seg(&id));
    let (_, _, b) = api.call(Method::GET, &path, None, CALL_TIMEOUT).await?;
    ApiClient::json(&path, &b)
}

/// A content-API client for one volume.
struct Content {
    client: ApiClient,
    id: String,
}

impl Content {
    fn path(&self, route: &str, path: &str, extra: &str) -> String {
        format!(
            "/volumecontent/{}/{route}?path={}{extra}",
            seg(&self.id),
            enc(path, QUERY_VALUE)
        )
    }
}

async fn content(api: &ApiClient, base: &BaseUrl, volume: &str) -> Result<Content, ClientError> {
    let v = info(api, volume).await?;
    let token = v["token"]
        .as_str()
        .ok_or_else(|| ClientError::Protocol("the volume has no token".into()))?;
    Ok(Content {
        client: ApiClient::with_bearer(base.clone(), token.to_string()),
        id: v["volumeID"].as_str().unwrap_or_default().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512));
        assert_eq!(parse_size("10G"), Ok(10240));
        assert_eq!(parse_size("1t"), Ok(1 << 20));
        assert_eq!(parse_size("64"), Ok(64));
        assert!(parse_size("10K").is_err());
        assert!(parse_size("x").is_err());
    }

    #[test]
    fn mounts() {
        use super::super::args::parse_volume_mount;
        assert_eq!(
            parse_volume_mount("data:/mnt/data").unwrap(),
            serde_json::json!({"name": "data", "path": "/mnt/data"})
        );
        assert_eq!(
            parse_volume_mount("data:/mnt/data:ro").unwrap(),
            serde_json::json!({"name": "data", "path": "/mnt/data", "readOnly": true})
        );
        assert!(parse_volume_mount("data").is_err());
        assert!(parse_volume_mount("data:rel").is_err());
    }
}
