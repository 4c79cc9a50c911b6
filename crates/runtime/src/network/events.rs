//! What the kernel knows about sandbox connections, as events for the audit trail:
//!
//! - conntrack `NEW` / `UPDATE` / `DESTROY` (ctnetlink multicast groups): connections the
//!   rules let through straight out (not the ones redirected to the node's resolver or
//!   proxy, which record themselves), and their end with the bytes each way: a TCP
//!   connection ends when conntrack sees it close (its counters are read then, since
//!   conntrack only reports them when it forgets the entry, two minutes later), any
//!   other flow when conntrack forgets it;
//! - NFLOG packets (`log group` in the rules' deny chains): attempts the rules refused,
//!   with the deny chain's prefix (`node`, `policy`, `limit`).
//!
//! Each source is read on its own thread from a netlink socket opened in the calling
//! thread's network namespace; events go to a callback. Only traffic from the sandbox
//! address pool is reported.

use std::io;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::Ipv4Cidr;
use super::netlink::{Msg, NLM_F_ACK, NLM_F_REQUEST, NetlinkSocket, attrs, cstr};
use crate::error::{Error, Result};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const NFNL_SUBSYS_ULOG: u16 = 4;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NFNLGRP_CONNTRACK_NEW: u32 = 1;
const NFNLGRP_CONNTRACK_UPDATE: u32 = 2;
const NFNLGRP_CONNTRACK_DESTROY: u32 = 3;
const NLM_F_CREATE: u16 = 0x400;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_ZONE: u16 = 18;
/// conntrack TCP states that mean "closed" (TIME_WAIT, CLOSE).
const TCP_CLOSED_STATES: [u8; 2] = [7, 8];
const CTA_COUNTERS_ORIG: u16 = 9;
const CTA_COUNTERS_REPLY: u16 = 10;
const CTA_ID: u16 = 12;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_COUNTERS_BYTES: u16 = 2;
/// Conntrack status bit: the destination was rewritten (redirected to the node).
const IPS_DST_NAT: u32 = 1 << 5;

/// One connection's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// IP protocol number (6 TCP, 17 UDP, 1 ICMP).
    pub proto: u8,
    /// Destination port (0 when the protocol has none).
    pub port: u16,
}

impl Flow {
    /// `tcp`, `udp`, `icmp` or the number.
    pub fn proto_name(&self) -> String {
        match self.proto {
            6 => "tcp".into(),
            17 => "udp".into(),
            1 => "icmp".into(),
            n => format!("ip{n}"),
        }
    }
}

/// A kernel event about a sandbox connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelEvent {
    /// The rules let a connection through (conntrack confirmed it).
    Opened { flow: Flow, id: u32 },
    /// It ended; bytes each way as conntrack counted them (headers included).
    Closed {
        flow: Flow,
        id: u32,
        bytes_out: u64,
        bytes_in: u64,
    },
    /// The rules refused an attempt; `chain` is the deny chain's log prefix.
    Refused { flow: Flow, chain: String },
}

/// Turns one netlink message (type, flags, payload) into an event, if it is one.
type Parser = Box<dyn FnMut(u16, u16, &[u8]) -> Option<KernelEvent> + Send>;

/// Stops the event threads when dropped (or on [`Watch::stop`]).
pub struct Watch {
    stop: Arc<AtomicBool>,
}

impl Watch {
    /// Stops the event threads (within a second).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop();
    }
}

fn be16(b: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(..2)?.try_into().ok()?))
}

fn be32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

fn be64(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?))
}

fn ip(b: &[u8]) -> Option<Ipv4Addr> {
    let a: [u8; 4] = b.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(a))
}

fn parse_tuple(t: &[u8]) -> Option<Flow> {
    let (mut src, mut dst, mut proto, mut port) = (None, None, None, 0);
    for (ty, data) in attrs(t) {
        match ty {
            CTA_TUPLE_IP => {
                for (t2, d2) in attrs(data) {
                    match t2 {
                        CTA_IP_V4_SRC => src = ip(d2),
                        CTA_IP_V4_DST => dst = ip(d2),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (t2, d2) in attrs(data) {
                    match t2 {
                        CTA_PROTO_NUM => proto = d2.first().copied(),
                        CTA_PROTO_DST_PORT => port = be16(d2).unwrap_or(0),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Flow {
        src: src?,
        dst: dst?,
        proto: proto?,
        port,
    })
}

fn counter_bytes(c: &[u8]) -> u64 {
    attrs(c)
        .find(|(t, _)| *t == CTA_COUNTERS_BYTES)
        .and_then(|(_, d)| be64(d))
        .unwrap_or(0)
}

/// What a ctnetlink message says about one entry.
struct CtMsg<'a> {
    flow: Flow,
    status: u32,
    id: u32,
    out: u64,
    inn: u64,
    tcp_state: Option<u8>,
    tuple: &'a [u8],
    zone: Option<&'a [u8]>,
}

fn parse_ct(payload: &[u8]) -> Option<CtMsg<'_>> {
    let body = payload.get(4..)?;
    let (mut flow, mut status, mut id, mut out, mut inn) = (None, 0, 0, 0, 0);
    let (mut tcp_state, mut tuple, mut zone) = (None, None, None);
    for (t, data) in attrs(body) {
        match t {
            CTA_TUPLE_ORIG => {
                flow = parse_tuple(data);
                tuple = Some(data);
            }
            CTA_STATUS => status = be32(data).unwrap_or(0),
            CTA_ID => id = be32(data).unwrap_or(0),
            CTA_COUNTERS_ORIG => out = counter_bytes(data),
            CTA_COUNTERS_REPLY => inn = counter_bytes(data),
            CTA_ZONE => zone = Some(data),
            CTA_PROTOINFO => {
                tcp_state = attrs(data)
                    .find(|(t, _)| *t == CTA_PROTOINFO_TCP)
                    .and_then(|(_, tcp)| attrs(tcp).find(|(t, _)| *t == CTA_PROTOINFO_TCP_STATE))
                    .and_then(|(_, st)| st.first().copied());
            }
            _ => {}
        }
    }
    Some(CtMsg {
        flow: flow?,
        status,
        id,
        out,
        inn,
        tcp_state,
        tuple: tuple?,
        zone,
    })
}

/// The conntrack entry with original tuple `tuple` (bytes of a `CTA_TUPLE_ORIG`), read
/// for its counters.
fn read_entry(sock: &mut NetlinkSocket, tuple: &[u8], zone: Option<&[u8]>) -> Option<(u64, u64)> {
    let mut m = Msg::new(
        (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_ACK,
    );
    m.header(&[libc::AF_INET as u8, 0, 0, 0]);
    m.attr(CTA_TUPLE_ORIG | super::netlink::NLA_F_NESTED, tuple);
    if let Some(z) = zone {
        m.attr(CTA_ZONE, z);
    }
    let seq = sock.send(&mut m).ok()?;
    let mut got = None;
    sock.recv_until_done(seq, |_, payload| {
        if let Some(c) = parse_ct(payload) {
            got = Some((c.out, c.inn));
        }
        true
    })
    .ok()?;
    got
}

/// Turns ctnetlink events into [`KernelEvent`]s for flows from `pool` that were not
/// redirected to the node (those record themselves).
struct CtTracker {
    pool: Ipv4Cidr,
    /// A socket for reading counters when a TCP connection closes.
    query: Option<NetlinkSocket>,
    /// Entries already reported closed (their DESTROY comes later).
    closed: std::collections::HashSet<u32>,
}

impl CtTracker {
    fn event(&mut self, ty: u16, flags: u16, payload: &[u8]) -> Option<KernelEvent> {
        if ty >> 8 != NFNL_SUBSYS_CTNETLINK {
            return None;
        }
        let c = parse_ct(payload)?;
        if !self.pool.contains(c.flow.src) || c.status & IPS_DST_NAT != 0 {
            return None;
        }
        match ty & 0xff {
            IPCTNL_MSG_CT_NEW if flags & NLM_F_CREATE != 0 => Some(KernelEvent::Opened {
                flow: c.flow,
                id: c.id,
            }),
            IPCTNL_MSG_CT_NEW => {
                let closing = c.tcp_state.is_some_and(|s| TCP_CLOSED_STATES.contains(&s));
                if !closing || self.closed.contains(&c.id) {
                    return None;
                }
                if self.closed.len() > 100_000 {
                    self.closed.clear();
                }
                self.closed.insert(c.id);
                let (out, inn) = self
                    .query
                    .as_mut()
                    .and_then(|q| read_entry(q, c.tuple, c.zone))
                    .unwrap_or((c.out, c.inn));
                Some(KernelEvent::Closed {
                    flow: c.flow,
                    id: c.id,
                    bytes_out: out,
                    bytes_in: inn,
                })
            }
            IPCTNL_MSG_CT_DELETE if self.closed.remove(&c.id) => None,
            IPCTNL_MSG_CT_DELETE => Some(KernelEvent::Closed {
                flow: c.flow,
                id: c.id,
                bytes_out: c.out,
                bytes_in: c.inn,
            }),
            _ => None,
        }
    }
}

/// The flow of a logged IPv4 packet (its first bytes).
fn packet_flow(p: &[u8]) -> Option<Flow> {
    if p.first()? >> 4 != 4 {
        return None;
    }
    let ihl = ((p[0] & 0x0f) as usize) * 4;
    let proto = *p.get(9)?;
    let port = match proto {
        6 | 17 => be16(p.get(ihl + 2..)?).unwrap_or(0),
        _ => 0,
    };
    Some(Flow {
        src: ip(p.get(12..)?)?,
        dst: ip(p.get(16..)?)?,
        proto,
        port,
    })
}

fn nflog_event(payload: &[u8], pool: Ipv4Cidr) -> Option<KernelEvent> {
    let body = payload.get(4..)?;
    let (mut flow, mut chain) = (None, String::new());
    for (t, data) in attrs(body) {
        match t {
            NFULA_PAYLOAD => flow = packet_flow(data),
            NFULA_PREFIX => chain = cstr(data),
            _ => {}
        }
    }
    let flow = flow?;
    pool.contains(flow.src)
        .then_some(KernelEvent::Refused { flow, chain })
}

/// Binds NFLOG group `group` on `sock`, copying the first 80 bytes of each packet.
fn bind_nflog(sock: &mut NetlinkSocket, group: u16) -> io::Result<()> {
    let g = group.to_be_bytes();
    let mut m = Msg::new(
        (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
        NLM_F_REQUEST | NLM_F_ACK,
    );
    m.header(&[libc::AF_UNSPEC as u8, 0, g[0], g[1]]);
    m.attr(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
    let mut mode = 80u32.to_be_bytes().to_vec();
    mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
    m.attr(NFULA_CFG_MODE, &mode);
    sock.request_ack(m)
}

/// Starts reading conntrack events and NFLOG group `log_group` in the calling thread's
/// network namespace; every event about a flow from `pool` goes to `on_event` (called
/// from the reader threads). Lost events (the kernel's buffer overran) are logged.
pub fn watch(
    pool: Ipv4Cidr,
    log_group: u16,
    on_event: impl Fn(KernelEvent) + Send + Sync + 'static,
) -> Result<Watch> {
    let groups = (1 << (NFNLGRP_CONNTRACK_NEW - 1))
        | (1 << (NFNLGRP_CONNTRACK_UPDATE - 1))
        | (1 << (NFNLGRP_CONNTRACK_DESTROY - 1));
    let ct = NetlinkSocket::open_groups(libc::NETLINK_NETFILTER, groups)
        .map_err(|e| Error::io("subscribing to conntrack events", e))?;
    ct.set_recv_buffer(8 << 20);
    let mut log = NetlinkSocket::open(libc::NETLINK_NETFILTER)
        .map_err(|e| Error::io("opening an NFLOG socket", e))?;
    bind_nflog(&mut log, log_group).map_err(|e| {
        Error::io(
            format!("binding NFLOG group {log_group} (is another node using it?)"),
            e,
        )
    })?;
    log.set_recv_buffer(4 << 20);
    let stop = Arc::new(AtomicBool::new(false));
    let on_event = Arc::new(on_event);
    let mut tracker = CtTracker {
        pool,
        query: NetlinkSocket::open(libc::NETLINK_NETFILTER).ok(),
        closed: Default::default(),
    };
    let readers: [(&'static str, NetlinkSocket, Parser); 2] = [
        (
            "cubicle-conntrack",
            ct,
            Box::new(move |ty, flags, p| tracker.event(ty, flags, p)),
        ),
        (
            "cubicle-nflog",
            log,
            Box::new(move |ty, _, p| {
                (ty == ((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET))
                    .then(|| nflog_event(p, pool))
                    .flatten()
            }),
        ),
    ];
    for (name, mut sock, mut parse) in readers {
        let (stop, on_event) = (stop.clone(), on_event.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let r = sock.recv_events(Duration::from_secs(1), |ty, flags, payload| {
                        if let Some(ev) = parse(ty, flags, payload) {
                            on_event(ev);
                        }
                    });
                    if let Err(e) = r {
                        if e.raw_os_error() == Some(libc::ENOBUFS) {
                            warn(&format!("{name}: events lost (buffer overrun)"));
                        } else {
                            warn(&format!("{name}: {e}; stopping"));
                            return;
                        }
                    }
                }
            })
            .map_err(|e| Error::io("spawning an event thread", e))?;
    }
    Ok(Watch { stop })
}

/// The runtime has no logging framework of its own: warnings go to stderr.
fn warn(msg: &str) {
    eprintln!("cubicle-runtime: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::netlink::NLA_F_NESTED;

    #[test]
    fn parses_conntrack_and_nflog_messages() {
        let pool: Ipv4Cidr = "10.200.0.0/16".parse().unwrap();
        let mut m = Msg::new(0, 0);
        m.header(&[2, 0, 0, 0]);
        m.begin_nest(CTA_TUPLE_ORIG | NLA_F_NESTED);
        m.begin_nest(CTA_TUPLE_IP | NLA_F_NESTED);
        m.attr(CTA_IP_V4_SRC, &[10, 200, 0, 3]);
        m.attr(CTA_IP_V4_DST, &[203, 0, 113, 10]);
        m.end_nest();
        m.begin_nest(CTA_TUPLE_PROTO | NLA_F_NESTED);
        m.attr(CTA_PROTO_NUM, &[6]);
        m.attr(CTA_PROTO_DST_PORT, &443u16.to_be_bytes());
        m.end_nest();
        m.end_nest();
        m.attr(CTA_STATUS, &(0x8u32).to_be_bytes());
        m.attr(CTA_ID, &7u32.to_be_bytes());
        m.begin_nest(CTA_COUNTERS_ORIG | NLA_F_NESTED);
        m.attr(CTA_COUNTERS_BYTES, &1234u64.to_be_bytes());
        m.end_nest();
        let bytes = m.finish(0).to_vec();
        let mut tracker = CtTracker {
            pool,
            query: None,
            closed: Default::default(),
        };
        let ty = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE;
        let ev = tracker.event(ty, 0, &bytes[16..]).unwrap();
        let flow = Flow {
            src: "10.200.0.3".parse().unwrap(),
            dst: "203.0.113.10".parse().unwrap(),
            proto: 6,
            port: 443,
        };
        assert_eq!(
            ev,
            KernelEvent::Closed {
                flow,
                id: 7,
                bytes_out: 1234,
                bytes_in: 0
            }
        );
        assert_eq!(flow.proto_name(), "tcp");
        // Outside the pool: nothing.
        tracker.pool = "10.9.0.0/16".parse().unwrap();
        assert!(tracker.event(ty, 0, &bytes[16..]).is_none());
        // A logged TCP SYN.
        let mut pkt = vec![
            0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0, 10, 200, 0, 3, 203, 0, 113, 20,
        ];
        pkt.extend_from_slice(&[0x9c, 0x40, 0, 22]);
        let mut m = Msg::new(0, 0);
        m.header(&[2, 0, 0, 7]);
        m.attr(NFULA_PREFIX, b"policy\0");
        m.attr(NFULA_PAYLOAD, &pkt);
        let bytes = m.finish(0).to_vec();
        assert_eq!(
            nflog_event(&bytes[16..], pool),
            Some(KernelEvent::Refused {
                flow: Flow {
                    dst: "203.0.113.20".parse().unwrap(),
                    port: 22,
                    ..flow
                },
                chain: "policy".into()
            })
        );
    }
}
