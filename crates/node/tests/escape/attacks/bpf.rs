//! eBPF: `bpf(BPF_PROG_LOAD)` of a socket filter and `bpf(BPF_MAP_CREATE)`, as the
//! sandbox's root (unprivileged eBPF is a long line of kernel exploits).
//!
//! Contained by: the seccomp policy (EPERM), whatever the host's
//! `kernel.unprivileged_bpf_disabled` says (part of the host snapshot).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "bpf",
    about: "load an eBPF program / create a map; seccomp denies bpf",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <linux/bpf.h>
int main(void) {
    /* r0 = 0; exit */
    struct bpf_insn prog[] = {
        { .code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = 0, .imm = 0 },
        { .code = BPF_JMP | BPF_EXIT },
    };
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.prog_type = BPF_PROG_TYPE_SOCKET_FILTER;
    a.insns = (uint64_t)(uintptr_t)prog;
    a.insn_cnt = 2;
    a.license = (uint64_t)(uintptr_t)"GPL";
    TRY("bpf_prog_load", syscall(SYS_bpf, BPF_PROG_LOAD, &a, sizeof a));
    memset(&a, 0, sizeof a);
    a.map_type = BPF_MAP_TYPE_ARRAY;
    a.key_size = 4;
    a.value_size = 8;
    a.max_entries = 1;
    TRY("bpf_map_create", syscall(SYS_bpf, BPF_MAP_CREATE, &a, sizeof a));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "bpf", PROGRAM, &[]).await?;
    out.expect_errno("bpf_prog_load", &[EPERM])?;
    out.expect_errno("bpf_map_create", &[EPERM])?;
    sb.kill().await
}
