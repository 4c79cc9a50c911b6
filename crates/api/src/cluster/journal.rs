//! The node's status journal: how `GET /node/v1/status?epoch=E&since=G` answers with the
//! sandboxes that changed since a replica's last poll instead of all of them.
//!
//! A full listing of a node with 6,000 sandboxes is about 4 MB of JSON, which a replica
//! polling every 500 ms parsed whole each time. The journal keeps, per listed sandbox, a
//! fingerprint of its JSON and the generation it last changed at, and the ids that left
//! with the generation they left at. Each status call compares the node's list with it
//! (a hash per sandbox, no JSON kept or sent for the unchanged ones), moves to a new
//! generation if anything changed, and answers:
//!
//! - `since` from this journal (`epoch` matches) and not older than the oldest removal
//!   kept: only the sandboxes whose generation is newer (`delta: true`), and `removed`;
//! - anything else (first poll, a node restarted, a replica far behind): the full list.
//!
//! Either way the answer carries `epoch`, `generation` (what to ask `since` next) and `count`
//! (how many sandboxes the node lists in all: a replica whose view has another count asks
//! for the full list next). The diff is computed from what the node lists, not from hooks
//! in every code path that changes a sandbox, so no change can be missed.

use std::collections::{HashMap, VecDeque};
use std::hash::Hasher;

use cubicle_node::SandboxInfo;
use serde::{Deserialize, Serialize};

/// Removals kept for deltas; a replica further behind gets the full list.
const REMOVALS_KEPT: usize = 65_536;

/// Where a status answer stands in its node's journal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JournalMark {
    /// The journal (a new one per node process).
    pub epoch: u64,
    /// Its generation when the answer was made.
    pub generation: u64,
}

/// What a status answer lists, from [`StatusJournal::answer`].
#[derive(Debug, Default)]
pub struct JournalAnswer {
    /// All sandboxes (`delta` false) or those changed since the mark asked for.
    pub sandboxes: Vec<SandboxInfo>,
    /// Only changes.
    pub delta: bool,
    /// Ids gone since the mark asked for (with `delta`).
    pub removed: Vec<String>,
    /// How many sandboxes the node lists in all.
    pub count: usize,
    pub mark: JournalMark,
}

/// One node's journal (see the module doc).
#[derive(Debug)]
pub struct StatusJournal {
    epoch: u64,
    generation: u64,
    /// Per listed id: fingerprint, generation of its last change.
    seen: HashMap<String, (u64, u64)>,
    /// Ids gone, with the generation they went at, oldest first.
    removed: VecDeque<(u64, String)>,
    /// Deltas since a generation below this cannot be given (removals were dropped).
    floor: u64,
    /// The node's listing version at the last listing.
    version: Option<u64>,
}

impl Default for StatusJournal {
    fn default() -> Self {
        Self::new()
    }
}

impl StatusJournal {
    /// A new journal with an epoch of its own.
    pub fn new() -> Self {
        StatusJournal {
            epoch: rand::random::<u64>() | 1,
            generation: 0,
            seen: HashMap::new(),
            removed: VecDeque::new(),
            floor: 0,
            version: None,
        }
    }

    /// Answers a poll that asked `since`, given the node's listing version (read before
    /// listing: [`cubicle_node::Node::listing_version`]) and how to list its sandboxes.
    /// When the version is the one of the last listing and the poll is up to date, the
    /// answer is an empty delta and nothing is listed: an idle node's poll is O(1).
    pub fn answer(
        &mut self,
        version: u64,
        list: impl FnOnce() -> Vec<SandboxInfo>,
        since: Option<JournalMark>,
    ) -> JournalAnswer {
        let mark = JournalMark {
            epoch: self.epoch,
            generation: self.generation,
        };
        if self.version == Some(version) && since == Some(mark) {
            return JournalAnswer {
                delta: true,
                count: self.seen.len(),
                mark,
                ..Default::default()
            };
        }
        self.version = Some(version);
        self.record(list(), since)
    }

    /// Records `list` (the node's sandboxes now) and answers a poll that asked `since`.
    fn record(&mut self, list: Vec<SandboxInfo>, since: Option<JournalMark>) -> JournalAnswer {
        let next = self.generation + 1;
        let mut changed = false;
        let mut listed = HashMap::with_capacity(list.len());
        for s in &list {
            let fp = fingerprint(s);
            let id = s.id.to_string();
            let at = match self.seen.get(&id) {
                Some(&(old, at)) if old == fp => at,
                _ => {
                    changed = true;
                    next
                }
            };
            listed.insert(id, (fp, at));
        }
        for id in self.seen.keys() {
            if !listed.contains_key(id) {
                changed = true;
                self.removed.push_back((next, id.clone()));
            }
        }
        while self.removed.len() > REMOVALS_KEPT {
            if let Some((g, _)) = self.removed.pop_front() {
                self.floor = self.floor.max(g);
            }
        }
        if changed {
            self.generation = next;
        }
        self.seen = listed;
        let mark = JournalMark {
            epoch: self.epoch,
            generation: self.generation,
        };
        let count = list.len();
        let from = since.filter(|m| {
            m.epoch == self.epoch && m.generation >= self.floor && m.generation <= self.generation
        });
        let Some(from) = from else {
            return JournalAnswer {
                sandboxes: list,
                delta: false,
                removed: Vec::new(),
                count,
                mark,
            };
        };
        let removed = self
            .removed
            .iter()
            .filter(|(g, _)| *g > from.generation)
            .map(|(_, id)| id.clone())
            // An id that left and came back (a resume, a move back) is listed, not gone.
            .filter(|id| !self.seen.contains_key(id))
            .collect();
        let sandboxes = list
            .into_iter()
            .filter(|s| {
                self.seen
                    .get(s.id.as_str())
                    .is_some_and(|&(_, at)| at > from.generation)
            })
            .collect();
        JournalAnswer {
            sandboxes,
            delta: true,
            removed,
            count,
            mark,
        }
    }
}

/// A hash of what a replica would read of `s` (its JSON).
fn fingerprint(s: &SandboxInfo) -> u64 {
    struct HashWriter(std::hash::DefaultHasher);
    impl std::io::Write for HashWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.write(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut w = HashWriter(std::hash::DefaultHasher::new());
    // Serializing into a hasher cannot fail (no I/O, every field serializable).
    let _ = serde_json::to_writer(&mut w, s);
    w.0.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, end: u64) -> SandboxInfo {
        serde_json::from_value(serde_json::json!({
            "id": id, "template": "base", "state": "running", "deathReason": null,
            "createdAtMs": 1, "endAtMs": end, "memoryMb": 512, "cpus": 2, "diskMb": 5120,
            "internet": true, "network": {}, "maskRequestHost": null, "metadata": {},
            "accessToken": "t", "uidBase": 100000, "pid": null, "envdSocket": "/x",
            "readyUs": 0, "lifecycle": {}, "busy": false, "pauseMode": null,
            "pausedAtMs": null, "envdUnresponsiveAtPause": false, "timeoutMs": 300000,
            "oomKills": 0, "volumes": [], "claimed": false,
        }))
        .expect("a SandboxInfo")
    }

    fn ids(a: &JournalAnswer) -> Vec<String> {
        let mut v: Vec<String> = a.sandboxes.iter().map(|s| s.id.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_poll_gets_what_changed_since_its_last() {
        let mut j = StatusJournal::new();
        let first = j.record(vec![info("a", 1), info("b", 1)], None);
        assert!(!first.delta);
        assert_eq!(
            (ids(&first), first.count),
            (vec!["a".into(), "b".into()], 2)
        );
        // Nothing changed: an empty delta at the same generation.
        let same = j.record(vec![info("a", 1), info("b", 1)], Some(first.mark));
        assert!(same.delta && same.sandboxes.is_empty() && same.removed.is_empty());
        assert_eq!(same.mark, first.mark);
        // b's end time moved, c came, a left.
        let next = j.record(vec![info("b", 2), info("c", 1)], Some(same.mark));
        assert!(next.delta);
        assert_eq!(ids(&next), vec!["b".to_string(), "c".into()]);
        assert_eq!(next.removed, vec!["a".to_string()]);
        assert_eq!(next.count, 2);
        assert_eq!(
            next.sandboxes[0].end_at_ms.max(next.sandboxes[1].end_at_ms),
            2
        );
        // A poll that missed one answer still gets every change since its mark.
        let later = j.record(vec![info("b", 2), info("c", 1), info("d", 1)], None);
        let behind = j.record(
            vec![info("b", 2), info("c", 1), info("d", 1)],
            Some(first.mark),
        );
        assert!(behind.delta);
        assert_eq!(ids(&behind), vec!["b".to_string(), "c".into(), "d".into()]);
        assert_eq!(behind.removed, vec!["a".to_string()]);
        assert_eq!(behind.mark, later.mark);
        // A sandbox that left and came back is listed, not removed.
        let gone = j.record(vec![info("c", 1), info("d", 1)], Some(behind.mark));
        assert_eq!(gone.removed, vec!["b".to_string()]);
        let back = j.record(
            vec![info("b", 3), info("c", 1), info("d", 1)],
            Some(behind.mark),
        );
        assert!(back.removed.is_empty(), "{:?}", back.removed);
        assert_eq!(ids(&back), vec!["b".to_string()]);
    }

    #[test]
    fn an_unchanged_node_is_not_listed_again() {
        let mut j = StatusJournal::new();
        let first = j.answer(1, || vec![info("a", 1)], None);
        assert_eq!(first.count, 1);
        // Same version, poll up to date: answered without listing.
        let idle = j.answer(
            1,
            || panic!("listed although nothing changed"),
            Some(first.mark),
        );
        assert!(idle.delta && idle.sandboxes.is_empty() && idle.removed.is_empty());
        assert_eq!((idle.count, idle.mark), (1, first.mark));
        // Same version but a poll that is behind or new: listed (it needs the sandboxes).
        let fresh = j.answer(1, || vec![info("a", 1)], None);
        assert!(!fresh.delta && fresh.sandboxes.len() == 1);
        // A new version: listed, and the change found.
        let changed = j.answer(2, || vec![info("a", 2)], Some(first.mark));
        assert!(changed.delta);
        assert_eq!(changed.sandboxes.len(), 1);
        assert_ne!(changed.mark, first.mark);
    }

    #[test]
    fn another_journal_or_a_mark_too_old_gets_the_full_list() {
        let mut j = StatusJournal::new();
        let a = j.record(vec![info("a", 1)], None);
        // A node that restarted has a new journal: its generations mean something else.
        let mut restarted = StatusJournal::new();
        let r = restarted.record(vec![info("b", 1)], Some(a.mark));
        assert!(!r.delta);
        assert_eq!(ids(&r), vec!["b".to_string()]);
        // A mark from the future (the same epoch cannot have one): full.
        let future = JournalMark {
            epoch: a.mark.epoch,
            generation: a.mark.generation + 5,
        };
        assert!(!j.record(vec![info("a", 1)], Some(future)).delta);
        // Removals past what is kept: a mark older than them gets the full list.
        j.floor = a.mark.generation + 1;
        let old = j.record(vec![info("a", 1)], Some(a.mark));
        assert!(!old.delta);
        assert_eq!(old.count, 1);
    }
}
