//! A sandbox's network policy, E2B's model (`network.allowOut`, `denyOut`, `dnsServers`,
//! `egressProxy`, `rules`, `allow_internet_access`) plus Cubicle's learn mode, and the
//! decisions made from it: what the kernel enforces ([`NetworkPolicy::kernel`]), which
//! names the resolver answers ([`NetworkPolicy::resolves`]) and whether the proxy lets a
//! connection through ([`NetworkPolicy::decide`]).
//!
//! Rules, as E2B documents them: `allowOut` wins over `denyOut`; `denyOut` holds
//! addresses only, `0.0.0.0/0` meaning "everything"; a domain in `allowOut` requires
//! `0.0.0.0/0` in `denyOut`. `example.com` matches that name only, `*.example.com` any
//! name below it (not `example.com` itself). Nothing here can open what the node always
//! denies (host, metadata, private ranges: [`AddressGuard`]).

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use cubicle_runtime::network::{AddressGuard, EgressPolicy, Ipv4Cidr, Steer};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::EgressError;
pub use crate::transform::{check_rules, secret_names};

/// A DNS name pattern: `example.com` (that name) or `*.example.com` (names below it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DomainPattern {
    /// Lowercase, no trailing dot, without the `*.`.
    name: String,
    wildcard: bool,
}

/// A lowercase DNS name without its trailing dot, if `s` is a valid one (letters, digits,
/// `-` and `_`; labels of 1–63 bytes; at most 253 bytes).
pub fn normalize_name(s: &str) -> Option<String> {
    let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    if s.is_empty() || s.len() > 253 {
        return None;
    }
    for label in s.split('.') {
        if label.is_empty()
            || label.len() > 63
            || label.starts_with('-')
            || label.ends_with('-')
            || !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return None;
        }
    }
    Some(s)
}

impl DomainPattern {
    /// Parses `example.com` or `*.example.com`.
    pub fn parse(s: &str) -> Result<Self, EgressError> {
        let bad = || EgressError::Policy(format!("'{s}' is not a domain name or *.domain pattern"));
        let (rest, wildcard) = match s.trim().strip_prefix("*.") {
            Some(r) => (r, true),
            None => (s.trim(), false),
        };
        let name = normalize_name(rest).ok_or_else(bad)?;
        // A pattern for a whole top-level domain or an IP-looking name is a mistake.
        if name.parse::<Ipv4Addr>().is_ok() || (wildcard && !name.contains('.')) {
            return Err(bad());
        }
        Ok(DomainPattern { name, wildcard })
    }

    /// Whether `host` (any case, trailing dot allowed) matches.
    pub fn matches(&self, host: &str) -> bool {
        let host = host.strip_suffix('.').unwrap_or(host);
        if self.wildcard {
            host.len() > self.name.len() + 1
                && host[host.len() - self.name.len()..].eq_ignore_ascii_case(&self.name)
                && host.as_bytes()[host.len() - self.name.len() - 1] == b'.'
        } else {
            host.eq_ignore_ascii_case(&self.name)
        }
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wildcard {
            write!(f, "*.{}", self.name)
        } else {
            f.write_str(&self.name)
        }
    }
}

/// One `allowOut` / `denyOut` entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    /// An IPv4 address or network.
    Cidr(Ipv4Cidr),
    /// A domain name or `*.` pattern.
    Domain(DomainPattern),
}

impl FromStr for Destination {
    type Err = EgressError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.contains(':') {
            return Err(EgressError::Policy(format!(
                "'{s}': IPv6 destinations are not supported (sandboxes are IPv4-only)"
            )));
        }
        if t.bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/')
        {
            return t.parse::<Ipv4Cidr>().map(Destination::Cidr).map_err(|_| {
                EgressError::Policy(format!("'{s}' is not a valid IPv4 address or CIDR"))
            });
        }
        DomainPattern::parse(t).map(Destination::Domain)
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // An address is shown without "/32", as users write it.
            Destination::Cidr(c) if c.prefix_len() == 32 => write!(f, "{}", c.addr()),
            Destination::Cidr(c) => write!(f, "{c}"),
            Destination::Domain(d) => write!(f, "{d}"),
        }
    }
}

impl Serialize for Destination {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Destination {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// TLS to an egress proxy (E2B `egressProxy.tls`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProxyTls {
    /// Name to verify the certificate against and send as SNI (default: the host part
    /// of the address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// PEM CA certificates replacing the system trust store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<String>,
}

/// A SOCKS5 proxy every outbound TCP connection of the sandbox is tunnelled through
/// (E2B `egressProxy`), after the allow/deny rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressProxy {
    /// `host:port`.
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// TLS to the proxy, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ProxyTls>,
}

impl EgressProxy {
    /// `(host, port)` of the address.
    pub fn host_port(&self) -> Result<(String, u16), EgressError> {
        let bad = || {
            EgressError::Policy(format!(
                "egress proxy address '{}' must be host:port",
                self.address
            ))
        };
        let (host, port) = self.address.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port == 0 {
            return Err(bad());
        }
        Ok((host.to_string(), port))
    }
}

/// A header transform of a `rules` entry (E2B `network.rules`): headers the egress proxy
/// sets on every HTTP(S) request to the rule's domain (`transform.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Transform {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

/// One rule of a `rules` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<Transform>,
}

/// A sandbox's egress policy. The default lets everything through that the node allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    /// Allowed destinations (addresses, networks, domains); win over `deny_out`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<Destination>,
    /// Denied networks; `0.0.0.0/0` denies everything not allowed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<Ipv4Cidr4>,
    /// Upstream DNS servers for this sandbox's queries (`None`: the node's; empty: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// Tunnel outbound TCP through this SOCKS5 proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<EgressProxy>,
    /// Per-domain rules (header transforms), keyed by domain pattern.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rules: BTreeMap<String, Vec<Rule>>,
    /// Learn mode: record what the policy would deny, but let it through.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub learn: bool,
}

/// An [`Ipv4Cidr`] that serializes as a string (`denyOut` entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr4(pub Ipv4Cidr);

impl fmt::Display for Ipv4Cidr4 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Destination::Cidr(self.0).fmt(f)
    }
}

impl FromStr for Ipv4Cidr4 {
    type Err = EgressError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.parse::<Destination>() {
            Ok(Destination::Cidr(c)) => Ok(Ipv4Cidr4(c)),
            _ => Err(EgressError::Policy(format!("invalid denied CIDR {s}"))),
        }
    }
}

impl Serialize for Ipv4Cidr4 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Ipv4Cidr4 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What happens to a connection or a DNS question.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Verdict {
    Allowed,
    Denied,
    /// Learn mode: the policy would deny it, but it was let through.
    Learned,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allowed => "allowed",
            Verdict::Denied => "denied",
            Verdict::Learned => "learned",
        }
    }
}

/// A verdict and the rule that gave it, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub verdict: Verdict,
    pub reason: String,
}

impl Decision {
    fn allow(reason: impl Into<String>) -> Self {
        Decision {
            verdict: Verdict::Allowed,
            reason: reason.into(),
        }
    }
    fn deny(reason: impl Into<String>) -> Self {
        Decision {
            verdict: Verdict::Denied,
            reason: reason.into(),
        }
    }
}

/// What the proxy knows about one connection.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    pub dst: Ipv4Addr,
    pub port: u16,
    /// TLS SNI or HTTP Host, when the client sent one.
    pub name: Option<&'a str>,
    /// Whether `dst` is an address of `name` (handed out by the resolver or found by
    /// resolving it now).
    pub dst_is_names: bool,
    /// An allowed name the resolver handed out `dst` for, if any (for protocols that
    /// send no name).
    pub resolved_as: Option<&'a str>,
}

impl NetworkPolicy {
    /// `denyOut` has `0.0.0.0/0`: everything not allowed is denied.
    pub fn deny_all(&self) -> bool {
        self.deny_out.iter().any(|c| c.0.is_everything())
    }

    /// `allowOut` networks.
    pub fn allow_cidrs(&self) -> Vec<Ipv4Cidr> {
        self.allow_out
            .iter()
            .filter_map(|d| match d {
                Destination::Cidr(c) => Some(*c),
                Destination::Domain(_) => None,
            })
            .collect()
    }

    /// `allowOut` domain patterns.
    pub fn allow_domains(&self) -> impl Iterator<Item = &DomainPattern> {
        self.allow_out.iter().filter_map(|d| match d {
            Destination::Domain(p) => Some(p),
            Destination::Cidr(_) => None,
        })
    }

    /// The allowOut pattern `name` matches, if any.
    pub fn domain_rule(&self, name: &str) -> Option<&DomainPattern> {
        self.allow_domains().find(|p| p.matches(name))
    }

    /// The header transform for requests to `name`: the first rule (by key) whose
    /// pattern matches it and has headers.
    pub fn transform_for(&self, name: &str) -> Option<&Transform> {
        self.rules.iter().find_map(|(k, list)| {
            let p = DomainPattern::parse(k).ok()?;
            if !p.matches(name) {
                return None;
            }
            list.iter()
                .filter_map(|r| r.transform.as_ref())
                .find(|t| !t.headers.is_empty())
        })
    }

    /// Whether any rule has header transforms (then the proxy sees all TCP).
    pub fn has_transforms(&self) -> bool {
        self.rules
            .values()
            .flatten()
            .any(|r| crate::transform::has_headers(&r.transform))
    }

    /// Whether the sandbox needs a network interface at all.
    pub fn needs_network(&self) -> bool {
        self.learn || !self.deny_all() || !self.allow_out.is_empty()
    }

    /// Whether this is the node default (everything the node allows, nothing steered).
    pub fn is_default(&self) -> bool {
        self.kernel().is_default()
    }

    /// Whether no option at all is set.
    pub fn is_plain_default(&self) -> bool {
        *self == NetworkPolicy::default()
    }

    /// Checks the combinations E2B refuses (the API turns these into 400s).
    pub fn validate(&self) -> Result<(), EgressError> {
        crate::transform::check_rules(&self.rules)?;
        if self.allow_domains().next().is_some() && !self.deny_all() {
            return Err(EgressError::Policy(
                "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' \
                 (0.0.0.0/0) in deny out"
                    .into(),
            ));
        }
        if let Some(d) = &self.dns_servers
            && d.len() > 10
        {
            return Err(EgressError::Policy(format!(
                "at most 10 DNS servers may be given, got {}",
                d.len()
            )));
        }
        if let Some(p) = &self.egress_proxy {
            p.host_port()?;
            let long = |v: &Option<String>, max: usize| v.as_ref().is_some_and(|s| s.len() > max);
            if long(&p.username, 255) || long(&p.password, 255) {
                return Err(EgressError::Policy(
                    "egress proxy username and password are limited to 255 bytes".into(),
                ));
            }
            if p.password.is_some() && p.username.is_none() {
                return Err(EgressError::Policy(
                    "an egress proxy password needs a username".into(),
                ));
            }
            if let Some(t) = &p.tls {
                if long(&t.server_name, 253) {
                    return Err(EgressError::Policy(
                        "egress proxy tls.serverName is limited to 253 characters".into(),
                    ));
                }
                if long(&t.ca_cert, 8192) {
                    return Err(EgressError::Policy(
                        "egress proxy tls.caCert is limited to 8192 bytes".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// What the kernel enforces: address rules, and which TCP goes to the proxy.
    pub fn kernel(&self) -> EgressPolicy {
        let steer = if self.egress_proxy.is_some() || self.has_transforms() {
            Steer::All
        } else if self.learn || self.allow_domains().next().is_some() {
            Steer::UnlessAllowed
        } else {
            Steer::Direct
        };
        if self.learn {
            // Nothing denied by the kernel; the proxy sees (and records) all TCP.
            return EgressPolicy {
                steer,
                ..Default::default()
            };
        }
        EgressPolicy {
            allow: self.allow_cidrs(),
            deny: self
                .deny_out
                .iter()
                .map(|c| c.0)
                .filter(|c| !c.is_everything())
                .collect(),
            deny_all: self.deny_all(),
            steer,
        }
    }

    /// Whether the resolver answers a question for `name`: with everything else denied,
    /// only names the policy allows (so that a sandbox cannot tunnel data out through
    /// DNS questions); otherwise any name.
    pub fn resolves(&self, name: &str) -> Decision {
        if let Some(p) = self.domain_rule(name) {
            return Decision::allow(format!("allowOut {p}"));
        }
        if !self.deny_all() {
            return Decision::allow("not denied");
        }
        self.learned(Decision::deny("name not in allowOut (denyOut 0.0.0.0/0)"))
    }

    /// Whether a connection the proxy holds may go on. `guard` holds the node's rules,
    /// which learn mode does not relax.
    pub fn decide(&self, guard: &AddressGuard, a: &Attempt<'_>) -> Decision {
        if let Err(d) = guard.check(a.dst, Some(a.port)) {
            return Decision::deny(format!("node rule: {}", d.as_str()));
        }
        let d = self.decide_policy(a);
        self.learned(d)
    }

    fn decide_policy(&self, a: &Attempt<'_>) -> Decision {
        if let Some(name) = a.name
            && let Some(p) = self.domain_rule(name)
        {
            return if a.dst_is_names {
                Decision::allow(format!("allowOut {p}"))
            } else {
                Decision::deny(format!(
                    "{} is not an address of {name} (allowOut {p})",
                    a.dst
                ))
            };
        }
        if let Some(c) = self.allow_cidrs().into_iter().find(|c| c.contains(a.dst)) {
            return Decision::allow(format!("allowOut {}", Destination::Cidr(c)));
        }
        if a.name.is_none()
            && let Some(n) = a.resolved_as
            && let Some(p) = self.domain_rule(n)
        {
            return Decision::allow(format!("allowOut {p} (resolved {n})"));
        }
        if let Some(c) = self.deny_out.iter().find(|c| c.0.contains(a.dst)) {
            let what = match a.name {
                Some(n) => format!("{n} ({})", a.dst),
                None => a.dst.to_string(),
            };
            return Decision::deny(format!("denyOut {c}: {what}"));
        }
        Decision::allow("not denied")
    }

    fn learned(&self, d: Decision) -> Decision {
        if self.learn && d.verdict == Verdict::Denied {
            Decision {
                verdict: Verdict::Learned,
                reason: format!("learn mode; would be denied: {}", d.reason),
            }
        } else {
            d
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> NetworkPolicy {
        NetworkPolicy {
            allow_out: allow.iter().map(|s| s.parse().unwrap()).collect(),
            deny_out: deny.iter().map(|s| s.parse().unwrap()).collect(),
            ..Default::default()
        }
    }

    fn at<'a>(dst: &str, port: u16, name: Option<&'a str>, pinned: bool) -> Attempt<'a> {
        Attempt {
            dst: dst.parse().unwrap(),
            port,
            name,
            dst_is_names: pinned,
            resolved_as: None,
        }
    }

    #[test]
    fn patterns() {
        let p = DomainPattern::parse("*.Example.COM.").unwrap();
        assert_eq!(p.to_string(), "*.example.com");
        assert!(p.matches("a.example.com") && p.matches("x.y.EXAMPLE.com."));
        assert!(!p.matches("example.com") && !p.matches("badexample.com"));
        let e = DomainPattern::parse("api.example.com").unwrap();
        assert!(e.matches("API.example.com") && !e.matches("x.api.example.com"));
        for bad in [
            "*",
            "*.com",
            "a..b",
            "-a.com",
            "a b.com",
            "*.*.a.com",
            "1.2.3.4",
            "",
        ] {
            assert!(DomainPattern::parse(bad).is_err(), "{bad}");
        }
        assert!(matches!("10.0.0.0/8".parse(), Ok(Destination::Cidr(_))));
        assert!("::1".parse::<Destination>().is_err());
        assert!("1.2.3.4/40".parse::<Destination>().is_err());
        assert_eq!(
            "1.2.3.4".parse::<Destination>().unwrap().to_string(),
            "1.2.3.4"
        );
        assert!("example.com".parse::<Ipv4Cidr4>().is_err());
    }

    #[test]
    fn serde_round_trip() {
        let p = NetworkPolicy {
            allow_out: vec!["1.2.3.4".parse().unwrap(), "*.x.com".parse().unwrap()],
            deny_out: vec!["0.0.0.0/0".parse().unwrap()],
            dns_servers: Some(vec![]),
            learn: true,
            ..Default::default()
        };
        let j = serde_json::to_string(&p).unwrap();
        assert_eq!(
            j,
            r#"{"allowOut":["1.2.3.4","*.x.com"],"denyOut":["0.0.0.0/0"],"dnsServers":[],"learn":true}"#
        );
        assert_eq!(serde_json::from_str::<NetworkPolicy>(&j).unwrap(), p);
        assert_eq!(
            serde_json::to_string(&NetworkPolicy::default()).unwrap(),
            "{}"
        );
    }

    #[test]
    fn validation() {
        assert!(policy(&["x.com"], &[]).validate().is_err());
        assert!(policy(&["x.com"], &["0.0.0.0/0"]).validate().is_ok());
        assert!(policy(&["1.2.3.4"], &[]).validate().is_ok());
        let p = NetworkPolicy {
            egress_proxy: Some(EgressProxy {
                address: "proxy".into(),
                username: None,
                password: None,
                tls: None,
            }),
            ..Default::default()
        };
        assert!(p.validate().is_err());
    }

    #[test]
    fn kernel_share() {
        let k = policy(&["1.2.3.4", "x.com"], &["0.0.0.0/0", "5.0.0.0/8"]).kernel();
        assert!(k.deny_all && k.steer == Steer::UnlessAllowed);
        assert_eq!(k.allow.len(), 1);
        assert_eq!(k.deny, vec!["5.0.0.0/8".parse().unwrap()]);
        assert!(NetworkPolicy::default().is_default());
        let mut learn = policy(&[], &["0.0.0.0/0"]);
        learn.learn = true;
        let k = learn.kernel();
        assert!(!k.deny_all && k.steer == Steer::UnlessAllowed);
        assert!(!policy(&[], &["0.0.0.0/0"]).needs_network());
        assert!(policy(&["1.1.1.1"], &["0.0.0.0/0"]).needs_network());
    }

    #[test]
    fn decisions() {
        let g = AddressGuard::default();
        let p = policy(&["*.ok.test", "9.9.9.9"], &["0.0.0.0/0"]);
        let v = |a: Attempt<'_>| p.decide(&g, &a).verdict;
        assert_eq!(
            v(at("1.1.1.1", 443, Some("a.ok.test"), true)),
            Verdict::Allowed
        );
        // The right name at an address that is not the name's: a bypass attempt.
        assert_eq!(
            v(at("6.6.6.6", 443, Some("a.ok.test"), false)),
            Verdict::Denied
        );
        // A name not allowed, at an allowed address: the address rule decides.
        assert_eq!(
            v(at("9.9.9.9", 443, Some("evil.test"), false)),
            Verdict::Allowed
        );
        assert_eq!(
            v(at("6.6.6.6", 443, Some("evil.test"), false)),
            Verdict::Denied
        );
        assert_eq!(v(at("6.6.6.6", 22, None, false)), Verdict::Denied);
        let mut a = at("1.1.1.1", 22, None, false);
        a.resolved_as = Some("git.ok.test");
        assert_eq!(v(a), Verdict::Allowed);
        // Resolver.
        assert_eq!(p.resolves("x.ok.test").verdict, Verdict::Allowed);
        assert_eq!(p.resolves("data.evil.test").verdict, Verdict::Denied);
        // CIDR-only policies answer any name and deny by address.
        let c = policy(&[], &["6.0.0.0/8"]);
        assert_eq!(c.resolves("anything.test").verdict, Verdict::Allowed);
        assert_eq!(
            c.decide(&g, &at("6.6.6.6", 80, None, false)).verdict,
            Verdict::Denied
        );
        assert_eq!(
            c.decide(&g, &at("7.7.7.7", 80, None, false)).verdict,
            Verdict::Allowed
        );
        // Learn mode lets through what would be denied, and says so.
        let mut l = p.clone();
        l.learn = true;
        let d = l.decide(&g, &at("6.6.6.6", 443, Some("evil.test"), false));
        assert_eq!(d.verdict, Verdict::Learned);
        assert!(d.reason.contains("would be denied"), "{}", d.reason);
    }
}
