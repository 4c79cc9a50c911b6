//! `peer`: the same cycle done with `runc run` on the template's rootfs and with
//! `bwrap --unshare-all`, for comparison with Cubicle's c=1 cycle of the same run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::report::Row;

/// The root filesystem of `template` in the state directory `state`: its one layer
/// (`layers/<id>`, or `templates/<name>/rootfs` in the older layout). A template of
/// several layers has no single directory to hand to runc: pass `--rootfs`.
pub(super) fn template_rootfs(state: &Path, template: &str) -> anyhow::Result<PathBuf> {
    let store = cubicle_node::template::TemplateStore::open(state)
        .with_context(|| format!("templates in {}", state.display()))?;
    let Some(t) = store.get(template)? else {
        bail!(
            "peer: template '{template}' is not built in {}",
            state.display()
        );
    };
    if !t.layers.is_empty() {
        bail!(
            "peer: template '{template}' has {} layers; pass --rootfs with a directory \
             holding its root filesystem",
            t.layers.len() + 1
        );
    }
    Ok(t.rootfs)
}

/// `runc run` and `bwrap` cycles of `true` on `rootfs`.
pub(super) async fn measure_peer(rootfs: &Path, n: usize) -> anyhow::Result<Vec<Row>> {
    let rootfs = rootfs
        .canonicalize()
        .with_context(|| format!("rootfs {}", rootfs.display()))?;
    let bundle = std::env::temp_dir().join(format!("cb-bench-runc-{}", std::process::id()));
    std::fs::create_dir_all(&bundle)?;
    let spec = match runc_spec(&bundle, &rootfs) {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&bundle);
            return Err(e);
        }
    };
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec_pretty(&spec)?,
    )?;
    let mut rows = Vec::new();

    let pid = std::process::id();
    let mut i = 0usize;
    let runc = time_peer("runc run", "runc", n, || {
        let id = format!("cb-bench-{pid}-{i}");
        i += 1;
        let mut cmd = tokio::process::Command::new("runc");
        cmd.args(["run", "--bundle"]).arg(&bundle).arg(&id);
        let cleanup = move || {
            let _ = std::process::Command::new("runc")
                .args(["delete", "--force", &id])
                .output();
        };
        (cmd, Some(Box::new(cleanup) as Box<dyn FnOnce()>))
    })
    .await;
    let _ = std::fs::remove_dir_all(&bundle);
    rows.push(runc);

    let bwrap = time_peer("bwrap --unshare-all", "bwrap", n, || {
        let mut cmd = tokio::process::Command::new("bwrap");
        cmd.arg("--unshare-all")
            .arg("--ro-bind")
            .arg(&rootfs)
            .args(["/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
            .args(["/bin/sh", "-c", "true"]);
        (cmd, None)
    })
    .await;
    rows.push(bwrap);
    Ok(rows)
}

/// Times `n` runs of a peer runtime's command. `next` gives each run's command and what
/// to do after it fails (if anything); the first failure's stderr is printed; a command
/// that cannot be started ends the series.
async fn time_peer(
    runtime: &str,
    program: &str,
    n: usize,
    mut next: impl FnMut() -> (tokio::process::Command, Option<Box<dyn FnOnce()>>),
) -> Row {
    let mut row = Row::new("peer", 1).with("runtime", runtime);
    for _ in 0..n {
        let (mut cmd, on_failure) = next();
        let t0 = Instant::now();
        let st = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .await;
        match st {
            Ok(o) if o.status.success() => row.samples.push(t0.elapsed()),
            Ok(o) => {
                if row.errors == 0 {
                    eprintln!(
                        "cubicle bench: {program}: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    );
                }
                row.errors += 1;
                if let Some(f) = on_failure {
                    f();
                }
            }
            Err(e) => {
                row.errors += 1;
                eprintln!("cubicle bench: {program}: {e}");
                break;
            }
        }
    }
    row
}

/// runc's own default OCI spec (`runc spec`: the mounts, masked paths, capabilities and
/// namespaces runc gives any container) with only what the measure needs changed:
/// `/bin/sh -c true`, no terminal, the template's rootfs read-only as root.
fn runc_spec(bundle: &Path, rootfs: &Path) -> anyhow::Result<Value> {
    let out = std::process::Command::new("runc")
        .arg("spec")
        .arg("--bundle")
        .arg(bundle)
        .output()
        .context("running `runc spec`")?;
    if !out.status.success() {
        bail!("runc spec: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let path = bundle.join("config.json");
    let mut spec: Value = serde_json::from_slice(&std::fs::read(&path)?)
        .with_context(|| format!("parsing {}", path.display()))?;
    spec["process"]["terminal"] = json!(false);
    spec["process"]["args"] = json!(["/bin/sh", "-c", "true"]);
    spec["root"] = json!({"path": rootfs, "readonly": true});
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runc_spec_is_runc_default_read_only_on_the_rootfs() {
        let bundle = std::env::temp_dir().join(format!("cb-runc-spec-test-{}", std::process::id()));
        std::fs::create_dir_all(&bundle).unwrap();
        let v = runc_spec(&bundle, Path::new("/r"));
        std::fs::remove_dir_all(&bundle).unwrap();
        let v = v.expect("runc spec (runc is installed by scripts/install-deps.sh)");
        // runc's defaults stay: its masked paths and its mounts.
        assert!(
            v["linux"]["maskedPaths"]
                .as_array()
                .is_some_and(|a| a.len() > 3)
        );
        assert!(
            v["mounts"]
                .as_array()
                .is_some_and(|a| a.iter().any(|m| m["destination"] == "/dev/pts"))
        );
        assert_eq!(v["process"]["terminal"], false);
        assert_eq!(v["root"]["path"], "/r");
        assert_eq!(v["root"]["readonly"], true);
        assert_eq!(v["process"]["args"][2], "true");
    }

    /// A built template's directory: `template.json` naming `layers`.
    fn write_template(state: &Path, name: &str, layers: &[&str]) {
        let dir = state.join("templates").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = json!({
            "name": name, "defaultUser": "user", "env": {}, "startCommand": null,
            "cpus": 1, "memoryMb": 128, "diskMb": 512, "builtAt": 1, "sizeBytes": 1,
            "builder": "test", "layers": layers,
        });
        std::fs::write(dir.join("template.json"), cfg.to_string()).unwrap();
    }

    #[test]
    fn the_peer_runs_on_a_templates_one_layer() {
        let state =
            std::env::temp_dir().join(format!("cb-peer-rootfs-test-{}", std::process::id()));
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        write_template(&state, "one", &[&a]);
        write_template(&state, "two", &[&a, &b]);
        let one = template_rootfs(&state, "one");
        let two = template_rootfs(&state, "two");
        let none = template_rootfs(&state, "none");
        std::fs::remove_dir_all(&state).unwrap();
        assert_eq!(one.unwrap(), state.join("layers").join(&a));
        let two = two.unwrap_err().to_string();
        assert!(
            two.contains("2 layers") && two.contains("--rootfs"),
            "{two}"
        );
        let none = none.unwrap_err().to_string();
        assert!(none.contains("not built"), "{none}");
    }
}
