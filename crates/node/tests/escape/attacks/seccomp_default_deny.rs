//! The seccomp policy is an allowlist: a system call it does not name fails even when
//! the kernel implements it — so a call a future kernel adds is denied until someone
//! reviews it. Tries `ustat` (implemented by this kernel, not allowed: a filter that
//! only denies a list lets the kernel answer EINVAL), numbers past the newest known
//! call, the x32 and i386 ABIs, and calls denied by name or by argument (`setns`,
//! `sethostname`, NUMA placement, `socket(AF_VSOCK)`). As a control, a debugger's
//! calls on the process's own child (`ptrace`, `process_vm_readv`) must keep working.
//!
//! Contained by: `seccomp.rs` (ENOSYS for everything not in `ALLOWED`, EPERM for
//! `DENIED` and the argument rules, SIGSYS for the i386 ABI). Shown to fail with the
//! pre-allowlist filter (deny list only): `ustat` answered EINVAL.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "seccomp_default_deny",
    about: "make system calls the policy does not list; seccomp allowlist (ENOSYS), deny list (EPERM)",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <sys/ptrace.h>
#include <sys/uio.h>
int main(void) {
    TRY("ustat", syscall(SYS_ustat, 0, NULL));
    TRY("nr_470", syscall(470, 0, 0, 0, 0, 0, 0));
    TRY("nr_1000", syscall(1000, 0, 0, 0, 0, 0, 0));
    TRY("x32_getpid", syscall(0x40000000 | SYS_getpid));
    TRY("setns", setns(0, 0));
    TRY("sethostname", sethostname("escaped", 7));
    TRY("mbind", syscall(SYS_mbind, 0, 0, 0, 0, 0, 0));
    TRY("get_mempolicy", syscall(SYS_get_mempolicy, NULL, NULL, 0, 0, 0));
    TRY("vsock", socket(40 /* AF_VSOCK */, SOCK_STREAM, 0));
    TRY("userfaultfd", syscall(SYS_userfaultfd, 0));
    TRY("getpid", syscall(SYS_getpid));
    /* The i386 ABI (int 0x80) kills the caller. */
    int st = 0;
    pid_t p = fork();
    if (p == 0) { __asm__ volatile("int $0x80" : : "a"(20)); _exit(0); }
    waitpid(p, &st, 0);
    printf("int80_signal=%d\n", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    /* Control: a debugger on its own child. */
    static volatile long secret = 0x5ec2e7;
    p = fork();
    if (p == 0) { raise(SIGSTOP); _exit(0); }
    waitpid(p, &st, WUNTRACED);
    TRY("ptrace_attach", ptrace(PTRACE_SEIZE, p, 0, 0));
    TRY("ptrace_interrupt", ptrace(PTRACE_INTERRUPT, p, 0, 0));
    waitpid(p, &st, __WALL);
    errno = 0;
    long word = ptrace(PTRACE_PEEKDATA, p, (void *)&secret, 0);
    report("ptrace_peek", errno ? -1 : (word == 0x5ec2e7 ? 0 : -1), errno);
    long copy = 0;
    struct iovec local = { &copy, sizeof copy }, remote = { (void *)&secret, sizeof copy };
    TRY("process_vm_readv", syscall(SYS_process_vm_readv, p, &local, 1, &remote, 1, 0));
    kill(p, SIGKILL);
    waitpid(p, &st, __WALL);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    for who in [As::Root, As::User] {
        let out = sb.c(who, "seccomp_default_deny", PROGRAM, &[]).await?;
        let at = |e: anyhow::Error| anyhow::anyhow!("as {who:?}: {e}");
        for name in ["ustat", "nr_470", "nr_1000", "x32_getpid"] {
            out.expect_errno(name, &[ENOSYS]).map_err(at)?;
        }
        for name in [
            "setns",
            "sethostname",
            "mbind",
            "get_mempolicy",
            "vsock",
            "userfaultfd",
        ] {
            out.expect_errno(name, &[EPERM]).map_err(at)?;
        }
        anyhow::ensure!(
            out.field("int80_signal") == Some("31"),
            "as {who:?}: the i386 ABI was not killed with SIGSYS: {}",
            out.all()
        );
        for name in [
            "getpid",
            "ptrace_attach",
            "ptrace_interrupt",
            "ptrace_peek",
            "process_vm_readv",
        ] {
            out.expect_ok(name).map_err(at)?;
        }
    }
    sb.kill().await
}
