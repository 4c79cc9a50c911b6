//! Jupyter messaging protocol (v5.3) wire format: message headers, HMAC-SHA256 signing
//! and the multipart framing `[ids…, "<IDS|MSG>", sig, header, parent, metadata,
//! content, buffers…]` used on the shell and iopub channels.

use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

use crate::error::Error;

/// The identities/payload delimiter frame.
pub const DELIM: &[u8] = b"<IDS|MSG>";

/// One decoded message.
#[derive(Debug, Clone)]
pub struct Message {
    pub header: Value,
    pub parent_header: Value,
    pub metadata: Value,
    pub content: Value,
}

impl Message {
    /// A new request of `msg_type` in `session`.
    pub fn new(msg_type: &str, session: &str, content: Value) -> Self {
        Message {
            header: json!({
                "msg_id": random_id(),
                "session": session,
                "username": "cubicle",
                "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                "msg_type": msg_type,
                "version": "5.3",
            }),
            parent_header: json!({}),
            metadata: json!({}),
            content,
        }
    }

    pub fn msg_id(&self) -> &str {
        self.header
            .get("msg_id")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    pub fn msg_type(&self) -> &str {
        self.header
            .get("msg_type")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    pub fn parent_id(&self) -> &str {
        self.parent_header
            .get("msg_id")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// The header date (ISO 8601), used as the NDJSON `timestamp`.
    pub fn date(&self) -> Value {
        self.header.get("date").cloned().unwrap_or(Value::Null)
    }
}

/// 32 random hex chars (a UUID-sized id).
pub fn random_id() -> String {
    let v: u128 = rand::random();
    format!("{v:032x}")
}

/// Hex HMAC-SHA256 of the four JSON parts with `key` ("" when the key is empty, as
/// Jupyter does for unsigned sessions).
pub fn sign(key: &[u8], parts: &[&[u8]]) -> String {
    if key.is_empty() {
        return String::new();
    }
    // HMAC accepts keys of any length.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return String::new();
    };
    for p in parts {
        mac.update(p);
    }
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Encode (and sign) a message into its frames.
pub fn encode(key: &[u8], msg: &Message) -> Vec<Bytes> {
    let h = serde_json::to_vec(&msg.header).unwrap_or_default();
    let p = serde_json::to_vec(&msg.parent_header).unwrap_or_default();
    let m = serde_json::to_vec(&msg.metadata).unwrap_or_default();
    let c = serde_json::to_vec(&msg.content).unwrap_or_default();
    let sig = sign(key, &[&h, &p, &m, &c]);
    vec![
        Bytes::from_static(DELIM),
        Bytes::from(sig),
        Bytes::from(h),
        Bytes::from(p),
        Bytes::from(m),
        Bytes::from(c),
    ]
}

/// Decode frames, verifying the signature.
pub fn decode(key: &[u8], frames: &[Bytes]) -> Result<Message, Error> {
    let i = frames
        .iter()
        .position(|f| f.as_ref() == DELIM)
        .ok_or_else(|| Error::Protocol("no <IDS|MSG> delimiter".into()))?;
    if frames.len() < i + 6 {
        return Err(Error::Protocol("truncated message".into()));
    }
    let sig = &frames[i + 1];
    let parts = [
        &frames[i + 2],
        &frames[i + 3],
        &frames[i + 4],
        &frames[i + 5],
    ];
    let expected = sign(key, &parts.map(|b| b.as_ref()));
    if !key.is_empty() && !constant_time_eq(expected.as_bytes(), sig) {
        return Err(Error::Protocol("bad message signature".into()));
    }
    let parse = |b: &Bytes| -> Result<Value, Error> {
        serde_json::from_slice(b).map_err(|e| Error::Protocol(format!("bad JSON part: {e}")))
    };
    Ok(Message {
        header: parse(parts[0])?,
        parent_header: parse(parts[1])?,
        metadata: parse(parts[2])?,
        content: parse(parts[3])?,
    })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_known_vector() {
        // RFC 4231 test case 2.
        assert_eq!(
            sign(b"Jefe", &[b"what do ya want ", b"for nothing?"]),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(sign(b"", &[b"x"]), "");
    }

    #[test]
    fn roundtrip_and_tamper() {
        let key = b"secret";
        let m = Message::new("execute_request", "s1", json!({"code": "1+1"}));
        let mut frames = encode(key, &m);
        frames.insert(0, Bytes::from_static(b"routing-id"));
        let d = decode(key, &frames).expect("decodes");
        assert_eq!(d.msg_type(), "execute_request");
        assert_eq!(d.content["code"], "1+1");
        assert_eq!(d.msg_id(), m.msg_id());
        frames[6] = Bytes::from_static(br#"{"code":"evil"}"#);
        assert!(decode(key, &frames).is_err());
        assert!(decode(b"other", &encode(key, &m)).is_err());
    }
}
