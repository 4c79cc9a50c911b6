//! Nested user namespaces: inside a new user namespace a process holds every capability
//! again (for that namespace), which re-opens mount, the new mount API, and the kernel
//! code behind them. Tries `unshare(CLONE_NEWUSER)`, `clone(CLONE_NEWUSER)` and
//! `clone3(CLONE_NEWUSER)` as root and as `user`, `unshare -Ur`, and other namespaces.
//!
//! Contained by: the seccomp policy (EPERM for any CLONE_NEW* flag of clone/unshare;
//! ENOSYS for clone3, whose flags live in memory seccomp cannot read, so libc falls back
//! to clone) and the missing CAP_SYS_ADMIN for the other namespace kinds.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "user_namespaces",
    about: "create a nested user namespace (capabilities regained inside); seccomp denies CLONE_NEWUSER, clone3",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <linux/sched.h>
struct clone_args_v0 { uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls; };
int main(void) {
    TRY("unshare_newuser", unshare(CLONE_NEWUSER));
    long r = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    report("clone_newuser", r, errno);
    if (r > 0) waitpid(r, NULL, 0);
    struct clone_args_v0 a;
    memset(&a, 0, sizeof a);
    a.flags = CLONE_NEWUSER;
    a.exit_signal = SIGCHLD;
    r = syscall(SYS_clone3, &a, sizeof a);
    if (r == 0) _exit(0);
    report("clone3_newuser", r, errno);
    if (r > 0) waitpid(r, NULL, 0);
    TRY("unshare_newns", unshare(CLONE_NEWNS));
    TRY("unshare_newnet", unshare(CLONE_NEWNET));
    TRY("unshare_newpid", unshare(CLONE_NEWPID));
    TRY("unshare_newcgroup", unshare(CLONE_NEWCGROUP));
    TRY("unshare_newtime", unshare(0x80 /* CLONE_NEWTIME */));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    for who in [As::Root, As::User] {
        let out = sb.c(who, "user_namespaces", PROGRAM, &[]).await?;
        for name in [
            "unshare_newuser",
            "clone_newuser",
            "unshare_newns",
            "unshare_newnet",
            "unshare_newpid",
            "unshare_newcgroup",
            "unshare_newtime",
        ] {
            out.expect_errno(name, &[EPERM])
                .map_err(|e| anyhow::anyhow!("as {who:?}: {e}"))?;
        }
        out.expect_errno("clone3_newuser", &[ENOSYS])
            .map_err(|e| anyhow::anyhow!("as {who:?}: {e}"))?;
    }
    let o = sb
        .sh(As::Root, "unshare -Ur id -u 2>&1; echo rc=$?")
        .await?;
    anyhow::ensure!(
        o.field("rc").is_some_and(|rc| rc != "0"),
        "`unshare -Ur` worked: {}",
        o.all()
    );
    sb.kill().await
}
