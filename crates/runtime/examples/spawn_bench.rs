//! Spawn benchmark: cold create → init running, over N sandboxes of a busybox rootfs.
//!
//! `cargo run --release -p cubicle-runtime --example spawn_bench -- [ITERATIONS] [ROOTFS]`
//! (as root). Without ROOTFS, builds a busybox-static template in a temporary directory;
//! with it (e.g. `/var/lib/cubicle/templates/base/rootfs`), uses that template with
//! `/bin/sleep` as init. Runs `cubicle_runtime::bench::spawn_latency` and prints
//! percentiles per setup step. With `CUBICLE_BENCH_VOLUME=1`, also
//! `cubicle_runtime::bench::volume_mount_cost` (spawns with and without a volume, and
//! attaching one to a running sandbox). With `CUBICLE_BENCH_SHELL=1`, also
//! `cubicle_runtime::bench::shell_attach_cost` (a template's sandbox spawned, against a
//! shell made ahead and given the template's root).

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::process::Command;

use cubicle_runtime::SandboxSpec;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    cubicle_runtime::maybe_run_helper();
    let iterations: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(200);
    let root = Path::new("/tmp").join(format!("cubicle-bench-{}", std::process::id()));
    fs::create_dir_all(&root)?;
    fs::set_permissions(&root, fs::Permissions::from_mode(0o755))?;
    let template: std::path::PathBuf = root.join("template");
    for d in ["bin", "etc", "root", "tmp", "proc", "sys", "dev", "run"] {
        fs::create_dir_all(template.join(d))?;
    }
    fs::copy("/bin/busybox", template.join("bin/busybox"))?;
    let list = Command::new("/bin/busybox").arg("--list").output()?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            symlink("busybox", template.join("bin").join(applet))?;
        }
    }
    fs::write(
        template.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
    )?;

    let (rootfs, init) = match std::env::args().nth(2) {
        Some(r) => (r.into(), vec!["/bin/sleep".to_string(), "600".to_string()]),
        None => (
            template.clone(),
            vec!["/bin/busybox".into(), "sleep".into(), "600".into()],
        ),
    };
    let mut base = SandboxSpec::new(
        format!("bench{}x", std::process::id() % 100_000),
        rootfs,
        root.join("unused"),
        3_000_000_000,
        init,
    );
    base.limits.memory_bytes = 256 << 20;
    let sandboxes = root.join("sandboxes");
    fs::create_dir_all(&sandboxes)?;
    // Warm up the page cache and the binary once.
    let _ = cubicle_runtime::bench::spawn_latency(&base, 3, &sandboxes)?;
    base.id = format!("bench{}y", std::process::id() % 100_000);
    let report = cubicle_runtime::bench::spawn_latency(&base, iterations, &sandboxes);
    let idle = report
        .as_ref()
        .ok()
        .map(|_| cubicle_runtime::bench::idle_memory_per_sandbox(&base, 100, &sandboxes));
    // CUBICLE_BENCH_VOLUME=1: also what a mounted volume costs (a directory owned by
    // uid 1000, bound idmapped as volumes are).
    let volume = std::env::var_os("CUBICLE_BENCH_VOLUME").map(|_| {
        let v = root.join("volume");
        fs::create_dir_all(&v)
            .and_then(|()| std::os::unix::fs::chown(&v, Some(1000), Some(1000)))
            .map(|()| v)
    });
    let volume_report = match volume {
        Some(v) => {
            base.id = format!("bench{}v", std::process::id() % 100_000);
            Some(cubicle_runtime::bench::volume_mount_cost(
                &base, iterations, &sandboxes, &v?,
            ))
        }
        None => None,
    };
    // CUBICLE_BENCH_SHELL=1: also what a shell made ahead saves a cold create (its init
    // is busybox, bound under /run: a shell's root has nothing else).
    let shell_report = std::env::var_os("CUBICLE_BENCH_SHELL").map(|_| {
        base.id = format!("bench{}s", std::process::id() % 100_000);
        let bb = cubicle_runtime::BindMount {
            source: template.join("bin/busybox"),
            target: "/run/bench/busybox".into(),
            readonly: true,
            idmapped: false,
        };
        let init = ["/run/bench/busybox", "sleep", "600"].map(String::from);
        cubicle_runtime::bench::shell_attach_cost(&base, &init, &[bb], iterations, &sandboxes)
    });
    let _ = fs::remove_dir_all(&root);
    print!("{}", report?);
    if let Some(r) = shell_report {
        print!("shells ({iterations} of each kind, interleaved)\n{}", r?);
    }
    if let Some(r) = volume_report {
        print!("volumes ({iterations} of each, interleaved)\n{}", r?);
    }
    if let Some(idle) = idle {
        println!(
            "idle host memory per sandbox (100 running): {} KiB",
            idle? / 1024
        );
    }
    Ok(())
}
