//! E2B's `network.rules` header transforms: their validation (upstream's limits, as 400
//! texts) and their application to one outbound HTTP request head, with
//! `${e2b.secrets.NAME}` placeholders replaced by the secret's value.
//!
//! The value is looked up (and unsealed, by the [`SecretSource`](crate::SecretSource)
//! the server installs) for every request that needs it and lives only in the proxy's
//! memory and in the bytes sent to the destination: it never reaches the sandbox.
//!
//! A placeholder starts with `${e2b.` and ends at the first `}`; an unclosed or nested one
//! is malformed (400, upstream's text). `${e2b.identity.tokens.NAME}` (workload identity
//! tokens, `iam`) is not supported and refused by name. Headers that frame the request
//! (`Host`, `Content-Length`, `Transfer-Encoding`, `Connection`, `Upgrade`) cannot be set
//! by a rule: the proxy reads the request's framing from them.

use std::collections::{BTreeMap, BTreeSet};

use zeroize::Zeroizing;

use crate::EgressError;
use crate::policy::{DomainPattern, Rule, Transform};
use crate::sniff::RequestHead;

/// Upstream's limits on `network.rules`.
pub const MAX_DOMAINS: usize = 10;
pub const MAX_RULES_PER_DOMAIN: usize = 1;
pub const MAX_HEADERS: usize = 20;
pub const MAX_DOMAIN_LEN: usize = 128;
pub const MAX_HEADER_NAME: usize = 64;
pub const MAX_HEADER_VALUE: usize = 2048;
pub const MAX_SECRETS_PER_DOMAIN: usize = 32;

const SECRET_PREFIX: &str = "e2b.secrets.";
const TOKEN_PREFIX: &str = "e2b.identity.tokens.";
/// Headers the proxy frames requests by.
const RESERVED: [&str; 6] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
];

/// One piece of a header value template.
#[derive(Debug, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    Secret(&'a str),
    Token(&'a str),
}

fn malformed() -> EgressError {
    EgressError::Policy("Network transform header contains a malformed E2B placeholder.".into())
}

/// Splits a header value into text and placeholders.
fn pieces(value: &str) -> Result<Vec<Piece<'_>>, EgressError> {
    let mut out = Vec::new();
    let mut rest = value;
    while let Some(start) = rest.find("${e2b.") {
        if start > 0 {
            out.push(Piece::Text(&rest[..start]));
        }
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(malformed)?;
        let inner = &after[..end];
        if inner.contains("${") || inner.contains('{') {
            return Err(malformed());
        }
        let name_ok = |n: &str| !n.is_empty() && !n.chars().any(|c| c.is_control());
        if let Some(n) = inner.strip_prefix(SECRET_PREFIX)
            && name_ok(n)
        {
            out.push(Piece::Secret(n));
        } else if let Some(n) = inner.strip_prefix(TOKEN_PREFIX)
            && name_ok(n)
        {
            out.push(Piece::Token(n));
        } else {
            return Err(malformed());
        }
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    Ok(out)
}

fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Checks `network.rules` against upstream's limits and what Cubicle supports.
pub fn check_rules(rules: &BTreeMap<String, Vec<Rule>>) -> Result<(), EgressError> {
    let bad = |m: String| EgressError::Policy(m);
    if rules.len() > MAX_DOMAINS {
        return Err(bad(format!(
            "at most {MAX_DOMAINS} domains may have rules, got {}",
            rules.len()
        )));
    }
    for (host, list) in rules {
        if host.len() > MAX_DOMAIN_LEN {
            return Err(bad(format!(
                "rule domain '{host}' is longer than {MAX_DOMAIN_LEN} characters"
            )));
        }
        DomainPattern::parse(host)?;
        if list.len() > MAX_RULES_PER_DOMAIN {
            return Err(bad(format!(
                "at most one rule per domain ({host} has {})",
                list.len()
            )));
        }
        let mut secrets = BTreeSet::new();
        for t in list.iter().filter_map(|r| r.transform.as_ref()) {
            if t.headers.len() > MAX_HEADERS {
                return Err(bad(format!(
                    "at most {MAX_HEADERS} headers per rule ({host} has {})",
                    t.headers.len()
                )));
            }
            for (name, value) in &t.headers {
                if name.len() > MAX_HEADER_NAME || !is_token(name) {
                    return Err(bad(format!(
                        "rule header name '{name}' of {host} must be an HTTP token of at most {MAX_HEADER_NAME} characters"
                    )));
                }
                if RESERVED.contains(&name.to_ascii_lowercase().as_str()) {
                    return Err(bad(format!(
                        "rule header '{name}' of {host} cannot be set: the proxy frames requests by it"
                    )));
                }
                if value.len() > MAX_HEADER_VALUE {
                    return Err(bad(format!(
                        "rule header value of '{name}' ({host}) is longer than {MAX_HEADER_VALUE} bytes"
                    )));
                }
                if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
                    return Err(bad(format!(
                        "rule header value of '{name}' ({host}) contains CR, LF or NUL"
                    )));
                }
                for p in pieces(value)? {
                    match p {
                        Piece::Secret(s) => {
                            secrets.insert(s.to_ascii_lowercase());
                        }
                        Piece::Token(_) => {
                            return Err(bad(
                                "network.rules ${e2b.identity.tokens.…} placeholders (workload \
                                 identity tokens, iam) are not supported by Cubicle"
                                    .into(),
                            ));
                        }
                        Piece::Text(_) => {}
                    }
                }
            }
        }
        if secrets.len() > MAX_SECRETS_PER_DOMAIN {
            return Err(bad(format!(
                "at most {MAX_SECRETS_PER_DOMAIN} distinct secrets per domain ({host} uses {})",
                secrets.len()
            )));
        }
    }
    Ok(())
}

/// The secret names (lowercase) the rules refer to.
pub fn secret_names(rules: &BTreeMap<String, Vec<Rule>>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for t in rules
        .values()
        .flatten()
        .filter_map(|r| r.transform.as_ref())
    {
        for v in t.headers.values() {
            for p in pieces(v).unwrap_or_default() {
                if let Piece::Secret(s) = p {
                    out.insert(s.to_ascii_lowercase());
                }
            }
        }
    }
    out
}

/// Whether a transform changes anything.
pub fn has_headers(t: &Option<Transform>) -> bool {
    t.as_ref().is_some_and(|t| !t.headers.is_empty())
}

/// Sets (adds or overrides) `t`'s headers on `head`, placeholders replaced through
/// `lookup` (secret name → value). A secret that does not exist fails the request (the
/// text names the secret, never a value).
pub(crate) fn apply(
    head: &mut RequestHead,
    t: &Transform,
    lookup: &dyn Fn(&str) -> Option<Zeroizing<Vec<u8>>>,
) -> Result<(), String> {
    for (name, template) in &t.headers {
        let mut value = Zeroizing::new(String::new());
        for p in pieces(template).map_err(|e| e.to_string())? {
            match p {
                Piece::Text(s) => value.push_str(s),
                Piece::Secret(s) => {
                    let v = lookup(&s.to_ascii_lowercase()).ok_or_else(|| {
                        format!("secret '{s}' (rule header '{name}') does not exist")
                    })?;
                    let v = std::str::from_utf8(&v)
                        .map_err(|_| format!("secret '{s}' is not UTF-8"))?;
                    if v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
                        return Err(format!("secret '{s}' contains CR, LF or NUL"));
                    }
                    value.push_str(v);
                }
                Piece::Token(s) => {
                    return Err(format!("identity token '{s}' is not supported"));
                }
            }
        }
        head.set_header(name, &value);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(host: &str, headers: &[(&str, &str)]) -> BTreeMap<String, Vec<Rule>> {
        let t = Transform {
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        BTreeMap::from([(host.to_string(), vec![Rule { transform: Some(t) }])])
    }

    #[test]
    fn placeholders_parse_and_malformed_ones_are_refused() {
        assert_eq!(
            pieces("Bearer ${e2b.secrets.k}!").unwrap(),
            [Piece::Text("Bearer "), Piece::Secret("k"), Piece::Text("!")]
        );
        assert_eq!(pieces("${x} $ {").unwrap(), [Piece::Text("${x} $ {")]);
        for bad in [
            "${e2b.secrets.k",
            "${e2b.secrets.${e2b.secrets.k}}",
            "${e2b.other.k}",
            "${e2b.secrets.}",
        ] {
            let e = pieces(bad).unwrap_err().to_string();
            assert_eq!(
                e, "Network transform header contains a malformed E2B placeholder.",
                "{bad}"
            );
        }
    }

    #[test]
    fn limits() {
        assert!(
            check_rules(&rules(
                "api.x.com",
                &[("Authorization", "Bearer ${e2b.secrets.k}")]
            ))
            .is_ok()
        );
        let e = |r| check_rules(&r).unwrap_err().to_string();
        assert!(e(rules("a.com", &[("Host", "x")])).contains("'Host'"));
        assert!(e(rules("a.com", &[("Bad Name", "x")])).contains("HTTP token"));
        assert!(e(rules("a.com", &[("A", &"v".repeat(2049))])).contains("2048"));
        assert!(e(rules("a.com", &[("A", "${e2b.identity.tokens.aws}")])).contains("identity"));
        assert!(e(rules("*", &[])).contains("not a domain"));
        let many: Vec<(String, String)> = (0..21).map(|i| (format!("h{i}"), "v".into())).collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert!(e(rules("a.com", &many)).contains("at most 20"));
        let value: String = (0..33).map(|i| format!("${{e2b.secrets.s{i}}}")).collect();
        assert!(e(rules("a.com", &[("A", &value)])).contains("32 distinct"));
        let mut two = rules("a.com", &[]);
        two.get_mut("a.com").unwrap().push(Rule::default());
        assert!(e(two).contains("one rule per domain"));
    }

    #[test]
    fn apply_overrides_and_fails_on_unknown_secrets() {
        let mut h = RequestHead::parse_complete(
            b"GET / HTTP/1.1\r\nHost: a.com\r\nauthorization: mine\r\n\r\n",
        )
        .unwrap();
        let t = Transform {
            headers: BTreeMap::from([("Authorization".into(), "Bearer ${e2b.secrets.K}".into())]),
        };
        let lookup = |n: &str| (n == "k").then(|| Zeroizing::new(b"s3cr3t".to_vec()));
        apply(&mut h, &t, &lookup).unwrap();
        assert_eq!(h.header("authorization"), Some("Bearer s3cr3t"));
        assert_eq!(h.headers.len(), 2, "overridden, not added twice");
        let none = |_: &str| None;
        let e = apply(&mut h, &t, &none).unwrap_err();
        assert!(e.contains("secret 'K'") && !e.contains("s3cr3t"), "{e}");
    }
}
