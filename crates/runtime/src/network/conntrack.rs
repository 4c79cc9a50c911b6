//! Conntrack over netlink (`NETLINK_NETFILTER`, ctnetlink): forgetting the connections a
//! sandbox opened — all of them when it died (otherwise its entries outlive it, an
//! established TCP entry for five days, and would be matched by the next sandbox given
//! the same address), or those its new policy refuses (otherwise they would go on:
//! the rules accept established connections before they look at the policy).

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};

use super::netlink::{
    Msg, NLA_F_NESTED, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkSocket, attrs,
};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_STATUS: u16 = 3;
/// `IPS_DST_NAT` of `CTA_STATUS`: the connection's destination is rewritten (here: a
/// sandbox's DNS or TCP redirected to the node's resolver or proxy).
const IPS_DST_NAT: u32 = 1 << 5;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_REPLY_FLAGS: u16 = 2;
const CTA_FILTER_FLAG_CTA_IP_SRC: u32 = 1 << 0;
const CTA_TUPLE_IP: u16 = 1;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

fn nfgenmsg() -> [u8; 4] {
    [libc::AF_INET as u8, 0, 0, 0]
}

fn msg_type(cmd: u16) -> u16 {
    (NFNL_SUBSYS_CTNETLINK << 8) | cmd
}

/// One conntrack entry, as much as is needed to delete it.
struct Entry {
    orig_tuple: Vec<u8>,
    zone: Option<Vec<u8>>,
    redirected: bool,
}

/// The address `which` (`CTA_IP_V4_SRC`/`_DST`) of a tuple's IP part.
fn tuple_addr(tuple: &[u8], which: u16) -> Option<Ipv4Addr> {
    let (_, ip) = attrs(tuple).find(|(t, _)| *t == CTA_TUPLE_IP)?;
    let (_, a) = attrs(ip).find(|(t, _)| *t == which)?;
    let b: [u8; 4] = a.try_into().ok()?;
    Some(Ipv4Addr::from(b))
}

fn orig_source(tuple: &[u8]) -> Option<Ipv4Addr> {
    tuple_addr(tuple, CTA_IP_V4_SRC)
}

/// A TCP connection whose entry was deleted: its two ends as its opener saw them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TcpFlow {
    pub local: SocketAddrV4,
    pub remote: SocketAddrV4,
}

/// The TCP connection a tuple describes (`None` for other protocols).
fn tcp_flow(tuple: &[u8]) -> Option<TcpFlow> {
    let (_, proto) = attrs(tuple).find(|(t, _)| *t == CTA_TUPLE_PROTO)?;
    let field = |which| attrs(proto).find(|(t, _)| *t == which).map(|(_, v)| v);
    if field(CTA_PROTO_NUM)? != [libc::IPPROTO_TCP as u8] {
        return None;
    }
    let port = |which| field(which)?.try_into().ok().map(u16::from_be_bytes);
    Some(TcpFlow {
        local: SocketAddrV4::new(orig_source(tuple)?, port(CTA_PROTO_SRC_PORT)?),
        remote: SocketAddrV4::new(tuple_addr(tuple, CTA_IP_V4_DST)?, port(CTA_PROTO_DST_PORT)?),
    })
}

/// What [`flush_source`] deleted.
#[derive(Debug, Default)]
pub(crate) struct Flushed {
    /// Entries deleted.
    pub entries: usize,
    /// The TCP connections among them.
    pub tcp: Vec<TcpFlow>,
}

/// Deletes every IPv4 conntrack entry (in the network namespace of `sock`, a
/// `NETLINK_NETFILTER` socket) whose original direction starts at `source` and whose
/// original destination `doomed` picks (told whether the connection was redirected: its
/// destination rewritten). Returns what was deleted. Entries that
/// vanish meanwhile are fine. Keep the socket for the next call: closing a netfilter
/// socket can wait for an RCU grace period (`nftables::apply`).
pub(crate) fn flush_source(
    sock: &mut NetlinkSocket,
    source: Ipv4Addr,
    doomed: impl Fn(Ipv4Addr, bool) -> bool,
) -> io::Result<Flushed> {
    // Kernel-side filtering (Linux 5.8+) keeps the dump small on a busy host; a kernel
    // that refuses the filter gets a whole dump. The source is checked here either way.
    let from = match dump_from(sock, source, true) {
        Ok(d) => d,
        Err(_) => dump_from(sock, source, false)?,
    };
    let mut deleted = Flushed::default();
    // An entry without a readable destination goes too (not expected from the kernel).
    for e in from.into_iter().filter(|e| {
        tuple_addr(&e.orig_tuple, CTA_IP_V4_DST).is_none_or(|dst| doomed(dst, e.redirected))
    }) {
        let mut m = Msg::new(msg_type(IPCTNL_MSG_CT_DELETE), NLM_F_REQUEST | NLM_F_ACK);
        m.header(&nfgenmsg());
        m.attr(CTA_TUPLE_ORIG | NLA_F_NESTED, &e.orig_tuple);
        if let Some(z) = &e.zone {
            m.attr(CTA_ZONE, z);
        }
        match sock.request_ack(m) {
            Ok(()) => {
                deleted.entries += 1;
                deleted.tcp.extend(tcp_flow(&e.orig_tuple));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}

/// The entries whose original direction starts at `source` (asking the kernel to
/// filter when `filtered`).
fn dump_from(sock: &mut NetlinkSocket, source: Ipv4Addr, filtered: bool) -> io::Result<Vec<Entry>> {
    let mut m = Msg::new(msg_type(IPCTNL_MSG_CT_GET), NLM_F_REQUEST | NLM_F_DUMP);
    m.header(&nfgenmsg());
    if filtered {
        m.begin_nest(CTA_TUPLE_ORIG | NLA_F_NESTED);
        m.begin_nest(CTA_TUPLE_IP | NLA_F_NESTED);
        m.attr(CTA_IP_V4_SRC, &source.octets());
        m.end_nest();
        m.end_nest();
        m.begin_nest(CTA_FILTER | NLA_F_NESTED);
        m.attr(
            CTA_FILTER_ORIG_FLAGS,
            &CTA_FILTER_FLAG_CTA_IP_SRC.to_ne_bytes(),
        );
        m.attr(CTA_FILTER_REPLY_FLAGS, &0u32.to_ne_bytes());
        m.end_nest();
    }
    let mut from = Vec::new();
    sock.dump(m, |ty, payload| {
        if ty != msg_type(IPCTNL_MSG_CT_NEW) || payload.len() < 4 {
            return;
        }
        let mut tuple = None;
        let mut zone = None;
        let mut status = 0;
        for (t, data) in attrs(&payload[4..]) {
            match t {
                CTA_TUPLE_ORIG => tuple = Some(data),
                CTA_ZONE => zone = Some(data.to_vec()),
                CTA_STATUS => {
                    status = data.try_into().map(u32::from_be_bytes).unwrap_or(0);
                }
                _ => {}
            }
        }
        if let Some(tuple) = tuple
            && orig_source(tuple) == Some(source)
        {
            from.push(Entry {
                orig_tuple: tuple.to_vec(),
                zone,
                redirected: status & IPS_DST_NAT != 0,
            });
        }
    })?;
    Ok(from)
}

/// How many conntrack entries start at `source` (for tests).
#[cfg(test)]
pub(crate) fn count_source(source: Ipv4Addr) -> io::Result<usize> {
    let mut sock = NetlinkSocket::open(libc::NETLINK_NETFILTER)?;
    dump_from(&mut sock, source, false).map(|v| v.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_original_addresses() {
        // CTA_TUPLE_IP { CTA_IP_V4_SRC 10.200.0.1, CTA_IP_V4_DST 1.2.3.4 }
        let mut m = Msg::new(0, 0);
        m.begin_nest(CTA_TUPLE_IP | NLA_F_NESTED);
        m.attr(CTA_IP_V4_SRC, &[10, 200, 0, 1]);
        m.attr(2, &[1, 2, 3, 4]);
        m.end_nest();
        let bytes = m.finish(0).to_vec();
        assert_eq!(
            orig_source(&bytes[16..]),
            Some(Ipv4Addr::new(10, 200, 0, 1))
        );
        assert_eq!(
            tuple_addr(&bytes[16..], CTA_IP_V4_DST),
            Some(Ipv4Addr::new(1, 2, 3, 4))
        );
        assert_eq!(orig_source(&[]), None);
        // No protocol part: not a TCP connection.
        assert_eq!(tcp_flow(&bytes[16..]), None);
    }

    #[test]
    fn reads_a_tcp_connection() {
        let tuple = |proto: u8| {
            let mut m = Msg::new(0, 0);
            m.begin_nest(CTA_TUPLE_IP | NLA_F_NESTED);
            m.attr(CTA_IP_V4_SRC, &[10, 200, 0, 1]);
            m.attr(CTA_IP_V4_DST, &[1, 2, 3, 4]);
            m.end_nest();
            m.begin_nest(CTA_TUPLE_PROTO | NLA_F_NESTED);
            m.attr(CTA_PROTO_NUM, &[proto]);
            m.attr(CTA_PROTO_SRC_PORT, &40000u16.to_be_bytes());
            m.attr(CTA_PROTO_DST_PORT, &443u16.to_be_bytes());
            m.end_nest();
            m.finish(0)[16..].to_vec()
        };
        assert_eq!(
            tcp_flow(&tuple(libc::IPPROTO_TCP as u8)),
            Some(TcpFlow {
                local: "10.200.0.1:40000".parse().unwrap(),
                remote: "1.2.3.4:443".parse().unwrap(),
            })
        );
        assert_eq!(tcp_flow(&tuple(libc::IPPROTO_UDP as u8)), None);
    }
}
