//! `cubicle template build|import|list|tags|rm|gc`.
//!
//! Built-ins (`tiny`, `base`, `code-interpreter-v1`) are built here, in the state
//! directory. `build NAME -f Dockerfile [CONTEXT]` is a client of a running `cubicle
//! serve` (like the SDKs' `Template.build()`): the Dockerfile becomes E2B build steps,
//! each COPY's files are uploaded as a gzipped tar (only when the server does not have
//! them yet), and the build's log streams back (a progress bar on a terminal); builds run
//! in the server's sandboxes. `import` reads an OCI layout or `docker save` archive into
//! the state directory's layer store directly; `list`, `tags`, `rm` and `gc` work on the
//! state directory too.

use std::collections::{BTreeMap, HashSet};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Subcommand;
use cubicle_node::template::build::dockerfile;
use cubicle_node::template::{TemplateConfig, TemplateStore, human_size};

use crate::client::{self, ApiClient, SandboxArgs};

/// Template subcommands.
#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Build a template: a built-in (`tiny`, `base`, `code-interpreter-v1`) here, or with
    /// `-f Dockerfile` through a running `cubicle serve` (builds run in its sandboxes).
    Build {
        /// Template name (`name` or `name:tag`).
        name: String,
        /// Rebuild a built-in even if it is built (replaced atomically); with a
        /// Dockerfile: ignore the build cache.
        #[arg(long)]
        force: bool,
        /// Dockerfile to build from.
        #[arg(long = "file", short = 'f', value_name = "DOCKERFILE")]
        file: Option<PathBuf>,
        /// Directory COPY/ADD sources are relative to (default: the Dockerfile's).
        context: Option<PathBuf>,
        /// More tags for this build (repeatable).
        #[arg(long = "tag", short = 't')]
        tags: Vec<String>,
        /// `ARG` value, `KEY=VALUE` (repeatable).
        #[arg(long = "build-arg", value_name = "KEY=VALUE")]
        build_args: Vec<String>,
        /// Ready command (checked after the start command, in the build and at every
        /// sandbox start), e.g. `curl -sf localhost:8000`.
        #[arg(long)]
        ready_cmd: Option<String>,
        /// vCPUs of the template's sandboxes.
        #[arg(long)]
        cpu: Option<u32>,
        /// Memory (MiB) of the template's sandboxes.
        #[arg(long)]
        memory_mb: Option<u64>,
        /// Server connection (E2B_API_URL, E2B_API_KEY; default: the local server).
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Import an image from an OCI layout directory or a `docker save` archive (or an OCI
    /// layout packed as a tar) as template NAME.
    Import {
        /// Template name.
        name: String,
        /// The layout directory or archive.
        path: PathBuf,
        /// Which image, when the layout or archive holds several (its ref name or REPO:TAG).
        #[arg(long = "ref")]
        reference: Option<String>,
        /// Start command of its sandboxes (default: none; the image's CMD is not used).
        #[arg(long)]
        start_cmd: Option<String>,
    },
    /// List templates: name, size (its layers; shared ones counted once per template),
    /// the part no other template shares, layers, build time, source.
    List,
    /// Tags of a template and the builds they name.
    Tags {
        /// Template name.
        name: String,
    },
    /// Remove a template (refused while a sandbox uses it). Its layers stay until `gc`.
    Rm {
        /// Template name.
        name: String,
    },
    /// Remove layers no template, running sandbox or recent build needs.
    Gc,
    /// Publish a template to the object store (its config and every layer the store
    /// lacks), so that every node can use it (docs/cluster.md, "Moving state").
    Push {
        /// Template name.
        name: String,
        /// The object store.
        #[command(flatten)]
        store: ObjectStoreArg,
    },
    /// Fetch a template from the object store into this state directory (the layers it
    /// lacks, each checked against its digest) and install it.
    Pull {
        /// Template name.
        name: String,
        /// The object store.
        #[command(flatten)]
        store: ObjectStoreArg,
    },
}

/// Which object store (`push`, `pull`).
#[derive(clap::Args, Debug)]
pub struct ObjectStoreArg {
    /// `s3://bucket/prefix` (endpoint, region and credentials from the AWS_* environment
    /// variables) or `file:///dir`.
    #[arg(
        long = "object-store",
        env = "CUBICLE_OBJECT_STORE",
        value_name = "URL"
    )]
    pub url: String,
}

/// Where the server is (for `build -f`).
#[derive(clap::Args, Debug)]
pub struct ServerArgs {
    /// REST API of `cubicle serve`.
    #[arg(long, env = "E2B_API_URL", value_name = "URL")]
    pub api_url: Option<String>,
    /// API key (default: `<state-dir>/admin-api-key`).
    #[arg(long, env = "E2B_API_KEY", hide_env_values = true, value_name = "KEY")]
    pub api_key: Option<String>,
}

pub async fn run(state_dir: &Path, cmd: TemplateCommand) -> anyhow::Result<i32> {
    // `build -f` is a client of the server: it reads at most the admin key from the state
    // directory and must not create a store there (the default one is the operator's).
    let cmd = match cmd {
        TemplateCommand::Build {
            name,
            force,
            file: Some(file),
            context,
            tags,
            build_args,
            ready_cmd,
            cpu,
            memory_mb,
            server,
        } => {
            let args = SandboxArgs {
                api_url: server.api_url,
                api_key: server.api_key,
                sandbox_url: None,
                // Only the settings (server and key) are used.
                command: client::SandboxCommand::Info {
                    id: String::new(),
                    json: false,
                },
            };
            let settings = args.settings(state_dir)?;
            let api = ApiClient::new(settings.api.clone(), settings.api_key.clone());
            let opts = BuildOpts {
                name,
                force,
                file,
                context,
                tags,
                build_args,
                ready_cmd,
                cpu,
                memory_mb,
            };
            return build_dockerfile(&api, opts).await;
        }
        other => other,
    };
    let store = TemplateStore::open(state_dir)
        .with_context(|| format!("opening {}", state_dir.display()))?;
    match cmd {
        TemplateCommand::Push { name, store: os } => {
            let mover = mover(&os, state_dir)?;
            let r = mover.push_template(&store, &name).await?;
            println!(
                "{name} pushed to {}: {} layer(s) uploaded ({}) in {:.1}s",
                os.url,
                r.blobs_moved,
                human_size(r.bytes_moved),
                r.took.as_secs_f64()
            );
            return Ok(0);
        }
        TemplateCommand::Pull { name, store: os } => {
            let mover = mover(&os, state_dir)?;
            let Some(r) = mover.pull_template(&store, &name).await? else {
                bail!("no template '{name}' in {}", os.url);
            };
            println!(
                "{name} pulled from {}: {} layer(s) downloaded ({}) in {:.1}s",
                os.url,
                r.blobs_moved,
                human_size(r.bytes_moved),
                r.took.as_secs_f64()
            );
            return Ok(0);
        }
        // (`file: None` here: `-f` returned above.)
        TemplateCommand::Build { name, force, .. } => {
            let t = tokio::task::spawn_blocking(move || store.build(&name, force, true)).await??;
            println!(
                "{} {} {}",
                t.config.name,
                human_size(t.config.size_bytes),
                t.dir.display()
            );
        }
        TemplateCommand::Import {
            name,
            path,
            reference,
            start_cmd,
        } => {
            let t = tokio::task::spawn_blocking(move || {
                import(&store, &name, &path, reference.as_deref(), start_cmd)
            })
            .await??;
            println!(
                "{} {} ({} layers)",
                t.name,
                human_size(t.size_bytes),
                t.layers.len()
            );
        }
        TemplateCommand::List => {
            let usage: BTreeMap<String, _> = store
                .disk_usage()
                .into_iter()
                .map(|u| (u.name.clone(), u))
                .collect();
            println!(
                "{:<24} {:>10} {:>10} {:>6}  {:<19}  SOURCE",
                "NAME", "SIZE", "UNIQUE", "LAYERS", "BUILT (UTC)"
            );
            for t in store.list()? {
                let (size, unique, layers) = match usage.get(&t.config.name) {
                    Some(u) if u.layers > 0 => (u.total_bytes, u.unique_bytes, u.layers),
                    _ => (t.config.size_bytes, t.config.size_bytes, 1),
                };
                println!(
                    "{:<24} {:>10} {:>10} {:>6}  {:<19}  {}",
                    t.config.name,
                    human_size(size),
                    human_size(unique),
                    layers,
                    format_utc(t.config.built_at),
                    t.config.source.as_deref().unwrap_or("built-in")
                );
            }
            let total: u64 = store.layers().list().iter().map(|l| l.size_bytes).sum();
            println!(
                "layer store: {} in {} layers",
                human_size(total),
                store.layers().list().len()
            );
        }
        TemplateCommand::Tags { name } => {
            let tags = store.tags(&name)?;
            if tags.is_empty() {
                bail!("template '{name}' not found");
            }
            println!("{:<20} {:<38} ASSIGNED (UTC)", "TAG", "BUILD");
            for t in tags {
                println!(
                    "{:<20} {:<38} {}",
                    t.tag,
                    t.build_id,
                    format_utc(t.assigned_at_ms / 1000)
                );
            }
        }
        TemplateCommand::Rm { name } => {
            let users = cubicle_node::sandboxes_using_template(state_dir, &name);
            if !users.is_empty() {
                bail!(
                    "template '{name}' is used by {}; kill those sandboxes (cubicle sandbox kill ID) and delete those snapshots (cubicle sandbox delete-snapshot ID) first",
                    users.join(", ")
                );
            }
            store.remove(&name)?;
            println!("removed template {name} (its layers are freed by `cubicle template gc`)");
        }
        TemplateCommand::Gc => {
            let in_use: HashSet<String> = cubicle_node::layers_in_use_on_disk(state_dir);
            let r = store.gc(&in_use, Duration::from_secs(600))?;
            println!(
                "removed {} layers ({}), kept {}",
                r.removed.len(),
                human_size(r.freed_bytes),
                r.kept
            );
        }
    }
    Ok(0)
}

/// Import `path` as template `name` (its layers, the E2B additions, E2B's settings).
fn import(
    store: &TemplateStore,
    name: &str,
    path: &Path,
    reference: Option<&str>,
    start_cmd: Option<String>,
) -> anyhow::Result<TemplateConfig> {
    cubicle_node::template::validate_name(name)?;
    let img = cubicle_node::template::oci::import::import(store, path, reference)?;
    Ok(cubicle_node::template::build::image_template(
        store, name, &img, start_cmd,
    )?)
}

struct BuildOpts {
    name: String,
    force: bool,
    file: PathBuf,
    context: Option<PathBuf>,
    tags: Vec<String>,
    build_args: Vec<String>,
    ready_cmd: Option<String>,
    cpu: Option<u32>,
    memory_mb: Option<u64>,
}

/// Build from a Dockerfile through the server, streaming its log.
async fn build_dockerfile(api: &ApiClient, o: BuildOpts) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(&o.file)
        .with_context(|| format!("reading {}", o.file.display()))?;
    let mut args = BTreeMap::new();
    for kv in &o.build_args {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--build-arg {kv}: expected KEY=VALUE"))?;
        args.insert(k.to_string(), v.to_string());
    }
    let df = dockerfile::parse(&text, &args).map_err(anyhow::Error::msg)?;
    for w in &df.warnings {
        eprintln!("warning: {w}");
    }
    let context = match &o.context {
        Some(c) => c.clone(),
        None => o
            .file
            .parent()
            .map(Path::to_path_buf)
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    let (id, build) = api
        .request_build(&o.name, &o.tags, o.cpu, o.memory_mb)
        .await?;
    eprintln!("template {id}, build {build}");
    let mut steps = Vec::new();
    for s in &df.steps {
        let mut v = serde_json::json!({ "type": s.kind, "args": s.args, "force": false });
        if s.kind == "COPY" {
            let (src, dest) = (&s.args[0], &s.args[1]);
            let ctx = crate::context::Context::new(&context)?;
            let (hash, archive) = ctx.archive(src, dest)?;
            let (present, url) = api.file_link(&id, &hash).await?;
            match (present, url) {
                (true, _) => eprintln!("COPY {src}: already uploaded"),
                (false, Some(url)) => {
                    let n = archive.len();
                    client::templates::upload(&url, archive).await?;
                    eprintln!("COPY {src}: uploaded {}", human_size(n as u64));
                }
                (false, None) => bail!("the server gave no upload URL for {src}"),
            }
            v["filesHash"] = serde_json::json!(hash);
        }
        steps.push(v);
    }
    let mut body = serde_json::json!({ "fromImage": df.from, "force": o.force, "steps": steps });
    if let Some(c) = &df.start_cmd {
        body["startCmd"] = serde_json::json!(c);
    }
    if let Some(r) = &o.ready_cmd {
        body["readyCmd"] = serde_json::json!(r);
    }
    api.start_build(&id, &build, &body).await?;
    follow(api, &id, &build, df.steps.len()).await
}

/// Poll the build's status until it ends; a progress bar on a terminal, log lines
/// otherwise. Ctrl-C cancels the build.
async fn follow(api: &ApiClient, id: &str, build: &str, steps: usize) -> anyhow::Result<i32> {
    let tty = std::io::stderr().is_terminal();
    let bar = tty.then(|| {
        let b = indicatif::ProgressBar::new(steps as u64 + 1);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} {wide_msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.enable_steady_tick(Duration::from_millis(120));
        b
    });
    let mut offset = 0;
    let mut done_polls = 0;
    loop {
        let st = tokio::select! {
            r = api.build_status(id, build, offset) => r?,
            _ = tokio::signal::ctrl_c() => {
                let _ = api.cancel_build(id, build).await;
                if let Some(b) = &bar { b.abandon(); }
                eprintln!("build cancelled");
                return Ok(130);
            }
        };
        let entries = st["logEntries"].as_array().cloned().unwrap_or_default();
        offset += entries.len();
        for e in &entries {
            let msg = e["message"].as_str().unwrap_or("");
            let step = e["step"].as_str().unwrap_or("");
            match &bar {
                Some(b) => {
                    if let Ok(n) = step.parse::<u64>() {
                        b.set_position(n);
                    } else if step == "finalize" {
                        b.set_position(steps as u64 + 1);
                    }
                    let line: String = msg.chars().take(120).collect();
                    b.set_message(line);
                    if e["level"] == "error" {
                        b.println(msg);
                    }
                }
                None => eprintln!("[{step}] {msg}"),
            }
        }
        match st["status"].as_str() {
            Some("ready") | Some("error") if entries.is_empty() => {
                done_polls += 1;
                if done_polls >= 1 {
                    if let Some(b) = &bar {
                        b.finish_and_clear();
                    }
                    if st["status"] == "ready" {
                        println!("{id}");
                        return Ok(0);
                    }
                    let step = st["reason"]["step"].as_str().unwrap_or("?");
                    let why = st["reason"]["message"].as_str().unwrap_or("build failed");
                    eprintln!("build failed at step {step}: {why}");
                    return Ok(1);
                }
            }
            _ => {}
        }
        if entries.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
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

fn mover(os: &ObjectStoreArg, state_dir: &Path) -> anyhow::Result<cubicle_node::Mover> {
    let bucket = cubicle_node::objstore::Bucket::open(&os.url)?;
    Ok(cubicle_node::Mover::new(bucket, state_dir))
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
