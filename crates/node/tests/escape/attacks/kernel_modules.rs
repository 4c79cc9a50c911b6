//! Kernel modules: `init_module` with a module image, `finit_module` on a file and
//! `delete_module`, as the sandbox's root.
//!
//! Contained by: the seccomp policy (EPERM) and the capability bounding set (no
//! CAP_SYS_MODULE, which is checked in the host's user namespace anyway). The host's
//! list of loaded modules is part of the host snapshot.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "kernel_modules",
    about: "load/unload kernel modules; seccomp denies init_module, finit_module, delete_module",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
int main(void) {
    static char image[4096];
    memcpy(image, "\177ELF", 4);
    TRY("init_module", syscall(SYS_init_module, image, sizeof image, ""));
    int fd = open("/tmp/fake.ko", O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (write(fd, image, sizeof image) != sizeof image) return 2;
    TRY("finit_module", syscall(SYS_finit_module, fd, "", 0));
    /* A name no host loads: even a wrongly allowed call unloads nothing. */
    TRY("delete_module", syscall(SYS_delete_module, "cubicle_nonexistent", O_NONBLOCK));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "kernel_modules", PROGRAM, &[]).await?;
    for name in ["init_module", "finit_module", "delete_module"] {
        out.expect_errno(name, &[EPERM])?;
    }
    sb.kill().await
}
