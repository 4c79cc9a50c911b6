//! Network namespaces of killed sandboxes, held from the kill until their teardown has
//! read their veth's counters (`SandboxRuntime::hold_network`): while a namespace is
//! held its veth outlives the sandbox's processes, so the teardown learns whether the
//! sandbox ever sent a packet and can skip the conntrack walk for one that never did.
//!
//! Each held namespace is a descriptor, and the kernel keeps the dead sandbox's network
//! stack until it is dropped. A kill storm (thousands of `DELETE`s ahead of the
//! background teardowns) must not exhaust the node's descriptors nor pile up namespaces:
//! beyond [`MAX_HELD`] a kill holds nothing, and that sandbox's teardown forgets its
//! connections the slow way (the walk), as it does for one whose namespace could not be
//! opened.

use std::collections::HashMap;
use std::sync::Mutex;

use cubicle_runtime::network::Netns;

/// At most this many namespaces are held at a time.
pub const MAX_HELD: usize = 512;

/// The held namespaces, by slot.
#[derive(Debug)]
pub struct HeldNamespaces {
    held: Mutex<HashMap<u32, Netns>>,
    max: usize,
}

impl Default for HeldNamespaces {
    fn default() -> Self {
        Self::with_max(MAX_HELD)
    }
}

impl HeldNamespaces {
    /// Holding at most `max` at a time.
    pub fn with_max(max: usize) -> Self {
        HeldNamespaces {
            held: Mutex::new(HashMap::new()),
            max,
        }
    }

    /// Holds `ns` for `slot` (replacing what was held for it), unless `max` are held
    /// already: then `false`, and `ns` is dropped.
    pub fn hold(&self, slot: u32, ns: Netns) -> bool {
        let mut held = self.lock();
        if held.len() >= self.max && !held.contains_key(&slot) {
            return false;
        }
        held.insert(slot, ns);
        true
    }

    /// Whether another namespace could be held now (a caller checks before it opens one).
    pub fn has_room(&self) -> bool {
        self.lock().len() < self.max
    }

    /// What is held for `slot`, no longer held here.
    pub fn take(&self, slot: u32) -> Option<Netns> {
        self.lock().remove(&slot)
    }

    /// How many are held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Netns>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Netns {
        Netns::current().expect("this thread's network namespace")
    }

    #[test]
    fn holds_up_to_its_maximum_then_refuses() {
        let h = HeldNamespaces::with_max(2);
        assert!(h.hold(1, ns()));
        assert!(h.hold(2, ns()));
        assert!(!h.has_room());
        assert!(!h.hold(3, ns()), "a third was held beyond the maximum");
        assert_eq!(h.len(), 2);
        // The same slot again replaces (a retried kill), even when full.
        assert!(h.hold(2, ns()));
        assert!(h.take(3).is_none());
        assert!(h.take(1).is_some());
        assert!(h.take(1).is_none(), "taken twice");
        assert!(h.has_room());
        assert!(h.hold(3, ns()));
        assert!(h.take(2).is_some() && h.take(3).is_some());
        assert!(h.is_empty());
    }
}
