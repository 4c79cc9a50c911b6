//! Device nodes: create `/dev/mem`, a disk (`8:0`), `/dev/kmsg` and `/dev/net/tun`
//! look-alikes with `mknod` as root and open them; open host devices the sandbox's
//! `/dev` does not have.
//!
//! Contained by: no CAP_MKNOD in the bounding set (and device nodes created in a user
//! namespace are never openable: the kernel checks CAP_MKNOD/`nodev` against the host),
//! and a minimal `/dev` (null, zero, full, random, urandom, tty, a private devpts).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "device_nodes",
    about: "create/open device nodes (memory, disks, kmsg, tun); no CAP_MKNOD, minimal /dev",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <dirent.h>
#include <sys/sysmacros.h>
int main(void) {
    TRY("mknod_mem", mknod("/tmp/mem", S_IFCHR | 0600, makedev(1, 1)));
    TRY("mknod_disk", mknod("/tmp/sda", S_IFBLK | 0600, makedev(8, 0)));
    TRY("mknod_kmsg", mknod("/tmp/kmsg", S_IFCHR | 0600, makedev(1, 11)));
    TRY("mknod_tun", mknod("/tmp/tun", S_IFCHR | 0600, makedev(10, 200)));
    TRY("open_mem", open("/tmp/mem", O_RDONLY));
    TRY("open_dev_mem", open("/dev/mem", O_RDONLY));
    TRY("open_dev_kmsg", open("/dev/kmsg", O_RDONLY));
    TRY("open_dev_sda", open("/dev/sda", O_RDONLY));
    TRY("open_dev_net_tun", open("/dev/net/tun", O_RDWR));
    /* What /dev holds. */
    DIR *d = opendir("/dev");
    struct dirent *e;
    printf("dev=");
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') printf("%s,", e->d_name);
    printf("\n");
    return 0;
}
"#;

/// Everything a sandbox's `/dev` may hold (`rootfs.rs`).
const DEV: &[&str] = &[
    "null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "shm", "fd", "stdin",
    "stdout", "stderr", "mqueue",
];

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "device_nodes", PROGRAM, &[]).await?;
    for name in ["mknod_mem", "mknod_disk", "mknod_kmsg", "mknod_tun"] {
        out.expect_errno(name, &[EPERM])?;
    }
    for name in [
        "open_mem",
        "open_dev_mem",
        "open_dev_kmsg",
        "open_dev_sda",
        "open_dev_net_tun",
    ] {
        out.expect_errno(name, &[ENOENT, EPERM, EACCES])?;
    }
    let dev = out.field("dev").unwrap_or("");
    for entry in dev.split(',').filter(|e| !e.is_empty()) {
        anyhow::ensure!(
            DEV.contains(&entry),
            "/dev holds {entry:?}, not in the minimal set: {dev}"
        );
    }
    sb.kill().await
}
