//! Conntrack over netlink (`NETLINK_NETFILTER`, ctnetlink): forgetting the connections a
//! sandbox opened — all of them when it died (otherwise its entries outlive it, an
//! established TCP entry for five days, and would be matched by the next sandbox given
//! the same address), or those its new policy refuses (otherwise they would go on:
//! the rules accept established connections before they look at the policy).

use std::io;
use std::net::Ipv4Addr;

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

/// Deletes every IPv4 conntrack entry (in the network namespace of `sock`, a
/// `NETLINK_NETFILTER` socket) whose original direction starts at `source` and whose
/// original destination `doomed` picks (told whether the connection was redirected: its
/// destination rewritten). Returns how many were deleted. Entries that
/// vanish meanwhile are fine. Keep the socket for the next call: closing a netfilter
/// socket can wait for an RCU grace period (`nftables::apply`).
pub(crate) fn flush_source(
    sock: &mut NetlinkSocket,
    source: Ipv4Addr,
    doomed: impl Fn(Ipv4Addr, bool) -> bool,
) -> io::Result<usize> {
    // Kernel-side filtering (Linux 5.8+) keeps the dump small on a busy host; a kernel
    // that refuses the filter gets a whole dump. The source is checked here either way.
    let from = match dump_from(sock, source, true) {
        Ok(d) => d,
        Err(_) => dump_from(sock, source, false)?,
    };
    let mut deleted = 0;
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
            Ok(()) => deleted += 1,
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
    }
}
