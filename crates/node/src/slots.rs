//! Uid slots: every live sandbox owns a distinct range of 65536 host uids/gids,
//! `base + slot * 65536`, and a slot is reused only after its sandbox is fully cleaned.
//! A slot also fixes the sandbox's network address, so a freed slot rests for a while
//! (the quarantine) before it is handed out again, as long as other slots are free: a
//! remote peer's or an audit trail's idea of who had an address stays true a little
//! longer than the sandbox.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Ids per sandbox (a full 16-bit range, so uid 65534 `nobody` maps too).
pub const IDS_PER_SANDBOX: u32 = 65536;

/// Allocator of slots `first..end`.
#[derive(Debug)]
pub struct UidSlots {
    base: u32,
    first: u32,
    end: u32,
    used: BTreeSet<u32>,
    /// When recently freed slots were freed.
    resting: HashMap<u32, Instant>,
    quarantine: Duration,
    /// Every slot below this one is used or resting: where the search for the lowest free
    /// slot starts (a scan from `first` walked every used slot, at every create).
    low: u32,
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
            resting: HashMap::new(),
            quarantine: Duration::ZERO,
            low: first,
        }
    }

    /// Sets how long a freed slot rests before it is preferred again.
    pub fn with_quarantine(mut self, quarantine: Duration) -> Self {
        self.quarantine = quarantine;
        self
    }

    /// The first host id of `slot`.
    pub fn uid_base(&self, slot: u32) -> u32 {
        self.base + slot * IDS_PER_SANDBOX
    }

    /// The lowest free slot that is not resting; else the one that has rested longest.
    pub fn allocate(&mut self) -> Option<u32> {
        let now = Instant::now();
        let q = self.quarantine;
        let mut low = self.low;
        self.resting.retain(|s, at| {
            let rests = now.duration_since(*at) < q;
            if !rests {
                low = low.min(*s);
            }
            rests
        });
        let lowest =
            (low..self.end).find(|s| !self.used.contains(s) && !self.resting.contains_key(s));
        // Below the one found (or everywhere, if none) every slot is used or resting, and
        // the one handed out is used from now on.
        self.low = lowest.map_or(self.end, |s| s + 1);
        let slot = lowest.or_else(|| {
            self.resting
                .iter()
                .filter(|(s, _)| !self.used.contains(s))
                .min_by_key(|(_, at)| **at)
                .map(|(s, _)| *s)
        })?;
        self.resting.remove(&slot);
        self.used.insert(slot);
        Some(slot)
    }

    /// Mark `slot` used (adoption after a restart). False if it was already used/out of range.
    pub fn reserve(&mut self, slot: u32) -> bool {
        (self.first..self.end).contains(&slot) && self.used.insert(slot)
    }

    /// Give `slot` back (only after the sandbox is cleaned).
    pub fn release(&mut self, slot: u32) {
        if self.used.remove(&slot) {
            if self.quarantine.is_zero() {
                self.low = self.low.min(slot);
            } else {
                self.resting.insert(slot, Instant::now());
            }
        }
    }

    /// The slots this allocator hands out.
    pub fn range(&self) -> std::ops::Range<u32> {
        self.first..self.end
    }

    /// Slots neither in use nor out of range (resting ones included: they are handed
    /// out when nothing else is free).
    pub fn free(&self) -> usize {
        self.range().len().saturating_sub(self.used.len())
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

    /// The search starts where the last one ended, and still finds the lowest free slot:
    /// one released below it, one whose rest ended, and a reserved one is skipped.
    #[test]
    fn the_lowest_free_slot_is_found_from_the_hint() {
        let mut s = UidSlots::new(0, 0, 100);
        let got: Vec<u32> = (0..10).filter_map(|_| s.allocate()).collect();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert!(s.reserve(10));
        assert_eq!(s.allocate(), Some(11));
        s.release(3);
        s.release(7);
        assert_eq!(s.allocate(), Some(3));
        assert_eq!(s.allocate(), Some(7));
        assert_eq!(s.allocate(), Some(12));

        let mut r = UidSlots::new(0, 0, 100).with_quarantine(Duration::from_millis(30));
        for want in 0..5 {
            assert_eq!(r.allocate(), Some(want));
        }
        r.release(1);
        assert_eq!(r.allocate(), Some(5), "a resting slot is passed over");
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(
            r.allocate(),
            Some(1),
            "its rest over, it is the lowest again"
        );
        assert_eq!(r.allocate(), Some(6));
    }

    #[test]
    fn freed_slots_rest_while_others_are_free() {
        let mut s = UidSlots::new(0, 0, 3).with_quarantine(Duration::from_secs(60));
        let a = s.allocate().unwrap();
        s.release(a);
        let b = s.allocate().unwrap();
        assert_ne!(a, b, "a freed slot is not handed out again at once");
        let c = s.allocate().unwrap();
        assert_ne!(c, a);
        // Only the resting one is left: it is used rather than failing.
        assert_eq!(s.allocate(), Some(a));
        assert_eq!(s.allocate(), None);
    }
}
