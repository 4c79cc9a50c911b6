//! io_uring: `io_uring_setup` (and `io_uring_enter`/`io_uring_register` on whatever it
//! returned). io_uring bypasses per-syscall filtering (its operations never pass seccomp)
//! and has been a steady source of kernel privilege escalations.
//!
//! Contained by: the seccomp policy (EPERM on all three).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "io_uring",
    about: "set up an io_uring; seccomp denies io_uring_setup/enter/register",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <linux/io_uring.h>
int main(void) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    long fd = syscall(__NR_io_uring_setup, 8, &p);
    report("io_uring_setup", fd, errno);
    TRY("io_uring_enter", syscall(__NR_io_uring_enter, fd < 0 ? 0 : fd, 0, 0, 0, NULL, 0));
    TRY("io_uring_register", syscall(__NR_io_uring_register, fd < 0 ? 0 : fd, IORING_REGISTER_PROBE, NULL, 0));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "io_uring", PROGRAM, &[]).await?;
    for name in ["io_uring_setup", "io_uring_enter", "io_uring_register"] {
        out.expect_errno(name, &[EPERM])?;
    }
    sb.kill().await
}
