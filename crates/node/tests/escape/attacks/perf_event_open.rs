//! `perf_event_open`: a software clock counter on the calling thread, and a CPU-wide
//! hardware counter (side channels on other tenants; a frequent source of kernel bugs).
//!
//! Contained by: the seccomp policy (EPERM), whatever the host's `perf_event_paranoid`
//! says (part of the host snapshot).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "perf_event_open",
    about: "open perf events; seccomp denies perf_event_open",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <linux/perf_event.h>
int main(void) {
    struct perf_event_attr a;
    memset(&a, 0, sizeof a);
    a.size = sizeof a;
    a.type = PERF_TYPE_SOFTWARE;
    a.config = PERF_COUNT_SW_CPU_CLOCK;
    a.disabled = 1;
    TRY("perf_self", syscall(SYS_perf_event_open, &a, 0, -1, -1, 0));
    a.type = PERF_TYPE_HARDWARE;
    a.config = PERF_COUNT_HW_CPU_CYCLES;
    TRY("perf_cpu_wide", syscall(SYS_perf_event_open, &a, -1, 0, -1, 0));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "perf_event_open", PROGRAM, &[]).await?;
    out.expect_errno("perf_self", &[EPERM])?;
    out.expect_errno("perf_cpu_wide", &[EPERM])?;
    sb.kill().await
}
