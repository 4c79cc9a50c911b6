//! Uid slots: every live sandbox owns a distinct range of 65536 host uids/gids,
//! `base + slot * 65536`, and a slot is reused only after its sandbox is fully cleaned.

use std::collections::BTreeSet;

/// Ids per sandbox (a full 16-bit range, so uid 65534 `nobody` maps too).
pub const IDS_PER_SANDBOX: u32 = 65536;

/// Allocator of slots `first..end`.
#[derive(Debug)]
pub struct UidSlots {
    base: u32,
    first: u32,
    end: u32,
    used: BTreeSet<u32>,
}

impl UidSlots {
    /// Slots `first..end`; slot `s` owns host ids `base + s * 65536 ..`. `end` is clamped
    /// so that every range stays below 2^32.
    pub fn new(base: u32, first: u32, end: u32) -> Self {
        let fit = (u32::MAX - base) / IDS_PER_SANDBOX;
        UidSlots {
            base,
            first,
            end: end.min(fit),
            used: BTreeSet::new(),
        }
    }

    /// The first host id of `slot`.
    pub fn uid_base(&self, slot: u32) -> u32 {
        self.base + slot * IDS_PER_SANDBOX
    }

    /// The lowest free slot.
    pub fn allocate(&mut self) -> Option<u32> {
        let slot = (self.first..self.end).find(|s| !self.used.contains(s))?;
        self.used.insert(slot);
        Some(slot)
    }

    /// Mark `slot` used (adoption after a restart). False if it was already used/out of range.
    pub fn reserve(&mut self, slot: u32) -> bool {
        (self.first..self.end).contains(&slot) && self.used.insert(slot)
    }

    /// Give `slot` back (only after the sandbox is cleaned).
    pub fn release(&mut self, slot: u32) {
        self.used.remove(&slot);
    }

    /// The slots this allocator hands out.
    pub fn range(&self) -> std::ops::Range<u32> {
        self.first..self.end
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.used.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_ranges_and_reuse_after_release() {
        let mut s = UidSlots::new(200_000, 10, 14);
        let a = s.allocate().unwrap();
        let b = s.allocate().unwrap();
        assert_ne!(s.uid_base(a), s.uid_base(b));
        assert_eq!(s.uid_base(b) - s.uid_base(a), IDS_PER_SANDBOX);
        assert!(!s.reserve(a));
        s.release(a);
        assert_eq!(s.allocate(), Some(a));
        assert!(s.allocate().is_some() && s.allocate().is_some());
        assert_eq!(s.allocate(), None);
        assert!(!s.reserve(3));
        assert!(!UidSlots::new(u32::MAX - 10, 0, 5).reserve(0));
    }
}
