//! Garbage collection of layers and disk use per template.
//!
//! A layer is kept while any tag of any template reaches it, while a running sandbox uses
//! it (the caller passes those), while a build of this process holds a lease on it, and
//! for a grace period after it was stored (a build in another process may be about to
//! publish it). Everything else is removed by [`TemplateStore::gc`].

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::Result;
use crate::{LayerInfo, TemplateStore, validate_name};

/// Layers that builds in this process are using, by lease number.
#[derive(Debug, Default)]
pub struct Leases {
    next: AtomicU64,
    held: Mutex<BTreeMap<u64, Vec<String>>>,
}

/// Holds layers out of GC until dropped.
pub struct Lease {
    leases: Arc<Leases>,
    n: u64,
}

impl Lease {
    /// Add layers to the lease (a build's new layers as it makes them).
    pub fn add(&self, ids: &[String]) {
        if let Ok(mut h) = self.leases.held.lock()
            && let Some(v) = h.get_mut(&self.n)
        {
            v.extend(ids.iter().cloned());
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Ok(mut h) = self.leases.held.lock() {
            h.remove(&self.n);
        }
    }
}

/// What a collection did.
#[derive(Debug, Default, Clone)]
pub struct GcReport {
    /// Layers removed.
    pub removed: Vec<LayerInfo>,
    /// Their total size.
    pub freed_bytes: u64,
    /// Layers kept.
    pub kept: usize,
}

/// Disk use of one template.
#[derive(Debug, Clone)]
pub struct TemplateUsage {
    /// Template name.
    pub name: String,
    /// Layers its tags reach.
    pub layers: usize,
    /// Their total size (what the template would take alone).
    pub total_bytes: u64,
    /// The part no other template shares (what removing it frees).
    pub unique_bytes: u64,
}

impl TemplateStore {
    /// Keep `ids` out of GC until the returned lease is dropped.
    pub fn lease(&self, ids: &[String]) -> Lease {
        let n = self.leases.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut h) = self.leases.held.lock() {
            h.insert(n, ids.to_vec());
        }
        Lease {
            leases: self.leases.clone(),
            n,
        }
    }

    /// Names of every template directory (published or with builds only).
    fn template_names(&self) -> Vec<String> {
        let Ok(rd) = fs::read_dir(self.root()) else {
            return Vec::new();
        };
        let mut out: Vec<String> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.') && validate_name(n).is_ok())
            .collect();
        out.sort();
        out
    }

    /// Every layer something still needs: reached by a tag, leased, or in `in_use`.
    pub fn live_layers(&self, in_use: &HashSet<String>) -> HashSet<String> {
        let mut live: HashSet<String> = in_use.clone();
        for name in self.template_names() {
            live.extend(self.referenced_layers(&name));
        }
        if let Ok(h) = self.leases.held.lock() {
            for v in h.values() {
                live.extend(v.iter().cloned());
            }
        }
        live
    }

    /// Remove every layer nothing needs that is older than `grace`. `in_use`: layers of
    /// running sandboxes (the node knows them).
    pub fn gc(&self, in_use: &HashSet<String>, grace: Duration) -> Result<GcReport> {
        let live = self.live_layers(in_use);
        let now = crate::unix_now();
        let mut report = GcReport::default();
        for info in self.layers().list() {
            let young = now.saturating_sub(info.created_at) < grace.as_secs();
            if live.contains(&info.id) || young {
                report.kept += 1;
                continue;
            }
            self.layers().remove(&info.id)?;
            report.freed_bytes += info.size_bytes;
            report.removed.push(info);
        }
        Ok(report)
    }

    /// Disk use per template (layers shared between templates counted in each total, and
    /// in no template's unique part).
    pub fn disk_usage(&self) -> Vec<TemplateUsage> {
        let sizes: BTreeMap<String, u64> = self
            .layers()
            .list()
            .into_iter()
            .map(|l| (l.id, l.size_bytes))
            .collect();
        let per: Vec<(String, Vec<String>)> = self
            .template_names()
            .into_iter()
            .map(|n| {
                let l = self.referenced_layers(&n);
                (n, l)
            })
            .collect();
        let mut users: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, layers) in &per {
            for l in layers {
                *users.entry(l.as_str()).or_default() += 1;
            }
        }
        per.iter()
            .map(|(name, layers)| {
                let size = |l: &String| sizes.get(l).copied().unwrap_or(0);
                TemplateUsage {
                    name: name.clone(),
                    layers: layers.len(),
                    total_bytes: layers.iter().map(size).sum(),
                    unique_bytes: layers
                        .iter()
                        .filter(|l| users.get(l.as_str()) == Some(&1))
                        .map(size)
                        .sum(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{TemplateConfig, fsutil, layer::digest_of};

    #[test]
    fn collects_only_what_nothing_needs() {
        let state = std::env::temp_dir().join(format!("cubicle-gc-{}", std::process::id()));
        let store = TemplateStore::open(&state).unwrap();
        let mk = |n: &[u8]| {
            let id = digest_of(&[n]);
            let s = store.layers().staging().unwrap();
            fs::write(s.path().join("f"), n).unwrap();
            store.layers().store(s, &id, "test").unwrap();
            id
        };
        let (shared, a, b, orphan, running, leased) =
            (mk(b"s"), mk(b"a"), mk(b"b"), mk(b"o"), mk(b"r"), mk(b"l"));
        for (name, top) in [("ta", &a), ("tb", &b)] {
            let mut c = TemplateConfig::with_defaults(name, "test");
            c.layers = vec![shared.clone(), top.clone()];
            let rec = store.new_build(name, &format!("b{name}"), vec![]).unwrap();
            store.publish(rec, c).unwrap();
        }
        let usage = store.disk_usage();
        let ta = usage.iter().find(|u| u.name == "ta").unwrap();
        assert_eq!((ta.layers, ta.total_bytes, ta.unique_bytes), (2, 2, 1));
        let _lease = store.lease(std::slice::from_ref(&leased));
        let in_use = HashSet::from([running.clone()]);
        // Young layers survive the grace period.
        assert!(
            store
                .gc(&in_use, Duration::from_secs(3600))
                .unwrap()
                .removed
                .is_empty()
        );
        let r = store.gc(&in_use, Duration::ZERO).unwrap();
        let removed: Vec<_> = r.removed.iter().map(|l| l.id.clone()).collect();
        assert_eq!(removed, vec![orphan]);
        for id in [&shared, &a, &b, &running, &leased] {
            assert!(store.layers().contains(id));
        }
        fsutil::remove_tree(&state).unwrap();
    }
}
