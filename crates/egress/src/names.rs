//! The addresses the resolver handed out to one sandbox, by name: what lets the proxy
//! tell "a connection to an address of `api.example.com` that says `api.example.com`"
//! from "a connection to some other address that says `api.example.com`". Bounded;
//! entries expire (no sooner than [`MIN_KEEP`], since programs cache answers beyond
//! their TTL).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// Shortest time an answer is remembered, whatever its TTL.
pub const MIN_KEEP: Duration = Duration::from_secs(600);
/// Longest.
pub const MAX_KEEP: Duration = Duration::from_secs(86_400);
/// Most (address, name) pairs kept per sandbox.
pub const MAX_ENTRIES: usize = 8192;

/// (address, name) pairs with expiry times.
#[derive(Debug, Default)]
pub struct NameTable {
    by_ip: HashMap<Ipv4Addr, Vec<(String, Instant)>>,
    count: usize,
}

impl NameTable {
    /// Remembers that `name` resolved to these (address, TTL) pairs.
    pub fn record(&mut self, name: &str, answers: &[(Ipv4Addr, u32)]) {
        let now = Instant::now();
        for &(ip, ttl) in answers {
            let keep = Duration::from_secs(ttl as u64).clamp(MIN_KEEP, MAX_KEEP);
            let entry = self.by_ip.entry(ip).or_default();
            match entry.iter_mut().find(|(n, _)| n == name) {
                Some((_, until)) => *until = (*until).max(now + keep),
                None => {
                    entry.push((name.to_string(), now + keep));
                    self.count += 1;
                }
            }
        }
        if self.count > MAX_ENTRIES {
            self.prune(now);
        }
    }

    /// Whether `name` resolved to `ip` (and the answer has not expired).
    pub fn has(&self, ip: Ipv4Addr, name: &str) -> bool {
        let now = Instant::now();
        self.by_ip.get(&ip).is_some_and(|v| {
            v.iter()
                .any(|(n, until)| *until > now && n.eq_ignore_ascii_case(name))
        })
    }

    /// Names `ip` was handed out for (unexpired), newest last.
    pub fn names_of(&self, ip: Ipv4Addr) -> Vec<String> {
        let now = Instant::now();
        self.by_ip
            .get(&ip)
            .map(|v| {
                v.iter()
                    .filter(|(_, until)| *until > now)
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Drops expired pairs, then (if still too many) the ones expiring soonest.
    fn prune(&mut self, now: Instant) {
        for v in self.by_ip.values_mut() {
            v.retain(|(_, until)| *until > now);
        }
        self.by_ip.retain(|_, v| !v.is_empty());
        self.count = self.by_ip.values().map(Vec::len).sum();
        if self.count > MAX_ENTRIES {
            let mut all: Vec<Instant> = self
                .by_ip
                .values()
                .flat_map(|v| v.iter().map(|(_, t)| *t))
                .collect();
            all.sort_unstable();
            let cutoff = all[self.count - MAX_ENTRIES * 3 / 4];
            for v in self.by_ip.values_mut() {
                v.retain(|(_, until)| *until > cutoff);
            }
            self.by_ip.retain(|_, v| !v.is_empty());
            self.count = self.by_ip.values().map(Vec::len).sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_and_bounds() {
        let mut t = NameTable::default();
        let ip: Ipv4Addr = "1.2.3.4".parse().unwrap();
        t.record("a.test", &[(ip, 1)]);
        assert!(t.has(ip, "A.test") && !t.has(ip, "b.test"));
        assert!(!t.has("1.2.3.5".parse().unwrap(), "a.test"));
        assert_eq!(t.names_of(ip), vec!["a.test".to_string()]);
        for i in 0..(MAX_ENTRIES as u32 + 10) {
            t.record(&format!("n{i}.test"), &[(Ipv4Addr::from(i), 60)]);
        }
        assert!(t.count <= MAX_ENTRIES);
    }
}
