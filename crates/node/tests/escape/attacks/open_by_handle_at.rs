//! "Shocker" (2014): `open_by_handle_at` opens any inode of a filesystem by its handle,
//! ignoring the caller's root directory — with a guessed handle (inode 2, the root of an
//! ext4/XFS filesystem) for the filesystem of a mount the sandbox can see, a container
//! read the host's /etc/shadow. Also `name_to_handle_at`.
//!
//! Contained by: the seccomp policy (EPERM on both) and the missing
//! CAP_DAC_READ_SEARCH (checked in the host's user namespace).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "open_by_handle_at",
    about: "open host inodes by file handle (shocker); seccomp denies open_by_handle_at, name_to_handle_at",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
struct handle { unsigned int bytes; int type; unsigned char f[128]; };
int main(void) {
    struct handle h;
    int mount_id;
    memset(&h, 0, sizeof h);
    h.bytes = sizeof h.f;
    TRY("name_to_handle_at", syscall(SYS_name_to_handle_at, AT_FDCWD, "/etc/hostname", &h, &mount_id, 0));
    /* The shocker handle: inode 2, generation 0 (FILEID_INO32_GEN). */
    memset(&h, 0, sizeof h);
    h.bytes = 8;
    h.type = 1;
    h.f[0] = 2;
    const char *mounts[] = { "/", "/run/cubicle/envd", "/etc/hosts", "/dev/null", NULL };
    char name[64];
    for (int i = 0; mounts[i]; i++) {
        int fd = open(mounts[i], O_RDONLY);
        snprintf(name, sizeof name, "open_by_handle_at_%d", i);
        TRY(name, syscall(SYS_open_by_handle_at, fd, &h, O_RDONLY));
    }
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "open_by_handle_at", PROGRAM, &[]).await?;
    out.expect_errno("name_to_handle_at", &[EPERM])?;
    for i in 0..4 {
        out.expect_errno(&format!("open_by_handle_at_{i}"), &[EPERM])?;
    }
    sb.kill().await
}
