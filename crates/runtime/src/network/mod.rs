//! Sandbox networking: a veth pair with a private address and NAT for sandboxes with
//! internet access, nftables egress rules and per-sandbox policy sets, conntrack cleanup,
//! and TCP connections into a sandbox's network namespace.
//!
//! Layout:
//! - `egress_rules.nft`: THE kernel-side egress policy (what a sandbox may reach), one
//!   readable file; the node's DNS resolver and proxy (crate `cubicle-egress`) do the rest.
//! - `netlink.rs`: the netlink message code every protocol here shares, and a minimal
//!   rtnetlink client (veth, addresses, routes) — no `ip` spawns.
//! - `nftables.rs`: policy set elements over netlink (no `nft` spawn per policy change).
//! - `conntrack.rs`: forgetting a dead sandbox's connections.
//! - `events.rs`: conntrack and NFLOG events about sandbox connections (audit trail).
//! - `netns.rs`: namespace handles, `run_in_netns`, `connect_in_netns`.
//!
//! Addressing is deterministic from the sandbox's *slot* (a small integer the node
//! allocates): slot `s` owns the `/31` at `pool + 2*s`; the host side `<prefix><s>`
//! (e.g. `cbs17`) has the even address and is the sandbox's gateway, the sandbox's `eth0`
//! has the odd one. The MAC addresses derive from the slot too, and each side has a
//! permanent neighbour entry for the other: the host side runs without ARP (`NOARP`), so
//! nothing a sandbox sends at layer 2 reaches the host's neighbour table (and a sandbox
//! has no CAP_NET_RAW to forge frames in the first place). Reconciliation can therefore map every `cbs*` link and policy
//! element back to a slot without any saved state.
//!
//! Creating a sandbox with internet access changes no nftables state: the rules match
//! every sandbox by interface-name wildcard. Only sandboxes with an E2B network policy
//! get elements in the policy sets, via [`Network::set_policy`] (one netlink batch).
//! Sandboxes without internet and without an allow list get no veth at all: call nothing
//! here, they only have loopback.
//!
//! Host prerequisites changed by [`Network::init`]: `net.ipv4.ip_forward=1` (like any
//! container runtime) and the two nftables tables. If the host runs another firewall
//! whose forward chain drops by default, sandbox egress needs an accept there too.

mod conntrack;
pub mod events;
mod link_reaper;
mod netlink;
mod netns;
mod nftables;
mod sock_diag;

#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::Mutex;

pub use netns::{
    Netns, connect_addr_in_netns, connect_in_netns, connect_in_netns_async, loopback_up,
    run_in_netns, tcp_socket_in_netns,
};

use netlink::RouteSocket;
use nftables::{ElemChange, SetElem};

use crate::error::{Error, Result};

/// The egress rules, with placeholders (see the file's header).
const EGRESS_RULES: &str = include_str!("egress_rules.nft");
/// The lines splitting `EGRESS_RULES` into the main table, the policy table and the
/// per-node redirect table.
const POLICY_MARKER: &str = "# ---- per-sandbox policy table";
const NODE_MARKER: &str = "# ---- per-node redirect table";
/// The policy table's sets, in the order they are carried over and applied.
const POLICY_SETS: [&str; 5] = ["allow", "deny", "deny_all", "steer", "steer_all"];

/// Name of the sandbox side of the veth pair.
pub const SANDBOX_IFNAME: &str = "eth0";

/// An IPv4 network, `a.b.c.d/len` (host bits cleared).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
        Ok(Ipv4Cidr {
            addr: Ipv4Addr::from(u32::from(addr) & Self::mask(prefix_len)),
            prefix_len,
        })
    }
    fn mask(prefix_len: u8) -> u32 {
        if prefix_len == 0 {
            0
        } else {
            u32::MAX << (32 - prefix_len.min(32))
        }
    }
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }
    /// The last address of the network.
    pub fn last(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) | !Self::mask(self.prefix_len))
    }
    /// Number of addresses (saturating at u32::MAX for /0).
    pub fn size(&self) -> u32 {
        1u64.checked_shl(32 - self.prefix_len as u32)
            .map_or(u32::MAX, |n| n.min(u32::MAX as u64) as u32)
    }
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask(self.prefix_len) == u32::from(self.addr)
    }
    /// True for `0.0.0.0/0` (E2B's "all traffic").
    pub fn is_everything(&self) -> bool {
        self.prefix_len == 0
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

/// `cidrs` as sorted, merged, non-overlapping inclusive ranges (interval sets refuse
/// overlapping elements).
pub fn merged_ranges(cidrs: &[Ipv4Cidr]) -> Vec<(Ipv4Addr, Ipv4Addr)> {
    let mut r: Vec<(u32, u32)> = cidrs
        .iter()
        .map(|c| (u32::from(c.addr()), u32::from(c.last())))
        .collect();
    r.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(r.len());
    for (a, b) in r {
        match out.last_mut() {
            Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out.into_iter()
        .map(|(a, b)| (Ipv4Addr::from(a), Ipv4Addr::from(b)))
        .collect()
}

/// Per-sandbox limits on what a sandbox sends, the same for every sandbox of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxLimits {
    /// Connections (conntrack entries, any protocol) a sandbox may have open at once.
    pub max_connections: u32,
    /// New connections per second (sustained), and the burst allowed above it.
    pub new_connections_per_sec: u32,
    pub new_connections_burst: u32,
    /// Outbound bytes per second (packets above it are dropped), and the burst. The
    /// kernel's token bucket holds one second at the rate plus the burst, so a sandbox
    /// can send that much at once before it is held to the rate.
    pub bytes_per_sec: u64,
    pub bytes_burst: u64,
}

impl Default for SandboxLimits {
    /// 4096 connections, 200 new per second (burst 400), 125 MB/s (1 Gbit/s) outbound
    /// (plus 64 KiB of burst): far above what a package install or an API client needs,
    /// low enough that one sandbox cannot fill the host's conntrack table or uplink.
    fn default() -> Self {
        SandboxLimits {
            max_connections: 4096,
            new_connections_per_sec: 200,
            new_connections_burst: 400,
            bytes_per_sec: 125_000_000,
            bytes_burst: 64 << 10,
        }
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
    /// Cloud control and metadata addresses outside link-local, always denied.
    pub deny_control: Vec<Ipv4Cidr>,
    /// Deny the subnets of the host's own interfaces (read at [`Network::init`]).
    pub deny_host_subnets: bool,
    /// Operator exceptions: reachable by every sandbox even if in a denied range.
    pub node_allow: Vec<Ipv4Cidr>,
    /// Let sandboxes open outbound SMTP (TCP port 25) connections.
    pub allow_smtp: bool,
    /// Per-sandbox limits.
    pub limits: SandboxLimits,
    /// NFLOG group refused attempts are reported to (one node per group and namespace).
    pub log_group: u16,
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

fn cidr(s: &str) -> Ipv4Cidr {
    s.parse::<Ipv4Cidr>().unwrap_or(Ipv4Cidr {
        addr: Ipv4Addr::UNSPECIFIED,
        prefix_len: 32,
    })
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            table: "cubicle".into(),
            ifname_prefix: "cbs".into(),
            pool: cidr("10.200.0.0/16"),
            deny_private: vec![
                cidr("10.0.0.0/8"),
                cidr("172.16.0.0/12"),
                cidr("192.168.0.0/16"),
                cidr("100.64.0.0/10"), // carrier-grade NAT, also used by some cloud internals
                cidr("198.18.0.0/15"), // benchmarking
            ],
            deny_control: vec![
                cidr("168.63.129.16/32"),   // Azure wireserver (DHCP, DNS, health, agent)
                cidr("192.0.0.192/32"),     // Oracle Cloud metadata
                cidr("100.100.100.200/32"), // Alibaba Cloud metadata
            ],
            deny_host_subnets: true,
            node_allow: Vec::new(),
            allow_smtp: false,
            limits: SandboxLimits::default(),
            log_group: 7707,
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

/// Where a sandbox's TCP connections go before any address rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Steer {
    /// Straight out, decided by the address rules alone.
    #[default]
    Direct,
    /// To the node's proxy, unless the destination is in the allow list.
    UnlessAllowed,
    /// Every connection to the node's proxy (an egress proxy tunnels them all).
    All,
}

/// The kernel's share of a sandbox's egress policy: address rules and where its TCP
/// goes. Neither list can reach what the node always denies (host, other sandboxes,
/// link-local, private ranges). `allow` wins over `deny`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EgressPolicy {
    /// Destinations always allowed (E2B `allowOut` addresses).
    pub allow: Vec<Ipv4Cidr>,
    /// Destinations denied (E2B `denyOut`, other than 0.0.0.0/0).
    pub deny: Vec<Ipv4Cidr>,
    /// Everything not allowed is denied (E2B `denyOut` with 0.0.0.0/0, internet off).
    pub deny_all: bool,
    /// Where TCP goes first.
    pub steer: Steer,
}

impl EgressPolicy {
    /// True when the policy equals the node default (no policy elements needed).
    pub fn is_default(&self) -> bool {
        self.allow.is_empty()
            && self.deny.is_empty()
            && !self.deny_all
            && self.steer == Steer::Direct
    }

    /// Whether the policy refuses some destination by address.
    pub fn refuses_any(&self) -> bool {
        self.deny_all || !self.deny.is_empty()
    }

    /// Whether the policy's own rules refuse a new connection to `dst` (the node's
    /// rules apply besides; domain rules are the proxy's).
    pub fn refuses(&self, dst: Ipv4Addr) -> bool {
        !self.allow.iter().any(|c| c.contains(dst))
            && (self.deny_all || self.deny.iter().any(|c| c.contains(dst)))
    }

    /// The policy-set elements of sandbox `ip` under this policy.
    fn elements(&self, ip: Ipv4Addr) -> BTreeSet<(&'static str, SetElem)> {
        let mut out = BTreeSet::new();
        let me = ip.octets();
        let pair = |a: Ipv4Addr, b: Ipv4Addr| SetElem {
            key: [me, a.octets()].concat(),
            key_end: Some([me, b.octets()].concat()),
        };
        let single = || SetElem {
            key: me.to_vec(),
            key_end: None,
        };
        let deny: Vec<Ipv4Cidr> = self
            .deny
            .iter()
            .filter(|c| !c.is_everything())
            .copied()
            .collect();
        for (a, b) in merged_ranges(&self.allow) {
            out.insert(("allow", pair(a, b)));
        }
        for (a, b) in merged_ranges(&deny) {
            out.insert(("deny", pair(a, b)));
        }
        if self.deny_all || self.deny.iter().any(Ipv4Cidr::is_everything) {
            out.insert(("deny_all", single()));
        }
        match self.steer {
            Steer::Direct => {}
            Steer::UnlessAllowed => {
                out.insert(("steer", single()));
            }
            Steer::All => {
                out.insert(("steer_all", single()));
            }
        }
        out
    }
}

/// Why the node denies a destination whatever the sandbox's policy says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeDenial {
    /// Loopback, link-local, multicast, reserved, "this network", the sandbox pool, cloud
    /// control addresses.
    Reserved,
    /// One of the host's own subnets.
    HostSubnet,
    /// A private range.
    Private,
    /// Outbound SMTP (port 25).
    Smtp,
}

impl NodeDenial {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeDenial::Reserved => "reserved, metadata or sandbox address",
            NodeDenial::HostSubnet => "the host's own subnet",
            NodeDenial::Private => "private range",
            NodeDenial::Smtp => "outbound SMTP (port 25) is closed",
        }
    }
}

/// The node-wide destination rules of `egress_rules.nft`, for code that opens
/// connections on a sandbox's behalf (the egress proxy and resolver): the same lists the
/// rules file is rendered from, so both sides always agree.
#[derive(Debug, Clone, Default)]
pub struct AddressGuard {
    node_allowed: Vec<Ipv4Cidr>,
    reserved: Vec<Ipv4Cidr>,
    host: Vec<Ipv4Cidr>,
    private: Vec<Ipv4Cidr>,
    smtp_closed: bool,
}

impl AddressGuard {
    /// Why `ip` (port `port`, for TCP; `None` otherwise) is denied to every sandbox, if it is.
    pub fn check(&self, ip: Ipv4Addr, port: Option<u16>) -> Result<(), NodeDenial> {
        if self.smtp_closed && port == Some(25) {
            return Err(NodeDenial::Smtp);
        }
        if self.node_allowed.iter().any(|c| c.contains(ip)) {
            return Ok(());
        }
        if self.reserved.iter().any(|c| c.contains(ip)) {
            return Err(NodeDenial::Reserved);
        }
        if self.host.iter().any(|c| c.contains(ip)) {
            return Err(NodeDenial::HostSubnet);
        }
        if self.private.iter().any(|c| c.contains(ip)) {
            return Err(NodeDenial::Private);
        }
        Ok(())
    }
}

/// What [`Network`] keeps of the per-sandbox policies, under one lock.
#[derive(Default)]
struct Policies {
    /// The policy-set elements each slot has in the kernel (so changes are deltas).
    applied: HashMap<u32, BTreeSet<(&'static str, SetElem)>>,
    /// The netfilter socket changes go over, opened by `init` in the node's namespace
    /// and never closed while the node runs (`nftables::apply` says why). `None` (a
    /// handle made by `new`): one socket per change.
    sock: Option<netlink::NetlinkSocket>,
}

/// What a sandbox has sent out ([`Network::never_sent`], [`Network::forget_refused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    /// It has no veth: made without internet (loopback only), or its namespace died.
    NoVeth,
    /// Its veth counted this many packets from it.
    Packets(u64),
    /// The counter could not be read.
    Unknown,
}

/// The node's sandbox network. Cheap to share (`&self` methods, internally locked).
pub struct Network {
    config: NetworkConfig,
    max_slots: u32,
    /// The host's own subnets, read by `init` (empty for a handle made by `new`).
    host_nets: Vec<Ipv4Cidr>,
    /// The kernel's share of the sandboxes' policies, and the socket changes go over.
    policies: Mutex<Policies>,
    /// Netfilter sockets of finished conntrack flushes, for the next ones (as many as
    /// ever ran at once; never closed while the node runs, for the same reason). Opened
    /// by the flushing thread: the node's threads stay in its namespace (`run_in_netns`
    /// enters others on a thread of its own).
    conntrack_socks: Mutex<Vec<netlink::NetlinkSocket>>,
    /// Deletes detached slots' veths in shared batches.
    reaper: link_reaper::LinkReaper,
}

impl Network {
    /// Prepares the host once per node start (idempotent): enables IPv4 forwarding and
    /// (re)creates both tables from the rules file, carrying the per-sandbox policy
    /// elements over in the same transaction (so no sandbox is ever without its policy;
    /// call [`Network::reconcile`] next to drop those of sandboxes that are gone).
    pub fn init(config: NetworkConfig) -> Result<Self> {
        let mut net = Self::new(config)?;
        enable_ip_forwarding()?;
        enable_conntrack_accounting();
        if net.config.deny_host_subnets {
            net.host_nets = net.read_host_subnets()?;
        }
        let (static_part, policy_part, _) = net.render_rules()?;
        let table = &net.config.table;
        let ptable = format!("{table}_policy");
        let carried = if nft_table_exists(&ptable)? {
            read_policy_elements(&ptable)
        } else {
            Vec::new()
        };
        let mut script = format!(
            "table inet {table} {{}}\ndelete table inet {table}\n{static_part}\n\
             table inet {ptable} {{}}\ndelete table inet {ptable}\n{policy_part}\n"
        );
        for (set, elem) in &carried {
            script.push_str(&format!(
                "add element inet {ptable} {set} {{ {} }}\n",
                render_elem(elem)
            ));
        }
        nft_apply(&script, "loading the egress rules")?;
        let mut applied: HashMap<u32, BTreeSet<(&'static str, SetElem)>> = HashMap::new();
        for (set, elem) in carried {
            if let Some(slot) = elem_slot(&elem).and_then(|ip| net.slot_of_ip(ip)) {
                applied.entry(slot).or_default().insert((set, elem));
            }
        }
        let sock = netlink::NetlinkSocket::open(libc::NETLINK_NETFILTER)
            .map_err(|e| Error::io("opening the netfilter socket for policy changes", e))?;
        *net.lock_policies() = Policies {
            applied,
            sock: Some(sock),
        };
        Ok(net)
    }

    /// The node-wide destination rules, for code that connects on a sandbox's behalf.
    pub fn address_guard(&self) -> AddressGuard {
        let mut reserved: Vec<Ipv4Cidr> = [
            "0.0.0.0/8",
            "127.0.0.0/8",
            "169.254.0.0/16",
            "224.0.0.0/4",
            "240.0.0.0/4",
        ]
        .iter()
        .map(|s| cidr(s))
        .collect();
        reserved.push(self.config.pool);
        reserved.extend(self.config.deny_control.iter().copied());
        AddressGuard {
            node_allowed: self.config.node_allow.clone(),
            reserved,
            host: self.host_nets.clone(),
            private: self.config.deny_private.clone(),
            smtp_closed: !self.config.allow_smtp,
        }
    }

    /// The subnets of this namespace's interfaces, except sandbox veths and loopback.
    fn read_host_subnets(&self) -> Result<Vec<Ipv4Cidr>> {
        let mut rs = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        let links = rs.links().map_err(|e| Error::io("listing links", e))?;
        let addrs = rs
            .ipv4_addresses()
            .map_err(|e| Error::io("listing addresses", e))?;
        let mut out = Vec::new();
        for a in addrs {
            let sandbox_link = links
                .iter()
                .any(|l| l.index == a.index && l.name.starts_with(&self.config.ifname_prefix));
            if sandbox_link || a.addr.is_loopback() || self.config.pool.contains(a.addr) {
                continue;
            }
            if let Ok(c) = Ipv4Cidr::new(a.addr, a.prefix_len) {
                out.push(c);
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
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
            host_nets: Vec::new(),
            policies: Mutex::new(Policies::default()),
            conntrack_socks: Mutex::new(Vec::new()),
            reaper: Default::default(),
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
        self.attach_inner(netns, slot, false)
    }

    /// [`attach`](Self::attach) for a sandbox spawned by this runtime: its init already
    /// turned IPv6 off for new interfaces of its namespace
    /// (`net.ipv6.conf.default.disable_ipv6`, through its own /proc: see `rootfs::plan`),
    /// so its `eth0` is born without it and no sysctl is written from here. Written from
    /// here, through the host's /proc, every live sandbox namespace's `net` entry hangs
    /// in one dentry hash chain that every later lookup under `/proc/sys/net` walks (13 %
    /// of all CPU at 2,000–2,800 sandboxes). Restored and adopted sandboxes take
    /// [`attach`](Self::attach).
    pub fn attach_spawned(&self, netns: &Netns, slot: u32) -> Result<NetInfo> {
        self.attach_inner(netns, slot, true)
    }

    fn attach_inner(&self, netns: &Netns, slot: u32, ipv6_off_inside: bool) -> Result<NetInfo> {
        let info = self.slot_info(slot)?;
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        let create = |host: &mut RouteSocket| {
            let (host_mac, sandbox_mac) = slot_macs(info.slot);
            host.create_veth(
                (&info.host_ifname, host_mac),
                (SANDBOX_IFNAME, sandbox_mac),
                netns,
                self.config.mtu,
            )
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
        let result = self.configure(&mut host, netns, &info, ipv6_off_inside);
        if result.is_err() {
            let _ = host.delete_link(&info.host_ifname);
        }
        result.map(|()| info)
    }

    fn configure(
        &self,
        host: &mut RouteSocket,
        netns: &Netns,
        info: &NetInfo,
        ipv6_off_inside: bool,
    ) -> Result<()> {
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
        // No ARP on the host side: the host neither answers a sandbox's ARP nor learns
        // from it, so forged ARP (gratuitous, or with any sender address) cannot fill the
        // host's neighbour table; both ends know each other through permanent entries.
        let (host_mac, sandbox_mac) = slot_macs(info.slot);
        host.set_up_with(host_index, netlink::IFF_NOARP)
            .map_err(|e| Error::io(format!("setting {} up", info.host_ifname), e))?;
        host.add_permanent_neighbour(host_index, info.sandbox_ip, sandbox_mac)
            .map_err(|e| {
                Error::io(
                    format!("neighbour {} on {}", info.sandbox_ip, info.host_ifname),
                    e,
                )
            })?;
        host.add_address(host_index, info.gateway, 31)
            .map_err(|e| {
                Error::io(
                    format!("adding {}/31 to {}", info.gateway, info.host_ifname),
                    e,
                )
            })?;

        // Inside (on the same trip into the namespace), IPv6 off on eth0 before it goes
        // up, unless the namespace's default did it: an IPv6 eth0 sends multicast
        // listener reports at once, and a sandbox that sent no packet skips the conntrack
        // walk at its end (`detach_with`). `lo` keeps `::1`.
        let mut inside = netns::run_in_netns(netns, || {
            if !ipv6_off_inside {
                disable_ipv6(SANDBOX_IFNAME)?;
            }
            RouteSocket::open().map_err(|e| Error::io("opening netlink socket in sandbox netns", e))
        })??;
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
        inside
            .add_permanent_neighbour(index, info.gateway, host_mac)
            .map_err(|e| Error::io(format!("neighbour {} in sandbox", info.gateway), e))?;
        inside.add_default_route(index, info.gateway).map_err(|e| {
            Error::io(
                format!("adding default route via {} in sandbox", info.gateway),
                e,
            )
        })?;
        Ok(())
    }

    /// Reports kernel events about sandbox connections (let through, ended, refused) to
    /// `on_event` until the returned [`events::Watch`] is dropped.
    pub fn watch_events(
        &self,
        on_event: impl Fn(events::KernelEvent) + Send + Sync + 'static,
    ) -> Result<events::Watch> {
        events::watch(self.config.pool, self.config.log_group, on_event)
    }

    /// Whether slot `slot`'s host-side interface exists.
    pub fn is_attached(&self, slot: u32) -> Result<bool> {
        let info = self.slot_info(slot)?;
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        host.link_index(&info.host_ifname)
            .map(|i| i.is_some())
            .map_err(|e| Error::io(format!("looking up {}", info.host_ifname), e))
    }

    /// Removes slot `slot`'s veth pair and policy and forgets its connections
    /// (idempotent: missing pieces are fine).
    pub fn detach(&self, slot: u32) -> Result<()> {
        self.detach_with(slot, false)
    }

    /// Whether slot `slot`'s sandbox has never sent a packet out (its veth's receive
    /// counter on the host side is 0). Final once its processes are gone while its
    /// network namespace is held (the node opens it just before the kill): when the
    /// namespace dies, the kernel removes the veth pair, counters and all, and the
    /// answer is `false`. Anything spoofing the sandbox's address elsewhere is dropped by
    /// the egress rules before conntrack keeps an entry, so a sandbox that never sent has
    /// no entry to forget.
    pub fn never_sent(&self, slot: u32) -> bool {
        self.sent(slot) == Sent::Packets(0)
    }

    /// What slot `slot`'s sandbox has sent out, by its veth's receive counter on the
    /// host side.
    fn sent(&self, slot: u32) -> Sent {
        let Ok(info) = self.slot_info(slot) else {
            return Sent::Unknown;
        };
        match RouteSocket::open().and_then(|mut host| host.link(&info.host_ifname)) {
            Ok(None) => Sent::NoVeth,
            Ok(Some(l)) => l.rx_packets.map_or(Sent::Unknown, Sent::Packets),
            Err(_) => Sent::Unknown,
        }
    }

    /// [`Network::detach`], told whether the sandbox never sent a packet (from
    /// [`Network::never_sent`], read once it was dead): then its connections are not
    /// looked for. Forgetting them walks the whole conntrack hash table (262,144 buckets
    /// on this host: 5-10 ms of CPU per sandbox, even with kernel-side filtering).
    pub fn detach_with(&self, slot: u32, never_sent: bool) -> Result<()> {
        let info = self.slot_info(slot)?;
        let mut host = RouteSocket::open().map_err(|e| Error::io("opening netlink socket", e))?;
        self.reaper
            .remove(&mut host, &info.host_ifname)
            .map_err(|e| Error::io(format!("deleting {}", info.host_ifname), e))?;
        self.set_policy(slot, &EgressPolicy::default())?;
        if !never_sent {
            self.forget_connections(slot)?;
        }
        Ok(())
    }

    /// Deletes every conntrack entry slot `slot`'s address opened (after its death, so
    /// that no stale entry matches the next sandbox on that address).
    pub fn forget_connections(&self, slot: u32) -> Result<usize> {
        self.forget_where(slot, |_, _| true).map(|f| f.entries)
    }

    /// Deletes the conntrack entries of the direct connections slot `slot`'s sandbox
    /// opened to a destination `policy` refuses by address, so that their next packet
    /// meets the policy as a new connection's would (TCP: a reset): the rules accept
    /// established connections before they look at the policy. Left alone: connections
    /// it allows (deleting theirs too would break those whose far end speaks next: the
    /// host would answer it with a reset), and those redirected to the node's resolver
    /// or proxy: the proxy judges the connections it relays again at every policy change
    /// and resets those the new policy refuses (`cubicle_egress::Egress::register`); a
    /// redirected entry's loss would break the connection, allowed or not. The walk over
    /// the conntrack table (5-10 ms of CPU) is skipped when the policy refuses nothing
    /// or the sandbox has not sent a packet yet (it has no entry, and what it sends from
    /// now on meets the policy already in place), or has no veth: a live sandbox made
    /// without internet, whose only interface is loopback (a dead one's veth is gone
    /// too, but this is called only while it runs).
    ///
    /// `ns` opens the sandbox's network namespace (asked only when TCP connections were
    /// cut): its own ends of them are destroyed there (`sock_diag.rs`), so that they
    /// fail at once rather than wait for their next packet or a timeout (a download
    /// whose far end speaks next would hang). Returns how many conntrack entries were
    /// deleted.
    pub fn forget_refused(
        &self,
        slot: u32,
        policy: &EgressPolicy,
        ns: impl FnOnce() -> Option<Netns>,
    ) -> Result<usize> {
        if !policy.refuses_any() || matches!(self.sent(slot), Sent::NoVeth | Sent::Packets(0)) {
            return Ok(0);
        }
        let cut = self.forget_where(slot, |dst, redirected| !redirected && policy.refuses(dst))?;
        if !cut.tcp.is_empty()
            && let Some(ns) = ns()
        {
            sock_diag::destroy_in(&ns, cut.tcp)?;
        }
        Ok(cut.entries)
    }

    /// Deletes the conntrack entries slot `slot`'s address opened to destinations
    /// `doomed` picks (told whether the connection was redirected).
    fn forget_where(
        &self,
        slot: u32,
        doomed: impl Fn(Ipv4Addr, bool) -> bool,
    ) -> Result<conntrack::Flushed> {
        let info = self.slot_info(slot)?;
        let kept = self
            .conntrack_socks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let flushed = match kept {
            Some(s) => Ok(s),
            None => netlink::NetlinkSocket::open(libc::NETLINK_NETFILTER),
        }
        .and_then(|mut sock| {
            let n = conntrack::flush_source(&mut sock, info.sandbox_ip, &doomed)?;
            // Only a socket whose exchange ended cleanly goes back.
            self.conntrack_socks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(sock);
            Ok(n)
        });
        match flushed {
            Ok(n) => Ok(n),
            // No conntrack in this kernel/namespace: nothing to forget.
            Err(e) if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) => {
                Ok(conntrack::Flushed::default())
            }
            Err(e) => Err(Error::io(
                format!("flushing the conntrack entries of {}", info.sandbox_ip),
                e,
            )),
        }
    }

    /// Replaces slot `slot`'s egress policy (the default policy clears it) in one atomic
    /// netlink batch: the sandbox is never without a policy in between. Connections
    /// already established are not touched ([`Network::forget_refused`] cuts those the
    /// policy refuses).
    pub fn set_policy(&self, slot: u32, policy: &EgressPolicy) -> Result<()> {
        let info = self.slot_info(slot)?;
        let want = policy.elements(info.sandbox_ip);
        let mut policies = self.lock_policies();
        let Policies { applied, sock } = &mut *policies;
        let have = applied.get(&slot).cloned().unwrap_or_default();
        if have == want {
            return Ok(());
        }
        let mut changes = Vec::new();
        for add in [false, true] {
            for set in POLICY_SETS {
                let elems: Vec<SetElem> = if add {
                    want.difference(&have)
                } else {
                    have.difference(&want)
                }
                .filter(|(s, _)| *s == set)
                .map(|(_, e)| e.clone())
                .collect();
                changes.push(ElemChange { add, set, elems });
            }
        }
        nftables::apply(
            sock.as_mut(),
            &format!("{}_policy", self.config.table),
            &changes,
        )
        .map_err(|e| Error::io(format!("setting the egress policy of slot {slot}"), e))?;
        if want.is_empty() {
            applied.remove(&slot);
        } else {
            applied.insert(slot, want);
        }
        Ok(())
    }

    /// After a crash: deletes every sandbox veth and policy of the slots in `owned` (the
    /// calling node's range; other nodes on the host own the others) that are not in
    /// `known`.
    pub fn reconcile(&self, owned: std::ops::Range<u32>, known: &[u32]) -> Result<()> {
        let known: std::collections::HashSet<u32> = known.iter().copied().collect();
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
        let stale: Vec<u32> = self
            .lock_policies()
            .applied
            .keys()
            .copied()
            .filter(|s| owned.contains(s) && !known.contains(s))
            .collect();
        for slot in stale {
            self.set_policy(slot, &EgressPolicy::default())?;
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
        let mut script = format!(
            "table inet {t} {{}}\ndelete table inet {t}\ntable inet {t}_policy {{}}\ndelete table inet {t}_policy\n"
        );
        let prefix = format!("{t}_n");
        let v = nft_json(&["list", "tables", "inet"])?;
        for item in v["nftables"].as_array().into_iter().flatten() {
            if let Some(name) = item["table"]["name"].as_str()
                && name
                    .strip_prefix(&prefix)
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            {
                script.push_str(&format!("delete table inet {name}\n"));
            }
        }
        nft_apply(&script, "deleting the egress tables")?;
        self.lock_policies().applied.clear();
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

    fn lock_policies(&self) -> std::sync::MutexGuard<'_, Policies> {
        self.policies.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Slots that have policy elements in the kernel now.
    pub fn slots_with_policy(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.lock_policies().applied.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Fills the placeholders of `egress_rules.nft`; returns the main table, the policy
    /// table and the per-node table (whose own placeholders [`Network::serve_slots`]
    /// fills).
    fn render_rules(&self) -> Result<(String, String, String)> {
        let list = |v: &[Ipv4Cidr]| {
            v.iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let elements = |v: &[Ipv4Cidr]| {
            if v.is_empty() {
                String::new()
            } else {
                format!("elements = {{ {} }}", list(v))
            }
        };
        let control = if self.config.deny_control.is_empty() {
            String::new()
        } else {
            format!("{},", list(&self.config.deny_control))
        };
        let c = &self.config;
        let l = &c.limits;
        let text = EGRESS_RULES
            .replace("@TABLE@", &c.table)
            .replace("@IFPREFIX@", &c.ifname_prefix)
            .replace("@POOL@", &c.pool.to_string())
            .replace("@CONTROL@", &control)
            .replace("@HOST_NETS@", &elements(&self.host_nets))
            .replace("@PRIVATE@", &elements(&c.deny_private))
            .replace("@NODE_ALLOW@", &elements(&c.node_allow))
            .replace("@LOG_GROUP@", &c.log_group.to_string())
            .replace(
                "@SMTP@",
                if c.allow_smtp {
                    ""
                } else {
                    "tcp dport 25 goto deny"
                },
            )
            .replace("@MAX_CONNS@", &l.max_connections.max(1).to_string())
            .replace("@NEW_CONNS@", &l.new_connections_per_sec.max(1).to_string())
            .replace("@NEW_BURST@", &l.new_connections_burst.max(1).to_string())
            // The kernel computes with ns × (rate + burst) in 64 bits: keep it in range.
            .replace(
                "@BYTES_BURST@",
                &l.bytes_burst.clamp(1500, 1 << 30).to_string(),
            )
            .replace(
                "@BYTES@",
                &l.bytes_per_sec.clamp(1, 16_000_000_000).to_string(),
            );
        let bad = || Error::NetworkConfig("egress_rules.nft lacks its section markers".into());
        let p = text.find(POLICY_MARKER).ok_or_else(bad)?;
        let n = text.find(NODE_MARKER).ok_or_else(bad)?;
        if n < p {
            return Err(bad());
        }
        Ok((
            text[..p].to_string(),
            text[p..n].to_string(),
            text[n..].to_string(),
        ))
    }

    /// The name of the redirect table of the node whose slots start at `first`.
    fn node_table(&self, first: u32) -> String {
        format!("{}_n{first}", self.config.table)
    }

    /// Makes this node the one that answers the DNS and steered TCP of the sandboxes on
    /// `slots`: its redirect table sends them to `dns_port` and `proxy_port` on the host
    /// (replacing the table an earlier run of the node left).
    pub fn serve_slots(
        &self,
        slots: std::ops::Range<u32>,
        dns_port: u16,
        proxy_port: u16,
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let first = self.slot_info(slots.start)?;
        let last = self.slot_info(slots.end - 1)?;
        let table = self.node_table(slots.start);
        let (_, _, node_part) = self.render_rules()?;
        let node_part = node_part
            .replace("@NODE_TABLE@", &table)
            .replace("@FIRST_SLOT@", &slots.start.to_string())
            .replace("@RANGE@", &format!("{}-{}", first.gateway, last.sandbox_ip))
            .replace("@DNS_PORT@", &dns_port.to_string())
            .replace("@PROXY_PORT@", &proxy_port.to_string());
        nft_apply(
            &format!("table inet {table} {{}}\ndelete table inet {table}\n{node_part}\n"),
            "loading the node's redirect table",
        )
    }

    /// Removes the redirect table of the node whose slots start at `first` (the node
    /// stops for good; tests).
    pub fn stop_serving(&self, first: u32) -> Result<()> {
        let t = self.node_table(first);
        nft_apply(
            &format!("table inet {t} {{}}\ndelete table inet {t}\n"),
            "removing the node's redirect table",
        )
    }
}

/// The elements of the policy sets of `inet <ptable>` (sets that do not exist, e.g. in
/// an older table layout, count as empty: the node re-applies every policy it knows).
fn read_policy_elements(ptable: &str) -> Vec<(&'static str, SetElem)> {
    let mut out = Vec::new();
    for set in POLICY_SETS {
        if let Ok(elems) = nftables::list(ptable, set) {
            out.extend(elems.into_iter().map(|e| (set, e)));
        }
    }
    out
}

/// The sandbox address an element belongs to (its first four key bytes).
fn elem_slot(e: &SetElem) -> Option<Ipv4Addr> {
    let b: [u8; 4] = e.key.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(b))
}

/// An element in `nft` syntax: `a.b.c.d` or `a.b.c.d . e.f.g.h-i.j.k.l`.
fn render_elem(e: &SetElem) -> String {
    let ip = |b: &[u8]| -> String {
        let a: [u8; 4] = b.try_into().unwrap_or([0; 4]);
        Ipv4Addr::from(a).to_string()
    };
    match (&e.key_end, e.key.len()) {
        (Some(end), 8) if end.len() == 8 => {
            format!(
                "{} . {}-{}",
                ip(&e.key[..4]),
                ip(&e.key[4..]),
                ip(&end[4..])
            )
        }
        _ => ip(e.key.get(..4).unwrap_or(&[0; 4])),
    }
}

/// Byte counters on connections (`nf_conntrack_acct`), for the audit trail's byte counts.
/// Best effort: without it the counts read zero.
fn enable_conntrack_accounting() {
    let _ = std::fs::write("/proc/sys/net/netfilter/nf_conntrack_acct", "1");
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

/// The MAC addresses of slot `slot`'s veth pair (host side, sandbox side): locally
/// administered, unique per slot, so both neighbour entries are known without asking.
fn slot_macs(slot: u32) -> ([u8; 6], [u8; 6]) {
    let b = slot.to_be_bytes();
    (
        [0x02, 0xcb, b[0], b[1], b[2], b[3]],
        [0x02, 0xcc, b[0], b[1], b[2], b[3]],
    )
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
