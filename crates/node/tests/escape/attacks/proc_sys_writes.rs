//! `/proc` writes that change the host: `kernel/core_pattern` (a pipe there runs as
//! host root on the next crash), `kernel/modprobe`, `vm/drop_caches`, `kernel/panic`,
//! network sysctls, and `/proc/sysrq-trigger` (reboot/crash the host).
//!
//! Contained by: `/proc/sys` bind-mounted read-only (`masked_paths.rs`) and owned by
//! the host's root (EACCES before EROFS: that uid is not mapped in the sandbox), and
//! `/proc/sysrq-trigger` masked by `/dev/null` (the write lands in /dev/null, checked
//! here by its device number). The sysctls are part of the host snapshot.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "proc_sys_writes",
    about: "write host-wide sysctls (core_pattern, modprobe, …) and sysrq; read-only /proc/sys, masked sysrq",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <sys/sysmacros.h>
static void try_write(const char *name, const char *path, const char *data) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) { report(name, -1, errno); return; }
    long n = write(fd, data, strlen(data));
    report(name, n, errno);
}
int main(void) {
    try_write("core_pattern", "/proc/sys/kernel/core_pattern", "|/tmp/cubicle-escape-agent\n");
    try_write("modprobe", "/proc/sys/kernel/modprobe", "/tmp/cubicle-escape-agent\n");
    try_write("drop_caches", "/proc/sys/vm/drop_caches", "3\n");
    try_write("panic", "/proc/sys/kernel/panic", "1\n");
    try_write("hostname", "/proc/sys/kernel/hostname", "escaped\n");
    try_write("ip_forward", "/proc/sys/net/ipv4/ip_forward", "1\n");
    try_write("ping_group_range", "/proc/sys/net/ipv4/ping_group_range", "0 0\n");
    struct stat st;
    TRY("stat_sysrq", stat("/proc/sysrq-trigger", &st));
    if (stat("/proc/sysrq-trigger", &st) == 0)
        printf("sysrq_dev=%u:%u\nsysrq_chr=%d\n", major(st.st_rdev), minor(st.st_rdev), S_ISCHR(st.st_mode));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "proc_sys_writes", PROGRAM, &[]).await?;
    for name in [
        "core_pattern",
        "modprobe",
        "drop_caches",
        "panic",
        "hostname",
        "ip_forward",
        "ping_group_range",
    ] {
        // EACCES: the host's root owns them, unmapped in the sandbox; ENOENT: a kernel
        // without the knob (e.g. `modprobe` without module support).
        out.expect_errno(name, &[EROFS, EACCES, EPERM, ENOENT])?;
    }
    // A kernel without magic SysRq has no /proc/sysrq-trigger at all.
    let no_sysrq = out.expect_errno("stat_sysrq", &[ENOENT]).is_ok();
    anyhow::ensure!(
        no_sysrq || (out.field("sysrq_dev") == Some("1:3") && out.field("sysrq_chr") == Some("1")),
        "/proc/sysrq-trigger is not masked by /dev/null: {}",
        out.all()
    );
    sb.kill().await
}
