//! runc's CVE-2019-5736: overwrite, through `/proc/<pid>/exe`, the binary of a host
//! process that runs inside the sandbox, so the host runs the attacker's code next time.
//! Here the host binary inside every sandbox is envd (PID 1, bind-mounted from the
//! host): tries to open `/proc/1/exe`, `/proc/self/exe` of a re-exec'd envd copy and
//! `/run/cubicle/envd` for writing, and envd's memory mappings through
//! `/proc/1/map_files`. Nothing of the host ever executes inside a sandbox otherwise (the
//! node talks to envd over a socket, the router only `setns`es a thread into the network
//! namespace and never execs).
//!
//! Contained by: the read-only bind mount of the envd binary (EROFS/ETXTBSY), and
//! `map_files` needing CAP_SYS_ADMIN in the host's user namespace. The host's envd
//! binary is part of the host snapshot.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "runc_proc_self_exe",
    about: "overwrite the host's envd binary through /proc/1/exe or its bind mount; read-only bind",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <dirent.h>
int main(void) {
    TRY("open_proc1_exe_w", open("/proc/1/exe", O_WRONLY));
    TRY("open_proc1_exe_trunc", open("/proc/1/exe", O_RDWR | O_TRUNC));
    TRY("open_envd_bind_w", open("/run/cubicle/envd", O_WRONLY));
    TRY("chmod_envd_bind", chmod("/run/cubicle/envd", 0777));
    TRY("unlink_envd_bind", unlink("/run/cubicle/envd"));
    TRY("rename_over_envd_bind", rename("/tmp", "/run/cubicle/envd"));
    /* Every writable-looking mapping of envd. */
    DIR *d = opendir("/proc/1/map_files");
    struct dirent *e;
    int n = 0, opened = 0;
    char path[512];
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/1/map_files/%s", e->d_name);
        int fd = open(path, O_RDWR);
        n++;
        if (fd >= 0) { opened++; close(fd); }
    }
    printf("map_files_seen=%d\nmap_files_opened_rw=%d\n", n, opened);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "runc_proc_self_exe", PROGRAM, &[]).await?;
    for name in [
        "open_proc1_exe_w",
        "open_proc1_exe_trunc",
        "open_envd_bind_w",
        "chmod_envd_bind",
    ] {
        out.expect_errno(name, &[EROFS, libc::ETXTBSY, EACCES, EPERM])?;
    }
    out.expect_errno("unlink_envd_bind", &[EROFS, libc::EBUSY, EACCES, EPERM])?;
    out.expect_errno(
        "rename_over_envd_bind",
        &[
            EROFS,
            libc::EBUSY,
            libc::EXDEV,
            libc::ENOTDIR,
            EACCES,
            EPERM,
        ],
    )?;
    anyhow::ensure!(
        out.field("map_files_opened_rw") == Some("0"),
        "envd's mappings are writable: {}",
        out.all()
    );
    sb.kill().await
}
