//! `/sys` writes that change the host or the sandbox's own limits:
//! `kernel/uevent_helper` (run as host root on the next uevent), a network device's
//! MTU, `power/state`, transparent hugepages, the sandbox's own memory limit, CPU
//! hotplug.
//!
//! Contained by: `/sys` mounted read-only, and the sandbox's cgroups mounted read-only
//! (EROFS; missing files count as contained too). `uevent_helper` is part of the host
//! snapshot.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "sys_writes",
    about: "write /sys (uevent_helper, devices, own cgroup limits); read-only sysfs and cgroupfs",
    run: |c| Box::pin(run(c)),
};

/// What a write would change: (name, path, data).
const WRITES: &[(&str, &str, &str)] = &[
    (
        "uevent_helper",
        "/sys/kernel/uevent_helper",
        "/tmp/cubicle-escape-agent\n",
    ),
    ("lo_mtu", "/sys/class/net/lo/mtu", "1280\n"),
    ("power_state", "/sys/power/state", "freeze\n"),
    (
        "thp",
        "/sys/kernel/mm/transparent_hugepage/enabled",
        "always\n",
    ),
    (
        "own_memory_limit",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "-1\n",
    ),
    ("own_memory_max", "/sys/fs/cgroup/memory.max", "max\n"),
    ("own_pids_max", "/sys/fs/cgroup/pids/pids.max", "max\n"),
    ("cpu_online", "/sys/devices/system/cpu/cpu1/online", "0\n"),
];

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let mkdir = "    TRY(\"mkdir_sys\", mkdir(\"/sys/escape\", 0755));\n";
    let program = write_attempts("", WRITES, mkdir);
    let out = expect_writes_refused(
        &sb,
        "sys_writes",
        &program,
        WRITES,
        &[EROFS, ENOENT, EACCES],
    )
    .await?;
    out.expect_errno("mkdir_sys", &[EROFS, ENOENT, EACCES])?;
    sb.kill().await
}
