//! PID-1 duties (`--init`): when envd is the first process of a sandbox's pid namespace,
//! something must reap orphaned zombies and pass termination signals on. Before any
//! thread exists, the process forks: the parent stays PID 1 and only reaps and forwards;
//! the child becomes the envd server. When the server exits, PID 1 exits with its status
//! (which ends the sandbox).

use nix::{
    sys::{
        signal::{self, SigHandler, Signal},
        wait::{WaitStatus, waitpid},
    },
    unistd::{ForkResult, Pid, fork},
};
use std::sync::atomic::{AtomicI32, Ordering};

static SERVER_PID: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int) {
    let pid = SERVER_PID.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Forks; returns in the child (the server). The parent never returns.
///
/// Must be called while the process is still single-threaded.
pub fn become_init() {
    // SAFETY: called before any thread is started (main, before the tokio runtime).
    match unsafe { fork() } {
        Ok(ForkResult::Child) => {}
        Ok(ForkResult::Parent { child }) => reap_forever(child),
        Err(e) => {
            eprintln!("cubicle-envd: fork for init failed: {e}; serving as PID 1 without a reaper");
        }
    }
}

fn reap_forever(server: Pid) -> ! {
    SERVER_PID.store(server.as_raw(), Ordering::Relaxed);
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGUSR1, Signal::SIGUSR2] {
        // SAFETY: the handler only calls kill(2).
        let _ = unsafe { signal::signal(sig, SigHandler::Handler(forward)) };
    }
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == server => std::process::exit(code),
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == server => {
                std::process::exit(128 + sig as i32)
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::ECHILD) => std::process::exit(0),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
}
