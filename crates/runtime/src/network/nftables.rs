//! nftables set elements over netlink: adding, deleting and listing the elements of the
//! per-sandbox policy sets (`egress_rules.nft`, table `<table>_policy`) without running
//! `nft`. A policy change is one atomic batch (one `sendto`, a few microseconds plus the
//! kernel's work); spawning `nft -f -` costs milliseconds and grows with the ruleset.
//!
//! Tables, chains and rules are still loaded from the readable rules file with `nft -f`
//! at node start; only elements change at run time.

use std::io;

use super::netlink::{
    Msg, NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REQUEST, NetlinkSocket, attrs,
    cstr,
};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFPROTO_INET: u8 = 1;

const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;

/// One set element: a key (bytes in the set's key layout: concatenated fields, each
/// padded to 4 bytes, addresses in network order) and, for interval sets with
/// concatenations, the end of the range.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct SetElem {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
}

/// What to do with some elements of one set.
#[derive(Debug, Clone)]
pub(crate) struct ElemChange {
    pub add: bool,
    pub set: &'static str,
    pub elems: Vec<SetElem>,
}

fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let r = res_id.to_be_bytes();
    [family, 0, r[0], r[1]]
}

fn msg_type(cmd: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | cmd
}

fn put_elem(m: &mut Msg, e: &SetElem) {
    m.begin_nest(NFTA_LIST_ELEM | NLA_F_NESTED);
    m.begin_nest(NFTA_SET_ELEM_KEY | NLA_F_NESTED);
    m.attr(NFTA_DATA_VALUE, &e.key);
    m.end_nest();
    if let Some(end) = &e.key_end {
        m.begin_nest(NFTA_SET_ELEM_KEY_END | NLA_F_NESTED);
        m.attr(NFTA_DATA_VALUE, end);
        m.end_nest();
    }
    m.end_nest();
}

/// Applies `changes` to sets of `inet <table>` as ONE transaction over `sock` (a
/// `NETLINK_NETFILTER` socket; `None`: one opened for this call): either all happen or
/// none. Deleting an element that is not there, or adding one that overlaps another,
/// fails the whole batch.
///
/// Keep the socket: after an element's removal, the `close` of a netfilter socket took
/// 9-16 ms on this machine (`strace -T` of `nft delete element`; microseconds after an
/// addition), and in a server every other policy change waited behind it. As far as we
/// can tell nf_tables' release handler (`NETLINK_URELEASE`) flushes the destruction
/// of what earlier transactions removed, which waits for an RCU grace period, under
/// the ruleset's commit mutex.
pub(crate) fn apply(
    sock: Option<&mut NetlinkSocket>,
    table: &str,
    changes: &[ElemChange],
) -> io::Result<()> {
    let changes: Vec<&ElemChange> = changes.iter().filter(|c| !c.elems.is_empty()).collect();
    if changes.is_empty() {
        return Ok(());
    }
    let mut own;
    let sock = match sock {
        Some(s) => s,
        None => {
            own = NetlinkSocket::open(libc::NETLINK_NETFILTER)?;
            &mut own
        }
    };
    let mut batch = Vec::new();
    let begin_seq = sock.next_seq();
    let mut begin = Msg::new(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST);
    begin.header(&nfgenmsg(libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES));
    batch.extend_from_slice(begin.finish(begin_seq));
    let mut seqs = Vec::new();
    for c in &changes {
        let (cmd, flags) = if c.add {
            (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        } else {
            (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK)
        };
        let mut m = Msg::new(msg_type(cmd), flags);
        m.header(&nfgenmsg(NFPROTO_INET, 0));
        m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
        m.attr_str(NFTA_SET_ELEM_LIST_SET, c.set);
        m.begin_nest(NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
        for e in &c.elems {
            put_elem(&mut m, e);
        }
        m.end_nest();
        let seq = sock.next_seq();
        batch.extend_from_slice(m.finish(seq));
        seqs.push((seq, c.set, c.add));
    }
    let end_seq = sock.next_seq();
    let mut end = Msg::new(NFNL_MSG_BATCH_END, NLM_F_REQUEST);
    end.header(&nfgenmsg(libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES));
    batch.extend_from_slice(end.finish(end_seq));
    sock.send_bytes(&batch)?;
    // One answer per message that asked for an ACK; on failure the kernel aborts the
    // whole batch and reports the failing message's error.
    let mut first_err = None;
    for (seq, set, add) in seqs {
        if let Err(e) = sock.recv_until_done(seq, |_, _| false) {
            first_err.get_or_insert_with(|| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{} elements {} set {table}/{set}: {e}",
                        if add { "adding" } else { "deleting" },
                        if add { "to" } else { "from" }
                    ),
                )
            });
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Every element of set `set` in `inet <table>`.
pub(crate) fn list(table: &str, set: &str) -> io::Result<Vec<SetElem>> {
    let mut sock = NetlinkSocket::open(libc::NETLINK_NETFILTER)?;
    let mut m = Msg::new(msg_type(NFT_MSG_GETSETELEM), NLM_F_REQUEST | NLM_F_DUMP);
    m.header(&nfgenmsg(NFPROTO_INET, 0));
    m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
    m.attr_str(NFTA_SET_ELEM_LIST_SET, set);
    let mut out = Vec::new();
    sock.dump(m, |ty, payload| {
        if ty != msg_type(NFT_MSG_NEWSETELEM) || payload.len() < 4 {
            return;
        }
        for (aty, data) in attrs(&payload[4..]) {
            match aty {
                NFTA_SET_ELEM_LIST_SET if cstr(data) != set => return,
                NFTA_SET_ELEM_LIST_ELEMENTS => {
                    for (lty, elem) in attrs(data) {
                        if lty != NFTA_LIST_ELEM {
                            continue;
                        }
                        if let Some(e) = parse_elem(elem) {
                            out.push(e);
                        }
                    }
                }
                _ => {}
            }
        }
    })?;
    Ok(out)
}

fn data_value(nested: &[u8]) -> Option<Vec<u8>> {
    attrs(nested)
        .find(|(t, _)| *t == NFTA_DATA_VALUE)
        .map(|(_, d)| d.to_vec())
}

fn parse_elem(elem: &[u8]) -> Option<SetElem> {
    let mut key = None;
    let mut key_end = None;
    for (ty, data) in attrs(elem) {
        match ty {
            NFTA_SET_ELEM_KEY => key = data_value(data),
            NFTA_SET_ELEM_KEY_END => key_end = data_value(data),
            _ => {}
        }
    }
    Some(SetElem { key: key?, key_end })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_encoding_round_trips() {
        let e = SetElem {
            key: vec![10, 200, 0, 1, 1, 2, 3, 0],
            key_end: Some(vec![10, 200, 0, 1, 1, 2, 3, 255]),
        };
        let mut m = Msg::new(msg_type(NFT_MSG_NEWSETELEM), NLM_F_REQUEST);
        m.header(&nfgenmsg(NFPROTO_INET, 0));
        put_elem(&mut m, &e);
        let bytes = m.finish(1).to_vec();
        let body = &bytes[16 + 4..];
        let (ty, inner) = attrs(body).next().unwrap();
        assert_eq!(ty, NFTA_LIST_ELEM);
        assert_eq!(parse_elem(inner), Some(e));
    }
}
