//! Sandbox networking: a veth pair with a private address and NAT for sandboxes with
//! internet access, nftables egress rules, and TCP connections into a sandbox's
//! network namespace.
//!
//! Layout:
//! - `egress_rules.nft`: THE egress policy (what a sandbox may reach), one readable file.
//! - `netlink.rs`: a minimal rtnetlink client (veth, addresses, routes) — no `ip` spawns.
//! - `netns.rs`: namespace handles, `run_in_netns`, `connect_in_netns`.
//!
//! Addressing is deterministic from the sandbox's *slot* (a small integer the node
//! allocates): slot `s` owns the `/31` at `pool + 2*s`; the host side `<prefix><s>`
//! (e.g. `cbs17`) has the even address and is the sandbox's gateway, the sandbox's `eth0`
//! has the odd one. Reconciliation can therefore map every `cbs*` link and policy
//! element back to a slot without any saved state.
//!
//! Creating a sandbox with internet access changes no nftables state: the rules match
//! every sandbox by interface-name wildcard. Only sandboxes with an E2B network policy
//! (`allowOut`/`denyOut`, or internet off with an allow list) get an entry in the
//! policy map, via [`Network::set_policy`]. Sandboxes without internet and without an
//! allow list get no veth at all: call nothing here, they only have loopback.
//!
//! Host prerequisites changed by [`Network::init`]: `net.ipv4.ip_forward=1` (like any
//! container runtime) and the two nftables tables. If the host runs another firewall
//! whose forward chain drops by default, sandbox egress needs an accept there too.

mod netlink;
mod netns;

#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::fmt;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::ops::Range;
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::Mutex;

pub use netns::{
    Netns, connect_addr_in_netns, connect_in_netns, connect_in_netns_async, loopback_up,
    run_in_netns, tcp_socket_in_netns,
};

use netlink::RouteSocket;

use crate::error::{Error, Result};

/// The default egress rules, with placeholders (see the file's header).
const EGRESS_RULES: &str = include_str!("egress_rules.nft");
/// The line splitting `EGRESS_RULES` into the static part (re-created by every `init`)
/// and the policy table (created once, kept across restarts).
const POLICY_MARKER: &str = "# ---- per-sandbox policy table";

/// Name of the sandbox side of the veth pair.
pub const SANDBOX_IFNAME: &str = "eth0";

/// An IPv4 network, `a.b.c.d/len` (host bits cleared).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    prefix_len: u8,
}

impl Ipv4Cidr {
    /// `addr/prefix_len`, with the host bits of `addr` cleared.
    pub fn new(addr: Ipv4Addr, prefix_len: u8) -> Result<Self> {
        if prefix_len > 32 {
            return Err(Error::InvalidCidr(format!("{addr}/{prefix_len}")));
        }
        let mask = if prefix_len == 0 {
            0
        } else {
            u32::MAX << (32 - prefix_len)
        };
        Ok(Ipv4Cidr {
            addr: Ipv4Addr::from(u32::from(addr) & mask),
            prefix_len,
        })
    }
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }
    /// Number of addresses (saturating at u32::MAX for /0).
    pub fn size(&self) -> u32 {
        1u64.checked_shl(32 - self.prefix_len as u32)
            .map_or(u32::MAX, |n| n.min(u32::MAX as u64) as u32)
    }
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        Ipv4Cidr::new(ip, self.prefix_len)
            .map(|c| c.addr == self.addr)
            .unwrap_or(false)
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || Error::InvalidCidr(s.to_string());
        let (ip, len) = match s.trim().split_once('/') {
            Some((ip, len)) => (ip, len.parse::<u8>().map_err(|_| bad())?),
            None => (s.trim(), 32),
        };
        let ip: Ipv4Addr = ip.parse().map_err(|_| bad())?;
        Ipv4Cidr::new(ip, len).map_err(|_| bad())
    }
}

/// Node-wide network configuration.
#[derive(Debug, Clone)]
pub struct NetworkConfig {
    /// nftables table name; the policy table is `<table>_policy`.
    pub table: String,
    /// Host-side veth prefix (≤ 7 chars so `<prefix><slot>` fits IFNAMSIZ). Every
    /// interface whose name starts with it is treated as a sandbox's: keep it unique
    /// on the host (avoid plain "cb": Kubernetes uses "cbr0").
    pub ifname_prefix: String,
    /// Sandbox address pool; each slot takes a /31.
    pub pool: Ipv4Cidr,
    /// Private ranges sandboxes may not reach (besides the always-denied ones).
    pub deny_private: Vec<Ipv4Cidr>,
    /// Operator exceptions: reachable by every sandbox even if in a denied range.
    pub node_allow: Vec<Ipv4Cidr>,
    /// DNS resolvers sandboxes may query (port 53 only), even in a denied range. The
    /// sandbox's /etc/resolv.conf should list these. Default: the IPv4 nameservers of
    /// the host's /etc/resolv.conf, except loopback ones (a host-local resolver such as
    /// 127.0.0.53 is unreachable from a sandbox; configure a real one).
    pub dns_resolvers: Vec<Ipv4Addr>,
    /// MTU for both veth ends (None: kernel default 1500).
    pub mtu: Option<u32>,
}

/// IPv4, non-loopback `nameserver` lines of a resolv.conf text.
pub fn parse_resolv_conf(text: &str) -> Vec<Ipv4Addr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next()).flatten()
        })
        .filter_map(|a| a.parse::<Ipv4Addr>().ok())
        .filter(|a| !a.is_loopback() && !a.is_unspecified())
        .collect()
}

impl Default for NetworkConfig {
    fn default() -> Self {
        let c = |s: &str| {
            s.parse::<Ipv4Cidr>().unwrap_or(Ipv4Cidr {
                addr: Ipv4Addr::UNSPECIFIED,
                prefix_len: 32,
            })
        };
        NetworkConfig {
            table: "cubicle".into(),
            ifname_prefix: "cbs".into(),
            pool: c("10.200.0.0/16"),
            deny_private: vec![
                c("10.0.0.0/8"),
                c("172.16.0.0/12"),
                c("192.168.0.0/16"),
                c("100.64.0.0/10"), // carrier-grade NAT, also used by some cloud internals
                c("198.18.0.0/15"), // benchmarking
            ],
            node_allow: Vec::new(),
            dns_resolvers: std::fs::read_to_string("/etc/resolv.conf")
                .map(|t| parse_resolv_conf(&t))
                .unwrap_or_default(),
            mtu: None,
        }
    }
}

/// What [`Network::attach`] set up for one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetInfo {
    pub slot: u32,
    /// Host side of the veth pair, e.g. `cbs17`.
    pub host_ifname: String,
    /// The sandbox's `eth0` address (prefix length 31).
    pub sandbox_ip: Ipv4Addr,
    /// The host side's address: the sandbox's default gateway.
    pub gateway: Ipv4Addr,
}

/// A per-sandbox egress policy (E2B `network.allowOut` / `network.denyOut` /
/// `allow_internet_access`). Destinations are IPv4 addresses or CIDRs; domain names are
/// not supported here. `allow_out` wins over `deny_out`. Neither can reach what the node
/// always denies (host, other sandboxes, link-local, private ranges).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressPolicy {
    pub allow_internet: bool,
    pub allow_out: Vec<Ipv4Cidr>,
    pub deny_out: Vec<Ipv4Cidr>,
}

impl Default for EgressPolicy {
    fn default() -> Self {
        EgressPolicy {
            allow_internet: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
        }
    }
}

impl EgressPolicy {
    /// True when the sandbox needs a veth at all (internet on, or an allow list).
    pub fn needs_veth(&self) -> bool {
        self.allow_internet || !self.allow_out.is_empty()
    }
    /// True when the policy equals the node default (no policy-map entry needed).
    pub fn is_default(&self) -> bool {
        self.allow_internet && self.allow_out.is_empty() && self.deny_out.is_empty()
    }
}

/// The node's sandbox network. Cheap to share (`&self` methods, internally locked).
pub struct Network {
    config: NetworkConfig,
    max_slots: u32,
    /// Slots that currently have a policy-map entry (so detach knows to remove it).
    with_policy: Mutex<HashSet<u32>>,
}

impl Network {
    /// Prepares the host once per node start (idempotent): enables IPv4 forwarding and
    /// (re)creates the egress rules table; creates the policy table if it is missing
    /// (existing per-sandbox policies are kept; call [`Network::reconcile`] next).
    pub fn init(config: NetworkConfig) -> Result<Self> {
        let net = Self::new(config)?;
        enable_ip_forwarding()?;
        let (static_part, policy_part) = net.render_rules()?;
        let table = &net.config.table;
        let mut script =
            format!("table inet {table} {{}}\ndelete table inet {table}\n{static_part}\n");
        if !nft_table_exists(&format!("{table}_policy"))? {
            script.push_str(&policy_part);
        }
        nft_apply(&script, "loading the egress rules")?;
        net.load_policy_slots()?;
        Ok(net)
    }

    /// A handle without touching the host (for reconciliation tools and unit tests).
    pub fn new(config: NetworkConfig) -> Result<Self> {
        let p = &config.ifname_prefix;
        if p.is_empty() || p.len() > 7 || !p.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(Error::NetworkConfig(format!(
                "ifname_prefix {p:?} must be 1-7 ASCII letters/digits"
            )));
        }
        let t = &config.table;
        if t.is_empty()
            || t.len() > 32
            || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(Error::NetworkConfig(format!(
                "table {t:?} must be 1-32 of [A-Za-z0-9_]"
            )));
        }
        if config.pool.prefix_len() > 30 {
            return Err(Error::NetworkConfig(format!(
                "pool {} too small",
                config.pool
            )));
        }
        // Interface names are <prefix><slot> and must fit IFNAMSIZ-1 = 15 bytes.
        let digits_left = 15 - p.len() as u32;
        let name_limit = 10u64
            .saturating_pow(digits_left.min(9))
            .min(u32::MAX as u64) as u32;
        let max_slots = (config.pool.size() / 2).min(name_limit);
        Ok(Network {
            config,
            max_slots,
            with_policy: Mutex::new(HashSet::new()),
        })
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    /// How many slots the pool holds.
    pub fn max_slots(&self) -> u32 {
        self.max_slots
    }

    /// The addresses and interface name slot `slot` uses (pure computation).
    pub fn slot_info(&self, slot: u32) -> Result<NetInfo> {
        if slot >= self.max_slots {
            return Err(Error::SlotOutOfRange {
                slot,
                pool: self.config.pool,
                max: self.max_slots,
            });
        }
        let base = u32::from(self.config.pool.addr()) + 2 * slot;
        Ok(NetInfo {
            slot,
            host_ifname: format!("{}{}", self.config.ifname_prefix, slot),
            gateway: Ipv4Addr::from(base),
            sandbox_ip: Ipv4Addr::from(base + 1),
        })
    }

    fn slot_of_ifname(&self, name: &str) -> Option<u32> {
        let digits = name.strip_prefix(&self.config.ifname_prefix)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    }

    fn slot_of_ip(&self, ip: Ipv4Addr) -> Option<u32> {
        if !self.config.pool.contains(ip) {
            return None;
        }
        Some((u32::from(ip) - u32::from(self.config.pool.addr())) / 2)
    }

    /// Gives the sandbox whose network namespace is `netns` its veth pair, address and
    /// default route, for `slot`. A stale pair left on that slot (crash) is replaced.
    pub fn attach(&self, netns: &Netns, slot: u32) -> Result<NetInfo> {
        let info = self.slot_info(slot)?;
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        let create = |host: &mut RouteSocket| {
            host.create_veth(&info.host_ifname, SANDBOX_IFNAME, netns, self.config.mtu)
        };
        match create(&mut host) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                // Leftover host side for this slot (or eth0 already in the sandbox).
                let _ = host.delete_link(&info.host_ifname);
                create(&mut host).map_err(|e| {
                    Error::io(
                        format!(
                            "creating veth {} (after removing a stale one)",
                            info.host_ifname
                        ),
                        e,
                    )
                })?;
            }
            Err(e) => {
                return Err(Error::io(format!("creating veth {}", info.host_ifname), e));
            }
        }
        let result = self.configure(&mut host, netns, &info);
        if result.is_err() {
            let _ = host.delete_link(&info.host_ifname);
        }
        result.map(|()| info)
    }

    fn configure(&self, host: &mut RouteSocket, netns: &Netns, info: &NetInfo) -> Result<()> {
        let host_index = host
            .link_index(&info.host_ifname)
            .map_err(|e| Error::io(format!("looking up {}", info.host_ifname), e))?
            .ok_or_else(|| {
                Error::io(
                    format!("looking up {}", info.host_ifname),
                    io::Error::from_raw_os_error(libc::ENODEV),
                )
            })?;
        // IPv6 off on the host side before it goes up. Sandboxes have no IPv6, and every
        // IPv6-enabled interface adds ff00::/8 and fe80::/64 routes to the host's tables,
        // all at the same prefix: with thousands of sandboxes each create and delete then
        // walks thousands of routes (a fifth of the CPU of a create at 3,000 sandboxes,
        // in `perf`: __find_rr_leaf, fib6_walk_continue, fib6_ifdown).
        disable_ipv6(&info.host_ifname)?;
        host.set_up(host_index)
            .map_err(|e| Error::io(format!("setting {} up", info.host_ifname), e))?;
        host.add_address(host_index, info.gateway, 31)
            .map_err(|e| {
                Error::io(
                    format!("adding {}/31 to {}", info.gateway, info.host_ifname),
                    e,
                )
            })?;

        let mut inside = netns::route_socket_in(netns)?;
        let index = inside
            .link_index(SANDBOX_IFNAME)
            .map_err(|e| Error::io("looking up eth0 in sandbox", e))?
            .ok_or_else(|| {
                Error::io(
                    "looking up eth0 in sandbox",
                    io::Error::from_raw_os_error(libc::ENODEV),
                )
            })?;
        inside
            .set_up(index)
            .map_err(|e| Error::io("setting sandbox eth0 up", e))?;
        inside
            .add_address(index, info.sandbox_ip, 31)
            .map_err(|e| Error::io(format!("adding {}/31 to sandbox eth0", info.sandbox_ip), e))?;
        inside.add_default_route(index, info.gateway).map_err(|e| {
            Error::io(
                format!("adding default route via {} in sandbox", info.gateway),
                e,
            )
        })?;
        Ok(())
    }

    /// Removes slot `slot`'s veth pair and policy (idempotent: missing pieces are fine).
    pub fn detach(&self, slot: u32) -> Result<()> {
        let info = self.slot_info(slot)?;
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        match host.delete_link(&info.host_ifname) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
            Err(e) => {
                return Err(Error::io(format!("deleting {}", info.host_ifname), e));
            }
        }
        let had_policy = self.lock_policy().contains(&slot);
        if had_policy {
            self.remove_policies(&[slot])?;
        }
        Ok(())
    }

    /// Sets (or, for the default policy, clears) slot `slot`'s egress policy. Costs one
    /// `nft` run; sandboxes with the default policy never need it.
    pub fn set_policy(&self, slot: u32, policy: &EgressPolicy) -> Result<()> {
        let info = self.slot_info(slot)?;
        if policy.is_default() {
            if self.lock_policy().contains(&slot) {
                self.remove_policies(&[slot])?;
            }
            return Ok(());
        }
        let t = format!("{}_policy", self.config.table);
        let chain = format!("sb_{slot}");
        let mut s = String::new();
        s.push_str(&format!(
            "add chain inet {t} {chain}\nflush chain inet {t} {chain}\n"
        ));
        let list = |v: &[Ipv4Cidr]| {
            v.iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !policy.allow_out.is_empty() {
            s.push_str(&format!(
                "add rule inet {t} {chain} ip daddr {{ {} }} accept\n",
                list(&policy.allow_out)
            ));
        }
        if !policy.deny_out.is_empty() {
            s.push_str(&format!(
                "add rule inet {t} {chain} ip daddr {{ {} }} goto deny\n",
                list(&policy.deny_out)
            ));
        }
        if !policy.allow_internet {
            s.push_str(&format!("add rule inet {t} {chain} goto deny\n"));
        }
        let had = self.lock_policy().contains(&slot);
        if !had {
            s.push_str(&format!(
                "add element inet {t} sandbox_policy {{ {} : jump {chain} }}\n",
                info.sandbox_ip
            ));
        }
        nft_apply(&s, &format!("setting the egress policy of slot {slot}"))?;
        self.lock_policy().insert(slot);
        Ok(())
    }

    /// After a crash: deletes every sandbox veth and policy of the slots in `owned` (the
    /// calling node's range; other nodes on the host own the others) that are not in
    /// `known`.
    pub fn reconcile(&self, owned: Range<u32>, known: &[u32]) -> Result<()> {
        let known: HashSet<u32> = known.iter().copied().collect();
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        for link in self.sandbox_links(&mut host)? {
            let Some(slot) = self.slot_of_ifname(&link.name) else {
                // A veth with our prefix but no slot number: not any node's; leave it.
                continue;
            };
            if owned.contains(&slot) && !known.contains(&slot) {
                match host.delete_link(&link.name) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                    Err(e) => return Err(Error::io(format!("deleting {}", link.name), e)),
                }
            }
        }
        self.load_policy_slots()?;
        let stale: Vec<u32> = self
            .lock_policy()
            .iter()
            .copied()
            .filter(|s| owned.contains(s) && !known.contains(s))
            .collect();
        if !stale.is_empty() {
            self.remove_policies(&stale)?;
        }
        Ok(())
    }

    /// Removes everything this network created on the host: all `<prefix>*` links and
    /// both nftables tables. For tests and `cubicle` uninstall; not used in normal runs.
    pub fn teardown_all(&self) -> Result<()> {
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        for link in self.sandbox_links(&mut host)? {
            match host.delete_link(&link.name) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                Err(e) => return Err(Error::io(format!("deleting {}", link.name), e)),
            }
        }
        let t = &self.config.table;
        let script = format!(
            "table inet {t} {{}}\ndelete table inet {t}\ntable inet {t}_policy {{}}\ndelete table inet {t}_policy\n"
        );
        nft_apply(&script, "deleting the egress tables")?;
        self.lock_policy().clear();
        Ok(())
    }

    /// Host links that belong to sandboxes (name `<prefix><digits>`, or any veth with
    /// the prefix).
    fn sandbox_links(&self, host: &mut RouteSocket) -> Result<Vec<netlink::Link>> {
        let links = host.links().map_err(|e| Error::io("listing links", e))?;
        Ok(links
            .into_iter()
            .filter(|l| {
                self.slot_of_ifname(&l.name).is_some()
                    || (l.name.starts_with(&self.config.ifname_prefix)
                        && l.kind.as_deref() == Some("veth"))
            })
            .collect())
    }

    fn lock_policy(&self) -> std::sync::MutexGuard<'_, HashSet<u32>> {
        self.with_policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads which slots have a policy chain or map element from the kernel.
    fn load_policy_slots(&self) -> Result<()> {
        let t = format!("{}_policy", self.config.table);
        let mut slots = HashSet::new();
        if nft_table_exists(&t)? {
            let v = nft_json(&["list", "table", "inet", &t])?;
            for item in v["nftables"].as_array().into_iter().flatten() {
                if let Some(name) = item["chain"]["name"].as_str()
                    && let Some(slot) = name.strip_prefix("sb_").and_then(|d| d.parse::<u32>().ok())
                {
                    slots.insert(slot);
                }
                if item["map"]["name"].as_str() == Some("sandbox_policy") {
                    for elem in item["map"]["elem"].as_array().into_iter().flatten() {
                        if let Some(ip) = elem[0].as_str().and_then(|s| s.parse::<Ipv4Addr>().ok())
                            && let Some(slot) = self.slot_of_ip(ip)
                        {
                            slots.insert(slot);
                        }
                    }
                }
            }
        }
        *self.lock_policy() = slots;
        Ok(())
    }

    /// Deletes the map elements and chains of `slots`, tolerating missing pieces.
    fn remove_policies(&self, slots: &[u32]) -> Result<()> {
        let t = format!("{}_policy", self.config.table);
        let v = nft_json(&["list", "table", "inet", &t])?;
        let mut chains = HashSet::new();
        let mut elems = HashSet::new();
        for item in v["nftables"].as_array().into_iter().flatten() {
            if let Some(name) = item["chain"]["name"].as_str() {
                chains.insert(name.to_string());
            }
            if item["map"]["name"].as_str() == Some("sandbox_policy") {
                for elem in item["map"]["elem"].as_array().into_iter().flatten() {
                    if let Some(ip) = elem[0].as_str() {
                        elems.insert(ip.to_string());
                    }
                }
            }
        }
        let mut s = String::new();
        for &slot in slots {
            let info = self.slot_info(slot)?;
            let ip = info.sandbox_ip.to_string();
            if elems.contains(&ip) {
                s.push_str(&format!(
                    "delete element inet {t} sandbox_policy {{ {ip} }}\n"
                ));
            }
            let chain = format!("sb_{slot}");
            if chains.contains(&chain) {
                s.push_str(&format!(
                    "flush chain inet {t} {chain}\ndelete chain inet {t} {chain}\n"
                ));
            }
        }
        if !s.is_empty() {
            nft_apply(&s, "removing sandbox egress policies")?;
        }
        let mut set = self.lock_policy();
        for slot in slots {
            set.remove(slot);
        }
        Ok(())
    }

    /// Fills the placeholders of `egress_rules.nft`; returns (static part, policy table).
    fn render_rules(&self) -> Result<(String, String)> {
        let elements = |v: &[Ipv4Cidr]| {
            if v.is_empty() {
                String::new()
            } else {
                format!(
                    "elements = {{ {} }}",
                    v.iter()
                        .map(|c| c.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        };
        let dns: Vec<Ipv4Cidr> = self
            .config
            .dns_resolvers
            .iter()
            .filter_map(|a| Ipv4Cidr::new(*a, 32).ok())
            .collect();
        let text = EGRESS_RULES
            .replace("@TABLE@", &self.config.table)
            .replace("@IFPREFIX@", &self.config.ifname_prefix)
            .replace("@POOL@", &self.config.pool.to_string())
            .replace("@PRIVATE@", &elements(&self.config.deny_private))
            .replace("@NODE_ALLOW@", &elements(&self.config.node_allow))
            .replace("@DNS@", &elements(&dns));
        let pos = text.find(POLICY_MARKER).ok_or_else(|| {
            Error::NetworkConfig("egress_rules.nft lacks the policy marker".into())
        })?;
        Ok((text[..pos].to_string(), text[pos..].to_string()))
    }
}

fn enable_ip_forwarding() -> Result<()> {
    let path = "/proc/sys/net/ipv4/ip_forward";
    let cur = std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {path}"), e))?;
    if cur.trim() != "1" {
        std::fs::write(path, "1")
            .map_err(|e| Error::io(format!("writing {path} (are you root?)"), e))?;
    }
    Ok(())
}

fn nft_binary() -> &'static str {
    if std::path::Path::new("/usr/sbin/nft").exists() {
        "/usr/sbin/nft"
    } else {
        "nft"
    }
}

/// Runs `nft -f -` with `script` (one atomic transaction).
pub(crate) fn nft_apply(script: &str, context: &str) -> Result<()> {
    let mut child = Command::new(nft_binary())
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io("running nft (is the nftables package installed?)", e))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| Error::io("writing to nft", e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io("waiting for nft", e))?;
    if !out.status.success() {
        return Err(Error::Nft {
            context: context.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn nft_json(args: &[&str]) -> Result<serde_json::Value> {
    let out = Command::new(nft_binary())
        .arg("-j")
        .args(args)
        .output()
        .map_err(|e| Error::io("running nft (is the nftables package installed?)", e))?;
    if !out.status.success() {
        return Err(Error::Nft {
            context: format!("nft -j {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        Error::io(
            "parsing nft JSON",
            io::Error::new(io::ErrorKind::InvalidData, e),
        )
    })
}

fn nft_table_exists(name: &str) -> Result<bool> {
    let v = nft_json(&["list", "tables", "inet"])?;
    Ok(v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|item| item["table"]["name"].as_str() == Some(name)))
}

/// Whether the nftables table `inet <name>` exists (for tests and leak checks).
pub fn table_exists(name: &str) -> Result<bool> {
    nft_table_exists(name)
}

/// Turns IPv6 off on host interface `ifname` (`net.ipv6.conf.<ifname>.disable_ipv6`), in
/// the network namespace of the calling thread. A host without IPv6 has nothing to turn
/// off.
fn disable_ipv6(ifname: &str) -> Result<()> {
    let path = format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6");
    match std::fs::write(&path, "1") {
        Ok(()) => Ok(()),
        Err(e)
            if e.kind() == io::ErrorKind::NotFound
                && !std::path::Path::new("/proc/sys/net/ipv6").exists() =>
        {
            Ok(())
        }
        Err(e) => Err(Error::io(format!("writing {path}"), e)),
    }
}
