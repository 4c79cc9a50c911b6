//! Issue 10, item 2: PID 1's stdout/stderr was the host file `init.log`, and
//! `pidfd_getfd` on envd gave the sandbox's root a writable descriptor of it: append,
//! truncate, forge what the host reads. Takes envd's stderr (`pidfd_getfd(PID 1, 2)`),
//! checks what it is, tries to truncate, seek, chmod and chown it, then floods it.
//!
//! Contained by: PID 1's output is a FIFO (`cubicle_runtime::open_init_log`): the
//! descriptor is a pipe (no truncate, no seek, and the FIFO's inode belongs to the
//! host's root: EPERM), and the node drains it at most `init_log::RATE` bytes per
//! second after a burst of `init_log::BURST`, into a log file of at most
//! `init_log::MAX_FILE` bytes that the sandbox never gets a descriptor of (the non-
//! blocking write end refuses the flood with EAGAIN). Shown to fail against the
//! previous runtime (init.log as stderr): `stderr_is_fifo=0`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;

use cubicle_node::init_log::{BURST, INIT_LOG, MAX_FILE, RATE};

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "init_log_pipe",
    about: "take PID 1's stdout/stderr (pidfd_getfd) to write a host file; a throttled FIFO the node drains",
    run: |c| Box::pin(run(c)),
};

const FLOOD_SECS: u64 = 4;

const PROGRAM: &str = r#"
#include <time.h>
int main(int argc, char **argv) {
    int secs = atoi(argv[1]);
    int pidfd = syscall(SYS_pidfd_open, 1, 0);
    report("pidfd_open", pidfd, errno);
    int fd = syscall(SYS_pidfd_getfd, pidfd, 2, 0);
    report("pidfd_getfd", fd, errno);
    if (fd < 0) return 2;
    struct stat st;
    fstat(fd, &st);
    printf("stderr_is_fifo=%d\nstderr_is_file=%d\n", S_ISFIFO(st.st_mode), S_ISREG(st.st_mode));
    TRY("ftruncate", ftruncate(fd, 0));
    TRY("lseek", lseek(fd, 0, SEEK_SET));
    TRY("fchmod", fchmod(fd, 0666));
    TRY("fchown", fchown(fd, 0, 0));
    TRY("forge", write(fd, "FORGED by the sandbox\n", 22));
    /* Flood for `secs` seconds: count what the pipe accepts. */
    static char chunk[65536];
    memset(chunk, 'F', sizeof chunk);
    chunk[sizeof chunk - 1] = '\n';
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    long accepted = 0, refused = 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        long n = write(fd, chunk, sizeof chunk);
        if (n > 0) accepted += n;
        else if (errno == EAGAIN) { refused++; usleep(500); }
        else break;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (t.tv_sec - t0.tv_sec < secs);
    printf("flood_accepted=%ld\nflood_refused=%ld\n", accepted, refused);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb
        .c(
            As::Root,
            "init_log_pipe",
            PROGRAM,
            &[&FLOOD_SECS.to_string()],
        )
        .await?;
    out.expect_ok("pidfd_getfd")?;
    anyhow::ensure!(
        out.field("stderr_is_fifo") == Some("1") && out.field("stderr_is_file") == Some("0"),
        "PID 1's stderr is not a pipe: {}",
        out.all()
    );
    out.expect_errno("ftruncate", &[EINVAL])?;
    out.expect_errno("lseek", &[libc::ESPIPE])?;
    out.expect_errno("fchmod", &[EPERM])?;
    out.expect_errno("fchown", &[EPERM])?;
    let accepted: u64 = out
        .field("flood_accepted")
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    // Burst + rate over the flood (+1 s of slack), plus the pipe buffer and a read.
    let allowed = BURST + RATE * (FLOOD_SECS + 1) + (256 << 10);
    anyhow::ensure!(
        accepted <= allowed,
        "the node took {accepted} bytes in {FLOOD_SECS} s, more than {allowed}: {}",
        out.all()
    );
    let log = sb.dir().join(INIT_LOG);
    let meta = std::fs::metadata(&log)?;
    anyhow::ensure!(
        meta.len() <= MAX_FILE + 256 && meta.uid() == 0 && meta.permissions().mode() & 0o077 == 0,
        "{}: {} bytes, uid {}, mode {:o}",
        log.display(),
        meta.len(),
        meta.uid(),
        meta.permissions().mode()
    );
    println!(
        "  flood: {} MiB accepted in {FLOOD_SECS} s (allowed {} MiB), init.log {} KiB",
        accepted >> 20,
        allowed >> 20,
        meta.len() >> 10
    );
    // envd still answers (its own logging does not block on the full pipe).
    let o = sb.sh(As::Root, "echo alive").await?;
    anyhow::ensure!(o.out.trim() == "alive", "envd after the flood: {}", o.all());
    sb.kill().await
}
