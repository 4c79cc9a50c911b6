//! Query strings, decoded strictly (a malformed `%` escape is a 400, not a silent
//! guess), the list route's metadata filter (three encoding layers, decoded as upstream
//! does — spec §2.3/S5), RFC 3339 times and the opaque pagination cursor.

use std::collections::BTreeMap;

use crate::error::{ApiError, ApiResult};

/// Percent-decode `s` (optionally `+` → space), refusing bad escapes and non-UTF-8.
pub fn unescape(s: &str, plus_is_space: bool) -> ApiResult<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = |c: u8| (c as char).to_digit(16);
                let (Some(h), Some(l)) = (
                    b.get(i + 1).copied().and_then(hex),
                    b.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(ApiError::BadRequest(format!(
                        "malformed percent-encoding in '{s}'"
                    )));
                };
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out)
        .map_err(|_| ApiError::BadRequest(format!("percent-encoding of '{s}' is not UTF-8")))
}

/// A decoded query string: the last value of each name wins ([`Query::all`] has every
/// value of a repeated name).
#[derive(Debug, Default)]
pub struct Query(BTreeMap<String, String>, Vec<(String, String)>);

impl Query {
    /// Parse `a=1&b=2` (form encoding).
    pub fn parse(raw: Option<&str>) -> ApiResult<Query> {
        let mut map = BTreeMap::new();
        let mut all = Vec::new();
        for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let (k, v) = (unescape(k, true)?, unescape(v, true)?);
            all.push((k.clone(), v.clone()));
            map.insert(k, v);
        }
        Ok(Query(map, all))
    }

    /// Every non-empty value of a repeated parameter (`types=a&types=b`), in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.1
            .iter()
            .filter(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// A boolean parameter (`true`/`false`; absent → `None`).
    pub fn bool(&self, name: &str) -> ApiResult<Option<bool>> {
        match self.get(name) {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(v) => Err(ApiError::BadRequest(format!(
                "query parameter '{name}' must be true or false, got '{v}'"
            ))),
        }
    }

    /// A parameter's value (absent or empty → `None`).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// An integer parameter within `range`.
    pub fn int(&self, name: &str, range: std::ops::RangeInclusive<i64>) -> ApiResult<Option<i64>> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let n: i64 = v.parse().map_err(|_| {
            ApiError::BadRequest(format!(
                "query parameter '{name}' must be an integer, got '{v}'"
            ))
        })?;
        if !range.contains(&n) {
            return Err(ApiError::BadRequest(format!(
                "query parameter '{name}' must be between {} and {}, got {n}",
                range.start(),
                range.end()
            )));
        }
        Ok(Some(n))
    }
}

/// Decode the list route's `metadata` value (already query-decoded once): URL-unescape
/// the whole string, split on `&` and `=`, URL-unescape key and value again.
/// `a%2520b=c%2526d` → `{"a b": "c&d"}`.
pub fn metadata_filter(value: &str) -> ApiResult<BTreeMap<String, String>> {
    let once = unescape(value, false)?;
    let mut out = BTreeMap::new();
    for pair in once.split('&').filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(ApiError::BadRequest(format!(
                "metadata filter '{pair}' must look like key=value"
            )));
        };
        out.insert(unescape(k, true)?, unescape(v, true)?);
    }
    Ok(out)
}

/// Parse an RFC 3339 / ISO 8601 time with offset into unix ms. A `+` offset that a
/// client left unencoded arrives as a space; accept that too.
pub fn parse_time(name: &str, v: &str) -> ApiResult<i64> {
    let parse = |s: &str| chrono::DateTime::parse_from_rfc3339(s).map(|t| t.timestamp_millis());
    parse(v)
        .or_else(|_| parse(&v.replace(' ', "+")))
        .map_err(|_| {
            ApiError::BadRequest(format!(
                "query parameter '{name}' must be an RFC 3339 time like 2025-01-01T00:00:00Z, got '{v}'"
            ))
        })
}

/// RFC 3339 in UTC with milliseconds (`2025-01-01T00:00:00.000Z`).
pub fn format_time(ms: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Opaque cursor for `nextToken`/`X-Next-Token`: `<started ms>_<id>` (the OpenAPI
/// description's pattern for `nextToken` says the same).
pub fn encode_cursor(started_at: i64, id: &str) -> String {
    format!("{started_at}_{id}")
}

/// Decode a cursor made by [`encode_cursor`].
pub fn decode_cursor(token: &str) -> ApiResult<(i64, String)> {
    let bad = || ApiError::BadRequest("invalid nextToken".into());
    let (t, id) = token.split_once('_').ok_or_else(bad)?;
    let ok_t = (1..=15).contains(&t.len()) && t.bytes().all(|c| c.is_ascii_digit());
    let ok_id = (1..=32).contains(&id.len())
        && id
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !ok_t || !ok_id {
        return Err(bad());
    }
    Ok((t.parse().map_err(|_| bad())?, id.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filter_decodes_like_upstream() {
        // What `Sandbox.list(query=SandboxQuery(metadata={"a b": "c&d"}))` sends, after the
        // normal query decode.
        let m = metadata_filter("a%2520b=c%2526d").unwrap();
        assert_eq!(m, [("a b".to_string(), "c&d".to_string())].into());
        let m = metadata_filter("k%3Dx=v%253D&two=2").unwrap();
        assert_eq!(m.get("two").map(String::as_str), Some("2"));
        let m = metadata_filter("k=v&x=y").unwrap();
        assert_eq!(m.len(), 2);
        assert!(metadata_filter("novalue").is_err());
        assert!(metadata_filter("a=%zz").is_err());
    }

    #[test]
    fn full_wire_roundtrip_of_the_metadata_param() {
        // The raw query the SDK puts on the wire for {"a b": "c&d"}.
        let q = Query::parse(Some("metadata=a%252520b%3Dc%252526d&limit=5")).unwrap();
        assert_eq!(q.get("metadata"), Some("a%2520b=c%2526d"));
        let m = metadata_filter(q.get("metadata").unwrap()).unwrap();
        assert_eq!(m.get("a b").map(String::as_str), Some("c&d"));
        assert_eq!(q.int("limit", 1..=100).unwrap(), Some(5));
    }

    #[test]
    fn strict_unescape() {
        assert_eq!(unescape("a%20b+c", true).unwrap(), "a b c");
        assert_eq!(unescape("a+b", false).unwrap(), "a+b");
        assert!(unescape("%", true).is_err());
        assert!(unescape("%4", true).is_err());
        assert!(unescape("%ff", true).is_err(), "not UTF-8");
        assert!(Query::parse(Some("a=%G1")).is_err());
    }

    #[test]
    fn ints_and_times() {
        let q = Query::parse(Some("limit=0&x=abc&y=7")).unwrap();
        assert!(q.int("limit", 1..=100).is_err());
        assert!(q.int("x", 1..=100).is_err());
        assert_eq!(q.int("missing", 1..=100).unwrap(), None);
        assert_eq!(parse_time("t", "1970-01-01T00:00:01Z").unwrap(), 1000);
        assert_eq!(parse_time("t", "1970-01-01T01:00:01+01:00").unwrap(), 1000);
        assert_eq!(parse_time("t", "1970-01-01T01:00:01 01:00").unwrap(), 1000);
        assert!(parse_time("t", "yesterday").is_err());
        assert_eq!(format_time(1500), "1970-01-01T00:00:01.500Z");
    }

    #[test]
    fn cursors_roundtrip_and_reject_garbage() {
        let c = encode_cursor(123, "iabc");
        assert_eq!(decode_cursor(&c).unwrap(), (123, "iabc".to_string()));
        assert!(decode_cursor("!!!").is_err());
        assert!(decode_cursor("abc").is_err()); // no separator
        assert!(decode_cursor("12_ABC").is_err());
        assert!(decode_cursor("1234567890123456_a").is_err());
    }
}
