//! Template references as the SDKs send them (`templateID` of create): `base`,
//! `name:tag`, `namespace/name[:tag]`, possibly percent-encoded. The tags `default` and
//! `latest` name a template's default build; other tags name builds they were assigned
//! to (the caller checks that they exist); a namespace (`e2b/base`, `myteam/base`) is
//! accepted and ignored (one node, one template namespace).

use crate::error::{ApiError, ApiResult};
use crate::query::unescape;

/// A resolved reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRef {
    /// The template name on the node (`base`).
    pub name: String,
    /// What the caller wrote, decoded (returned as `alias`).
    pub requested: String,
    /// A tag other than the default one, if named.
    pub tag: Option<String>,
}

impl TemplateRef {
    /// `name` or `name:tag`, as the node resolves it.
    pub fn node_ref(&self) -> String {
        match &self.tag {
            Some(t) => format!("{}:{t}", self.name),
            None => self.name.clone(),
        }
    }
}

/// Tags that name a template's only version.
pub const TAGS: &[&str] = &["default", "latest"];

/// Parse a reference. Malformed → 400; an unknown tag → 404. Whether the template
/// exists is checked by the caller.
pub fn parse(raw: &str) -> ApiResult<TemplateRef> {
    let decoded = if raw.contains('%') {
        unescape(raw, false)?
    } else {
        raw.to_string()
    };
    let s = decoded.trim();
    if s.is_empty() {
        return Err(ApiError::BadRequest("templateID must not be empty".into()));
    }
    let bad = || {
        ApiError::BadRequest(format!(
            "malformed template reference '{s}': expected NAME, NAME:TAG or NAMESPACE/NAME[:TAG]"
        ))
    };
    let (ns, rest) = match s.split_once('/') {
        Some((ns, rest)) => (Some(ns), rest),
        None => (None, s),
    };
    let ns_ok = |ns: &str| {
        ns.bytes().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && ns
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
    };
    if ns.is_some_and(|ns| !ns_ok(ns) || rest.contains('/')) {
        return Err(bad());
    }
    let (name, tag) = match rest.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (rest, None),
    };
    if cubicle_node::template::validate_name(name).is_err() {
        return Err(bad());
    }
    let tag = match tag {
        Some(t) if TAGS.contains(&t) => None,
        Some(t) => {
            // No template has a tag that is not valid: unknown, like any other (E2B
            // answers 404 for a tag it does not know).
            cubicle_node::template::builds::validate_tag(t)
                .map_err(|_| ApiError::NotFound(format!("template '{s}' not found")))?;
            Some(t.to_string())
        }
        None => None,
    };
    Ok(TemplateRef {
        name: name.to_string(),
        requested: s.to_string(),
        tag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        for (raw, name) in [
            ("base", "base"),
            ("base:default", "base"),
            ("base:latest", "base"),
            ("e2b/base", "base"),
            ("team/tiny:latest", "tiny"),
            ("base%3Adefault", "base"),
            ("e2b%2Fbase", "base"),
        ] {
            assert_eq!(parse(raw).unwrap().name, name, "{raw}");
        }
        assert_eq!(parse("base:v2").unwrap().node_ref(), "base:v2");
        assert_eq!(parse("base:latest").unwrap().node_ref(), "base");
        for bad in [
            "", "  ", "Base", "a/b/c", "/base", "ba se", "%zz", "../x", ".hidden",
        ] {
            assert!(
                matches!(parse(bad), Err(ApiError::BadRequest(_))),
                "{bad:?}"
            );
        }
    }
}
