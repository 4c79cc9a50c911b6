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

/// The host-wide knobs a write would change: (name, path, data).
const WRITES: &[(&str, &str, &str)] = &[
    (
        "core_pattern",
        "/proc/sys/kernel/core_pattern",
        "|/tmp/cubicle-escape-agent\n",
    ),
    (
        "modprobe",
        "/proc/sys/kernel/modprobe",
        "/tmp/cubicle-escape-agent\n",
    ),
    ("drop_caches", "/proc/sys/vm/drop_caches", "3\n"),
    ("panic", "/proc/sys/kernel/panic", "1\n"),
    ("hostname", "/proc/sys/kernel/hostname", "escaped\n"),
    ("ip_forward", "/proc/sys/net/ipv4/ip_forward", "1\n"),
    (
        "ping_group_range",
        "/proc/sys/net/ipv4/ping_group_range",
        "0 0\n",
    ),
];

/// After the writes: where `/proc/sysrq-trigger` points.
const SYSRQ: &str = r#"    struct stat st;
    TRY("stat_sysrq", stat("/proc/sysrq-trigger", &st));
    if (stat("/proc/sysrq-trigger", &st) == 0)
        printf("sysrq_dev=%u:%u\nsysrq_chr=%d\n", major(st.st_rdev), minor(st.st_rdev), S_ISCHR(st.st_mode));
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let program = write_attempts("#include <sys/sysmacros.h>", WRITES, SYSRQ);
    // EACCES: the host's root owns them, unmapped in the sandbox; ENOENT: a kernel
    // without the knob (e.g. `modprobe` without module support).
    let out = expect_writes_refused(
        &sb,
        "proc_sys_writes",
        &program,
        WRITES,
        &[EROFS, EACCES, EPERM, ENOENT],
    )
    .await?;
    // A kernel without magic SysRq has no /proc/sysrq-trigger at all.
    let no_sysrq = out.expect_errno("stat_sysrq", &[ENOENT]).is_ok();
    anyhow::ensure!(
        no_sysrq || (out.field("sysrq_dev") == Some("1:3") && out.field("sysrq_chr") == Some("1")),
        "/proc/sysrq-trigger is not masked by /dev/null: {}",
        out.all()
    );
    sb.kill().await
}
