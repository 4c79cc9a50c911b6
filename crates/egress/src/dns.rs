//! The DNS wire format, as much as the resolver needs (RFC 1035): read a query's
//! question, read the addresses in an answer, build an error answer and a query.
//! Everything else is passed through untouched.

use std::net::{Ipv4Addr, Ipv6Addr};

/// A malformed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub &'static str);

pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const TYPE_AAAA: u16 = 28;

pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

const HEADER: usize = 12;

/// A query's (single) question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// Lowercase, without the trailing dot (`""` for the root).
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// Where the question ends in the message.
    end: usize,
}

fn u16_at(m: &[u8], i: usize) -> Result<u16, WireError> {
    m.get(i..i + 2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .ok_or(WireError("truncated"))
}

fn u32_at(m: &[u8], i: usize) -> Result<u32, WireError> {
    m.get(i..i + 4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(WireError("truncated"))
}

/// Reads the (possibly compressed) name at `pos`; returns it and where it ends in place.
fn read_name(m: &[u8], mut pos: usize) -> Result<(String, usize), WireError> {
    let mut name = String::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *m.get(pos).ok_or(WireError("truncated name"))? as usize;
        match len {
            0 => {
                return Ok((name, end.unwrap_or(pos + 1)));
            }
            l if l & 0xc0 == 0xc0 => {
                let ptr = (u16_at(m, pos)? & 0x3fff) as usize;
                end.get_or_insert(pos + 2);
                jumps += 1;
                if jumps > 32 || ptr >= m.len() {
                    return Err(WireError("bad compression pointer"));
                }
                pos = ptr;
            }
            l if l > 63 => return Err(WireError("bad label")),
            l => {
                let label = m
                    .get(pos + 1..pos + 1 + l)
                    .ok_or(WireError("truncated label"))?;
                if !name.is_empty() {
                    name.push('.');
                }
                for &b in label {
                    // Names are compared as ASCII; anything else is kept visible, escaped.
                    if b.is_ascii_graphic() && b != b'.' && b != b'\\' {
                        name.push(b.to_ascii_lowercase() as char);
                    } else {
                        name.push_str(&format!("\\{b:03}"));
                    }
                }
                if name.len() > 1024 {
                    return Err(WireError("name too long"));
                }
                pos += 1 + l;
            }
        }
    }
}

/// The message id.
pub fn id(m: &[u8]) -> Result<u16, WireError> {
    u16_at(m, 0)
}

/// Replaces the message id.
pub fn set_id(m: &mut [u8], id: u16) {
    if m.len() >= 2 {
        m[..2].copy_from_slice(&id.to_be_bytes());
    }
}

/// The question of a standard query (QR=0, opcode 0, exactly one question).
pub fn parse_query(m: &[u8]) -> Result<Question, WireError> {
    if m.len() < HEADER {
        return Err(WireError("short header"));
    }
    if m[2] & 0x80 != 0 {
        return Err(WireError("not a query"));
    }
    if (m[2] >> 3) & 0x0f != 0 {
        return Err(WireError("not a standard query"));
    }
    if u16_at(m, 4)? != 1 {
        return Err(WireError("not exactly one question"));
    }
    let (name, pos) = read_name(m, HEADER)?;
    Ok(Question {
        name,
        qtype: u16_at(m, pos)?,
        qclass: u16_at(m, pos + 2)?,
        end: pos + 4,
    })
}

/// An answer to `query` with no records and response code `rcode` (e.g. REFUSED).
pub fn error_answer(query: &[u8], q: &Question, rcode: u8) -> Vec<u8> {
    let mut out = query[..q.end.min(query.len())].to_vec();
    if out.len() < HEADER {
        out.resize(HEADER, 0);
    }
    out[2] = 0x80 | (query[2] & 0x01); // QR, keep RD
    out[3] = 0x80 | (rcode & 0x0f); // RA
    out[4..6].copy_from_slice(&1u16.to_be_bytes());
    out[6..12].fill(0);
    out
}

/// A recursive query for `name`/`qtype` with id `id`.
pub fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER + name.len() + 6);
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        let l = &label.as_bytes()[..label.len().min(63)];
        m.push(l.len() as u8);
        m.extend_from_slice(l);
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m
}

/// What an answer says, as far as the audit trail and the address pinning care.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    pub rcode: u8,
    /// Truncated (TC): the client should ask again over TCP.
    pub truncated: bool,
    /// A records (address, TTL), in order.
    pub ipv4: Vec<(Ipv4Addr, u32)>,
    /// Other records, shown as text (`AAAA 2001:db8::1`, `CNAME x.example`).
    pub other: Vec<String>,
}

/// Reads the answer section of a response.
pub fn parse_answer(m: &[u8]) -> Result<Answer, WireError> {
    if m.len() < HEADER || m[2] & 0x80 == 0 {
        return Err(WireError("not a response"));
    }
    let mut a = Answer {
        rcode: m[3] & 0x0f,
        truncated: m[2] & 0x02 != 0,
        ..Default::default()
    };
    let qd = u16_at(m, 4)?;
    let an = u16_at(m, 6)?;
    let mut pos = HEADER;
    for _ in 0..qd {
        pos = read_name(m, pos)?.1 + 4;
    }
    for _ in 0..an {
        let (_, p) = read_name(m, pos)?;
        let ty = u16_at(m, p)?;
        let ttl = u32_at(m, p + 4)?;
        let len = u16_at(m, p + 8)? as usize;
        let data_at = p + 10;
        let data = m
            .get(data_at..data_at + len)
            .ok_or(WireError("truncated record"))?;
        match (ty, len) {
            (TYPE_A, 4) => a
                .ipv4
                .push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl)),
            (TYPE_AAAA, 16) => {
                let b: [u8; 16] = data.try_into().map_err(|_| WireError("bad AAAA"))?;
                a.other.push(format!("AAAA {}", Ipv6Addr::from(b)));
            }
            (TYPE_CNAME, _) => a.other.push(format!("CNAME {}", read_name(m, data_at)?.0)),
            _ => {}
        }
        pos = data_at + len;
    }
    Ok(a)
}

/// A record type's name (`A`, `TXT`, …, or `TYPE65`).
pub fn type_name(t: u16) -> String {
    match t {
        1 => "A".into(),
        2 => "NS".into(),
        5 => "CNAME".into(),
        6 => "SOA".into(),
        12 => "PTR".into(),
        15 => "MX".into(),
        16 => "TXT".into(),
        28 => "AAAA".into(),
        33 => "SRV".into(),
        64 => "SVCB".into(),
        65 => "HTTPS".into(),
        255 => "ANY".into(),
        t => format!("TYPE{t}"),
    }
}

/// A response code's name.
pub fn rcode_name(r: u8) -> &'static str {
    match r {
        0 => "NOERROR",
        1 => "FORMERR",
        2 => "SERVFAIL",
        3 => "NXDOMAIN",
        4 => "NOTIMP",
        5 => "REFUSED",
        _ => "ERROR",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer for `q` with a CNAME (compressed to the question) and two A records.
    fn answer_for(q: &[u8]) -> Vec<u8> {
        let parsed = parse_query(q).unwrap();
        let mut m = q[..parsed.end].to_vec();
        m[2] = 0x81;
        m[3] = 0x80;
        m[6..8].copy_from_slice(&3u16.to_be_bytes());
        // CNAME: name = pointer to the question (offset 12), rdata = "cdn" + pointer
        m.extend_from_slice(&[
            0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 6, 3, b'c', b'd', b'n', 0xc0, 12,
        ]);
        let cname_at = parsed.end + 12;
        for ip in [[1, 2, 3, 4], [5, 6, 7, 8]] {
            m.extend_from_slice(&[0xc0, cname_at as u8, 0, 1, 0, 1, 0, 0, 1, 0, 0, 4]);
            m.extend_from_slice(&ip);
        }
        m
    }

    #[test]
    fn query_answer_round_trip() {
        let q = build_query(0x1234, "Api.Example.com", TYPE_A);
        let parsed = parse_query(&q).unwrap();
        assert_eq!(parsed.name, "api.example.com");
        assert_eq!((parsed.qtype, parsed.qclass), (TYPE_A, 1));
        assert_eq!(id(&q).unwrap(), 0x1234);
        let a = parse_answer(&answer_for(&q)).unwrap();
        assert_eq!(a.rcode, RCODE_NOERROR);
        assert_eq!(
            a.ipv4,
            vec![
                ("1.2.3.4".parse().unwrap(), 256),
                ("5.6.7.8".parse().unwrap(), 256)
            ]
        );
        assert_eq!(a.other, vec!["CNAME cdn.api.example.com".to_string()]);
        let refused = error_answer(&q, &parsed, RCODE_REFUSED);
        let r = parse_answer(&refused).unwrap();
        assert_eq!((r.rcode, r.ipv4.len()), (RCODE_REFUSED, 0));
        assert_eq!(id(&refused).unwrap(), 0x1234);
        assert_eq!(parse_query(&refused), Err(WireError("not a query")));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for m in [
            &b""[..],
            &[0u8; 11][..],
            &[0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0, 12][..], // pointer loop
            &[0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 70, 1][..],    // label too long
        ] {
            assert!(parse_query(m).is_err());
            assert!(parse_answer(m).is_err());
        }
        // Odd bytes in a label stay visible and cannot fake a dot.
        let mut q = build_query(1, "x", TYPE_A);
        q[13] = b'.';
        assert_eq!(parse_query(&q).unwrap().name, "\\046");
    }
}
