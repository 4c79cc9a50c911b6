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

const PROGRAM: &str = r#"
static void try_write(const char *name, const char *path, const char *data) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) { report(name, -1, errno); return; }
    long n = write(fd, data, strlen(data));
    report(name, n, errno);
}
int main(void) {
    try_write("uevent_helper", "/sys/kernel/uevent_helper", "/tmp/cubicle-escape-agent\n");
    try_write("lo_mtu", "/sys/class/net/lo/mtu", "1280\n");
    try_write("power_state", "/sys/power/state", "freeze\n");
    try_write("thp", "/sys/kernel/mm/transparent_hugepage/enabled", "always\n");
    try_write("own_memory_limit", "/sys/fs/cgroup/memory/memory.limit_in_bytes", "-1\n");
    try_write("own_memory_max", "/sys/fs/cgroup/memory.max", "max\n");
    try_write("own_pids_max", "/sys/fs/cgroup/pids/pids.max", "max\n");
    try_write("cpu_online", "/sys/devices/system/cpu/cpu1/online", "0\n");
    TRY("mkdir_sys", mkdir("/sys/escape", 0755));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "sys_writes", PROGRAM, &[]).await?;
    for name in [
        "uevent_helper",
        "lo_mtu",
        "power_state",
        "thp",
        "own_memory_limit",
        "own_memory_max",
        "own_pids_max",
        "cpu_online",
        "mkdir_sys",
    ] {
        out.expect_errno(name, &[EROFS, ENOENT, EACCES])?;
    }
    sb.kill().await
}
