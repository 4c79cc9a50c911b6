//! Closing every upstream connection to one sandbox at once — the idle ones in the
//! client's pool, the busy ones (a streaming command) and upgraded tunnels alike.
//!
//! A sandbox about to be checkpointed (paused, snapshotted, forked) must have no
//! connection from outside: CRIU cannot save the far end of a socket it does not own, and
//! a restored sandbox could not use it anyway (E2B's semantics: connections from outside
//! are dropped, the SDK reconnects). Every [`Upstream`](crate::connector::Upstream)
//! carries a [`Link`]; [`Drains::drain`] marks all links of a sandbox closed and wakes
//! their tasks, whose next read or write fails, which ends the connection (an idle pooled
//! connection's task is always polling its read side, so it goes too).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Waker};

/// One connection's side of the switch.
#[derive(Debug, Default)]
pub struct Link {
    closed: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Link {
    /// Whether the connection must end now. Registers the task to be woken by a drain.
    pub fn check(&self, cx: &Context<'_>) -> std::io::Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "connection closed: the sandbox is being paused or snapshotted",
            ));
        }
        let mut w = self.waker.lock().unwrap_or_else(|p| p.into_inner());
        match &*w {
            Some(old) if old.will_wake(cx.waker()) => {}
            _ => *w = Some(cx.waker().clone()),
        }
        drop(w);
        // A drain between the check and the registration: see it now.
        if self.closed.load(Ordering::Acquire) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "connection closed: the sandbox is being paused or snapshotted",
            ));
        }
        Ok(())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            w.wake();
        }
    }
}

/// The links of every sandbox's upstream connections.
#[derive(Debug, Default, Clone)]
pub struct Drains {
    links: Arc<Mutex<HashMap<String, Vec<Weak<Link>>>>>,
}

impl Drains {
    /// A new link for a connection to sandbox `id`.
    pub fn link(&self, id: &str) -> Arc<Link> {
        let link = Arc::new(Link::default());
        let mut m = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let v = m.entry(id.to_string()).or_default();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(&link));
        link
    }

    /// Closes every connection to sandbox `id`; returns how many were open.
    pub fn drain(&self, id: &str) -> usize {
        let links = self
            .links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
            .unwrap_or_default();
        let mut n = 0;
        for l in links.iter().filter_map(Weak::upgrade) {
            l.close();
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Wake;

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn drain_closes_and_wakes_only_that_sandbox() {
        let d = Drains::default();
        let a = d.link("a");
        let b = d.link("b");
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let cx = Context::from_waker(&waker);
        assert!(a.check(&cx).is_ok());
        assert_eq!(d.drain("a"), 1);
        assert!(flag.0.load(Ordering::SeqCst), "the task was woken");
        assert!(a.check(&cx).is_err());
        assert!(b.check(&cx).is_ok());
        assert_eq!(d.drain("a"), 0);
    }
}
