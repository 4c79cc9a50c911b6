//! Removing sandboxes' veth pairs in batches.
//!
//! Deleting one veth pair costs 16–19 ms on the development VM (`ip link del`, 50 in a
//! row), most of it RCU grace periods that `unregister_netdevice_many` waits for with
//! the host-wide rtnl lock held: every other link change on the host (the next
//! sandbox's veth, a dying namespace's cleanup) queues behind it. Deleting 50 pairs
//! at once by device group (`ip link del group N`) took 28–30 ms all told, because the
//! kernel waits for those grace periods once per batch rather than once per device.
//!
//! So a detach does not delete its link itself: it moves the host side into the
//! [`DOOMED_GROUP`] (a cheap attribute change) and then waits for a group delete that
//! began after the move. Whoever finds no delete under way issues one; everyone who
//! arrives while it runs waits for the next, which one of them issues when it ends.
//! A lone detach therefore costs what it always did, and concurrent teardowns (a kill
//! storm, a closed create-kill loop) share one delete. The detach still returns only
//! once its link is gone, so the slot can be reused at once, as before.
//!
//! Every node on a host uses the same group: a delete issued by one node may take
//! another node's doomed links with it, which only saves that node its own delete (a
//! link is doomed only once nothing of it is needed, and a delete that finds no link
//! in the group counts as done). A node that dies between the two steps leaves a
//! doomed link named like its slot, which reconciliation removes by name as before.

use std::io;
use std::sync::{Condvar, Mutex};

use super::netlink::RouteSocket;

/// Device group of host-side veths waiting to be deleted (ASCII "cbsd"; 0 is the
/// default group, which the kernel refuses to delete by).
pub(crate) const DOOMED_GROUP: u32 = 0x6362_7364;

/// Serialises group deletes and lets concurrent detaches share them.
#[derive(Default)]
pub(crate) struct LinkReaper {
    state: Mutex<Rounds>,
    done: Condvar,
}

#[derive(Default)]
struct Rounds {
    /// Group deletes begun so far.
    started: u64,
    /// The last delete that ended, and its error (an errno), if it failed.
    finished: u64,
    failed: Option<i32>,
    running: bool,
    /// Callers waiting for a round to end.
    waiting: usize,
}

impl LinkReaper {
    /// Removes the link `name` (in the host's namespace): dooms it, then waits for a
    /// group delete that began after that. A link that is already gone is fine.
    pub(crate) fn remove(&self, host: &mut RouteSocket, name: &str) -> io::Result<()> {
        match host.set_group(name, DOOMED_GROUP) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(e),
        }
        self.delete_round(|| host.delete_group(DOOMED_GROUP))
    }

    /// Waits for a round of `delete` that starts after this call: runs it here if none
    /// is under way, or waits for the one under way to end and then for the next.
    fn delete_round(&self, delete: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // A round already running may have listed the group before our link joined it.
        let ticket = st.started + 1;
        loop {
            if st.finished >= ticket {
                return match st.failed {
                    Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                    None => Ok(()),
                };
            }
            if !st.running {
                break;
            }
            st.waiting += 1;
            st = self.done.wait(st).unwrap_or_else(|p| p.into_inner());
            st.waiting -= 1;
        }
        st.started = ticket;
        st.running = true;
        drop(st);
        let result = match delete() {
            // Nothing left in the group: another node's delete took ours along.
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
            r => r,
        };
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.finished = ticket;
        st.failed = result.as_ref().err().and_then(|e| e.raw_os_error());
        st.running = false;
        drop(st);
        self.done.notify_all();
        result
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_lone_caller_runs_its_own_round() {
        let r = LinkReaper::default();
        let runs = AtomicUsize::new(0);
        for _ in 0..3 {
            r.delete_round(|| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    /// Callers that arrive while a round runs share the next one, and none returns
    /// before a round that began after it arrived has ended.
    #[test]
    fn callers_during_a_round_share_the_next() {
        let r = Arc::new(LinkReaper::default());
        let runs = Arc::new(AtomicUsize::new(0));
        // The first round runs until all the others wait for it.
        let first_started = Arc::new(Barrier::new(2));
        let (r1, runs1, b1) = (r.clone(), runs.clone(), first_started.clone());
        let first = std::thread::spawn(move || {
            r1.delete_round(|| {
                b1.wait();
                while r1.state.lock().unwrap().waiting < 8 {
                    std::thread::sleep(Duration::from_millis(5));
                }
                runs1.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
        });
        first_started.wait();
        let others: Vec<_> = (0..8)
            .map(|_| {
                let (r, runs) = (r.clone(), runs.clone());
                std::thread::spawn(move || {
                    r.delete_round(|| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .map(|()| runs.load(Ordering::SeqCst))
                })
            })
            .collect();
        first.join().unwrap().unwrap();
        for o in others {
            // Each saw the second round done (two rounds counted when it returned).
            assert_eq!(o.join().unwrap().unwrap(), 2);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_failed_round_fails_everyone_it_covered_and_not_the_next() {
        let r = LinkReaper::default();
        let e = r
            .delete_round(|| Err(io::Error::from_raw_os_error(libc::EPERM)))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        r.delete_round(|| Ok(())).unwrap();
        // Nothing in the group is no failure.
        r.delete_round(|| Err(io::Error::from_raw_os_error(libc::ENODEV)))
            .unwrap();
    }
}
