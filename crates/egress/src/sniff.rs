//! What a connection's first bytes say about where it is going: the server name of a
//! TLS ClientHello (SNI, RFC 6066) or the `Host` of an HTTP/1 request. Pure functions
//! over a buffer; the proxy calls [`sniff`] as bytes arrive until it stops asking for
//! more.
//!
//! The HTTP request head is parsed into a [`RequestHead`] that can be serialized again:
//! the place where per-rule request rewriting (header injection) hooks in.

/// Most bytes looked at before deciding without a name.
pub const MAX_SNIFF: usize = 16 * 1024;

/// What the first bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// A TLS ClientHello, with its server name if it sent one.
    Tls { sni: Option<String> },
    /// An HTTP/1 request head.
    Http(RequestHead),
    /// Neither (or too long to tell).
    Other,
    /// Could be either; more bytes needed.
    NeedMore,
}

/// Looks at the bytes a client sent so far.
pub fn sniff(buf: &[u8]) -> Sniffed {
    if buf.is_empty() {
        return Sniffed::NeedMore;
    }
    if buf[0] == 0x16 {
        return match client_hello_sni(buf) {
            Ok(sni) => Sniffed::Tls { sni },
            Err(Incomplete::More) if buf.len() < MAX_SNIFF => Sniffed::NeedMore,
            Err(_) => Sniffed::Other,
        };
    }
    if looks_like_http(buf) {
        return match RequestHead::parse(buf) {
            Ok(h) => Sniffed::Http(h),
            Err(Incomplete::More) if buf.len() < MAX_SNIFF => Sniffed::NeedMore,
            Err(_) => Sniffed::Other,
        };
    }
    Sniffed::Other
}

enum Incomplete {
    More,
    Bad,
}

const METHODS: [&str; 9] = [
    "GET ", "POST ", "PUT ", "DELETE ", "HEAD ", "OPTIONS ", "PATCH ", "CONNECT ", "TRACE ",
];

fn looks_like_http(buf: &[u8]) -> bool {
    METHODS.iter().any(|m| {
        let n = m.len().min(buf.len());
        buf[..n] == m.as_bytes()[..n]
    })
}

/// The TLS handshake bytes of the leading records (ClientHello may span records).
fn handshake_bytes(buf: &[u8]) -> Result<Vec<u8>, Incomplete> {
    let mut out = Vec::new();
    let mut pos = 0;
    loop {
        let Some(h) = buf.get(pos..pos + 5) else {
            return Err(Incomplete::More);
        };
        if h[0] != 0x16 || h[1] != 3 {
            return Err(Incomplete::Bad);
        }
        let len = u16::from_be_bytes([h[3], h[4]]) as usize;
        let Some(body) = buf.get(pos + 5..pos + 5 + len) else {
            return Err(Incomplete::More);
        };
        out.extend_from_slice(body);
        pos += 5 + len;
        if out.len() >= 4 {
            let need = 4 + u32::from_be_bytes([0, out[1], out[2], out[3]]) as usize;
            if out.len() >= need {
                out.truncate(need);
                return Ok(out);
            }
        }
    }
}

fn client_hello_sni(buf: &[u8]) -> Result<Option<String>, Incomplete> {
    let hs = handshake_bytes(buf)?;
    if hs[0] != 1 {
        return Err(Incomplete::Bad); // not a ClientHello
    }
    let mut r = Reader {
        b: &hs[4..],
        pos: 0,
    };
    r.skip(2 + 32)?; // version, random
    let n = r.u8()? as usize;
    r.skip(n)?; // session id
    let n = r.u16()? as usize;
    r.skip(n)?; // cipher suites
    let n = r.u8()? as usize;
    r.skip(n)?; // compression methods
    if r.pos == r.b.len() {
        return Ok(None); // no extensions
    }
    let ext_len = r.u16()? as usize;
    let end = r.pos + ext_len;
    while r.pos + 4 <= end {
        let ty = r.u16()?;
        let len = r.u16()? as usize;
        if ty != 0 {
            r.skip(len)?;
            continue;
        }
        let _list_len = r.u16()?;
        let name_type = r.u8()?;
        let n = r.u16()? as usize;
        let name = r.take(n)?;
        if name_type != 0 {
            return Ok(None);
        }
        return Ok(std::str::from_utf8(name).ok().map(str::to_ascii_lowercase));
    }
    Ok(None)
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Incomplete> {
        let s = self.b.get(self.pos..self.pos + n).ok_or(Incomplete::Bad)?;
        self.pos += n;
        Ok(s)
    }
    fn skip(&mut self, n: usize) -> Result<(), Incomplete> {
        self.take(n).map(drop)
    }
    fn u8(&mut self) -> Result<u8, Incomplete> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Incomplete> {
        let s = self.take(2)?;
        Ok(u16::from_be_bytes([s[0], s[1]]))
    }
}

/// An HTTP/1 request head: request line and header fields, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub target: String,
    pub version: String,
    pub headers: Vec<(String, String)>,
    /// Bytes of the head in the original buffer (request line to the empty line).
    pub len: usize,
}

impl RequestHead {
    fn parse(buf: &[u8]) -> Result<RequestHead, Incomplete> {
        let end = buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or(Incomplete::More)?;
        let text = std::str::from_utf8(&buf[..end]).map_err(|_| Incomplete::Bad)?;
        let mut lines = text.split("\r\n");
        let line = lines.next().ok_or(Incomplete::Bad)?;
        let mut parts = line.splitn(3, ' ');
        let (Some(method), Some(target), Some(version)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(Incomplete::Bad);
        };
        if !version.starts_with("HTTP/1.") {
            return Err(Incomplete::Bad);
        }
        let mut headers = Vec::new();
        for l in lines {
            let (k, v) = l.split_once(':').ok_or(Incomplete::Bad)?;
            if k.is_empty() || k.bytes().any(|b| b.is_ascii_whitespace()) {
                return Err(Incomplete::Bad);
            }
            headers.push((k.to_string(), v.trim().to_string()));
        }
        Ok(RequestHead {
            method: method.to_string(),
            target: target.to_string(),
            version: version.to_string(),
            headers,
            len: end + 4,
        })
    }

    /// Parses a complete head at the start of `buf` (for the request-by-request relay).
    pub(crate) fn parse_complete(buf: &[u8]) -> Result<RequestHead, ()> {
        Self::parse(buf).map_err(|_| ())
    }

    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Sets header `name` (replacing every existing one, any case).
    pub fn set_header(&mut self, name: &str, value: &str) {
        self.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        self.headers.push((name.to_string(), value.to_string()));
    }

    /// The host the request is for: `Host`, else the authority of an absolute target;
    /// lowercase, without port or brackets.
    pub fn host(&self) -> Option<String> {
        let authority = match self.header("host") {
            Some(h) => h.to_string(),
            None => {
                let rest = self
                    .target
                    .strip_prefix("http://")
                    .or_else(|| self.target.strip_prefix("https://"))?;
                rest.split('/').next()?.to_string()
            }
        };
        let host = if let Some(v6) = authority.strip_prefix('[') {
            v6.split(']').next()?.to_string()
        } else {
            authority.split(':').next()?.to_string()
        };
        (!host.is_empty()).then(|| host.to_ascii_lowercase())
    }

    /// The head as bytes again (with any changes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut s = format!("{} {} {}\r\n", self.method, self.target, self.version);
        for (k, v) in &self.headers {
            s.push_str(k);
            s.push_str(": ");
            s.push_str(v);
            s.push_str("\r\n");
        }
        s.push_str("\r\n");
        s.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal TLS 1.2-style ClientHello with an SNI extension, as one record.
    pub(crate) fn client_hello(sni: &str) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
        body.extend_from_slice(&[1, 0]); // null compression
        let name = sni.as_bytes();
        let mut ext = vec![0, 0]; // server_name
        let list_len = 3 + name.len();
        ext.extend_from_slice(&((list_len + 2) as u16).to_be_bytes());
        ext.extend_from_slice(&(list_len as u16).to_be_bytes());
        ext.push(0);
        ext.extend_from_slice(&(name.len() as u16).to_be_bytes());
        ext.extend_from_slice(name);
        let other = [0x00, 0x0b, 0, 2, 1, 0]; // ec_point_formats before it
        let exts = [&other[..], &ext[..]].concat();
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn tls_sni() {
        let ch = client_hello("Api.Example.COM");
        assert_eq!(
            sniff(&ch),
            Sniffed::Tls {
                sni: Some("api.example.com".into())
            }
        );
        // Arriving in pieces.
        for cut in [1, 5, 20, ch.len() - 1] {
            assert_eq!(sniff(&ch[..cut]), Sniffed::NeedMore, "cut {cut}");
        }
        // Split over two records.
        let hs = &ch[5..];
        let (a, b) = hs.split_at(10);
        let mut two = vec![0x16, 3, 1, 0, a.len() as u8];
        two.extend_from_slice(a);
        two.extend_from_slice(&[0x16, 3, 1]);
        two.extend_from_slice(&(b.len() as u16).to_be_bytes());
        two.extend_from_slice(b);
        assert_eq!(sniff(&two), sniff(&ch));
        // Garbage after a TLS-looking first byte.
        assert_eq!(sniff(&[0x16, 9, 9, 9, 9, 9]), Sniffed::Other);
    }

    #[test]
    fn http_host() {
        let req = b"GET /x HTTP/1.1\r\nHost: Example.com:8080\r\nUser-Agent: t\r\n\r\nbody";
        let Sniffed::Http(h) = sniff(req) else {
            panic!("not http")
        };
        assert_eq!(h.host().as_deref(), Some("example.com"));
        assert_eq!(h.len, req.len() - 4);
        assert_eq!(sniff(&req[..20]), Sniffed::NeedMore);
        assert_eq!(sniff(b"GE"), Sniffed::NeedMore);
        assert_eq!(sniff(b"SSH-2.0-OpenSSH\r\n"), Sniffed::Other);
        let Sniffed::Http(mut h) = sniff(b"GET http://a.test/p HTTP/1.0\r\n\r\n") else {
            panic!()
        };
        assert_eq!(h.host().as_deref(), Some("a.test"));
        h.set_header("X-Added", "1");
        assert_eq!(
            h.to_bytes(),
            b"GET http://a.test/p HTTP/1.0\r\nX-Added: 1\r\n\r\n".to_vec()
        );
        assert_eq!(sniff(b"GET / HTTP/2\r\n\r\n"), Sniffed::Other);
    }
}
