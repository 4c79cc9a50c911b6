//! The API's OpenAPI description (`GET /openapi.json`), generated from the route
//! definitions: each handler's `#[utoipa::path]` (path, parameters, body, answers) and
//! the request and response types' `ToSchema` derives, which sit on the very types the
//! handlers parse and return (`commands.rs`, `model.rs`). What is written here is only
//! the frame — title, security schemes, tags — and [`finish`], which puts this server's
//! configured limits (the longest timeout, the node's CPUs, memory and disk) into the schemas.
//!
//! The description covers every route `cubicle serve` answers on its API: E2B's routes
//! Cubicle implements (same paths, bodies and answers as E2B's API: sandboxes, pause and
//! snapshots, events and webhooks, volumes and their content, secrets, templates) and
//! Cubicle's own (`/cubicle/…`, `/sandboxes/{id}/rollback`, `/metrics`, `/health`,
//! `/openapi.json`); only the dashboard's static files are left out
//! (`openapi_covers_every_served_route` in `tests.rs`). The data plane (envd's Connect and HTTP API behind the
//! `E2b-Sandbox-*` headers) is E2B's envd protocol and not part of it. The test suite
//! runs schemathesis against it (`tests/e2e/serve/python/test_openapi.py`).
//!
//! Keep the constraints of a request type (`minimum`, `pattern`, …) equal to what its
//! parser accepts: anything the description allows must not be refused with a 400, and
//! anything it forbids must be.

use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{InfoBuilder, OpenApi, OpenApiBuilder, Tag};

use crate::commands::Limits;

/// The frame every route is added to.
pub fn base() -> OpenApi {
    let mut api = OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("Cubicle")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "E2B-compatible sandbox API served by `cubicle serve`: E2B's control-plane \
                     routes Cubicle implements, plus Cubicle's own (`/cubicle/pool`, `/metrics`, \
                     `/health`, `/openapi.json`). Authenticate with an API key in `X-API-KEY`. \
                     Every error is `{\"code\": <status>, \"message\": \"…\"}`.",
                ))
                .build(),
        )
        .tags(Some([
            tag(
                "sandboxes",
                "Sandboxes: create, list, inspect, keep alive, kill, logs, metrics",
            ),
            tag(
                "templates",
                "Templates (and snapshots, usable as templates): list, inspect, tags, delete",
            ),
            tag("events", "Lifecycle events and webhooks"),
            tag(
                "volumes",
                "Volumes and their files (the content API takes the volume's token)",
            ),
            tag("secrets", "Secrets (write-only values)"),
            tag("cubicle", "Cubicle's own routes for operators"),
        ]))
        .build();
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "ApiKeyAuth",
        SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("X-API-KEY"))),
    );
    components.add_security_scheme(
        "VolumeToken",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some("A volume's token (GET /volumes/{id} returns it)"))
                .build(),
        ),
    );
    components.add_security_scheme(
        "BearerAuth",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    // The error answer every operation refers to (utoipa-axum collects schemas of the
    // routes' bodies, not reusable responses).
    let (name, response) = <crate::error::ErrorBody as utoipa::ToResponse>::response();
    components.responses.insert(name.to_string(), response);
    components.schemas.insert(
        "ErrorBody".to_string(),
        <crate::error::ErrorBody as utoipa::PartialSchema>::schema(),
    );
    api.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
        "ApiKeyAuth",
        Vec::<String>::new(),
    )]);
    api
}

fn tag(name: &str, description: &str) -> Tag {
    let mut t = Tag::new(name);
    t.description = Some(description.to_string());
    t
}

/// Request bodies whose `timeout` is capped by the server's `--max-timeout`.
const TIMEOUT_BODIES: &[&str] = &[
    "NewSandbox",
    "TimeoutBody",
    "ConnectBody",
    "ConnectBodyV1",
    "ResumeBody",
    "ForkBody",
];

/// The description as served: `api` with this server's limits, and
/// `allowEmptyValue` on every optional query parameter (the server reads `?name=` as
/// if `name` were absent: `crate::query::Query::get`).
pub fn finish(api: OpenApi, limits: &Limits) -> serde_json::Value {
    let mut v = serde_json::to_value(&api).unwrap_or_default();
    if let Some(paths) = v.get_mut("paths").and_then(|p| p.as_object_mut()) {
        for op in paths.values_mut().filter_map(|p| p.as_object_mut()) {
            for params in op
                .values_mut()
                .filter_map(|o| o.get_mut("parameters"))
                .filter_map(|p| p.as_array_mut())
            {
                for p in params.iter_mut().filter_map(|p| p.as_object_mut()) {
                    let optional = p.get("required") != Some(&serde_json::Value::Bool(true));
                    if optional && p.get("in").and_then(|i| i.as_str()) == Some("query") {
                        p.insert("allowEmptyValue".into(), true.into());
                    }
                }
            }
        }
    }
    let max = limits.max_timeout.as_secs();
    if let Some(schemas) = v
        .pointer_mut("/components/schemas")
        .and_then(|s| s.as_object_mut())
    {
        for name in TIMEOUT_BODIES {
            if let Some(t) = schemas
                .get_mut(*name)
                .and_then(|s| s.pointer_mut("/properties/timeout"))
                .and_then(|t| t.as_object_mut())
            {
                t.insert("maximum".into(), max.into());
            }
        }
        let resources = [
            ("cpuCount", serde_json::Value::from(limits.max_cpus)),
            ("memoryMB", limits.max_memory_mb.into()),
            ("diskSizeMB", limits.max_disk_mb.into()),
        ];
        for (field, max) in resources {
            if let Some(t) = schemas
                .get_mut("NewSandbox")
                .and_then(|s| s.pointer_mut(&format!("/properties/{field}")))
                .and_then(|t| t.as_object_mut())
            {
                t.insert("maximum".into(), max);
            }
        }
    }
    v
}

// ---- schemas the derive cannot say (used with `#[schema(schema_with = …)]`) ----

use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaType, Type};

fn boolean(only: bool, why: &str) -> Schema {
    Schema::Object(
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::Boolean, Type::Null]))
            .enum_values(Some([
                serde_json::Value::Bool(only),
                serde_json::Value::Null,
            ]))
            .description(Some(why))
            .build(),
    )
}

/// `autoPauseMemory`: `false` (a disk-only pause) needs `autoPause` and no `autoResume`,
/// which a schema of one field cannot say; described as `true` only.
pub fn true_only() -> Schema {
    boolean(
        true,
        "false (pause without memory) requires autoPause and no autoResume (else 400)",
    )
}

/// A field that must be absent or `null` (a feature Cubicle does not have yet).
pub fn null_only() -> Schema {
    Schema::Object(
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::Null))
            .description(Some(
                "not supported by Cubicle yet: anything but null is refused (400)",
            ))
            .build(),
    )
}

/// `envVars`: names without `=` or NUL, values without NUL.
pub fn env_vars() -> Schema {
    Schema::Object(
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
            .property_names(Some(
                ObjectBuilder::new()
                    .schema_type(SchemaType::Type(Type::String))
                    .pattern(Some("^[^=\\x00]+$"))
                    .build(),
            ))
            .additional_properties(Some(Schema::Object(
                ObjectBuilder::new()
                    .schema_type(SchemaType::Type(Type::String))
                    .pattern(Some("^[^\\x00]*$"))
                    .build(),
            )))
            .description(Some(
                "Environment variables of every process in the sandbox",
            ))
            .build(),
    )
}

/// A schema written as JSON (for what the builders make long-winded); the schemas below
/// are constants, checked by `described_bodies_carry_the_servers_rules` in `tests.rs`.
fn json_schema(v: serde_json::Value) -> Schema {
    serde_json::from_value(v).unwrap_or_else(|_| Schema::Object(Default::default()))
}

/// An IPv4 address or CIDR (`Ipv4Cidr`'s parser: dotted quad, prefix 0–32).
const IPV4_CIDR: &str = "^(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])(\\.(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}(/(3[0-2]|[12]?[0-9]))?$";

/// `network.allowOut`.
pub fn allow_out() -> Schema {
    json_schema(serde_json::json!({
        "type": ["array", "null"],
        "items": {"type": "string", "pattern": IPV4_CIDR},
        "description": "Egress allow list: IPv4 addresses or CIDRs (an allow entry beats a deny). \
            Domain names and `*.` patterns are allowed too, but only with `0.0.0.0/0` in \
            denyOut (a rule across fields: else 400), so this schema names addresses only.",
    }))
}

/// `network.denyOut`.
pub fn deny_out() -> Schema {
    json_schema(serde_json::json!({
        "type": ["array", "null"],
        "items": {"type": "string", "pattern": IPV4_CIDR},
        "description": "Egress deny list: IPv4 addresses or CIDRs (`0.0.0.0/0`: no internet).",
    }))
}

/// A public IPv4 address, as a subset a regular expression can say: first octet 1–99
/// other than 10 (so none of the private, loopback, link-local/metadata, shared,
/// documentation, multicast or reserved ranges the node's guard refuses).
const IPV4_PUBLIC: &str =
    "^([1-9]|1[1-9]|[2-9][0-9])(\\.(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}$";

/// `network.dnsServers`: the node refuses addresses sandboxes may not reach.
pub fn dns_servers() -> Schema {
    json_schema(serde_json::json!({
        "type": ["array", "null"],
        "items": {"type": "string", "pattern": IPV4_PUBLIC},
        "maxItems": 10,
        "description": "DNS servers (at most 10) the sandbox resolves through: IPv4 addresses \
            sandboxes may reach (not private, host, metadata, sandbox or reserved: else 400); \
            described as public addresses with a first octet 1-99 other than 10.",
    }))
}

/// `network.maskRequestHost` (`commands::mask_host`).
pub fn mask_request_host() -> Schema {
    json_schema(serde_json::json!({
        "type": ["string", "null"],
        "pattern": "^[-A-Za-z0-9._:${}]{1,253}$",
        "description": "`Host` header sent to the sandbox's ports: an ASCII host name, \
            `${PORT}` is replaced by the port.",
    }))
}

/// `network.egressProxy`: its rules span fields (a password needs a username, the
/// address must resolve to host:port, a CA certificate must be PEM), so the schema
/// names only its absence; see docs/network.md.
pub fn egress_proxy() -> Schema {
    json_schema(serde_json::json!({
        "type": "null",
        "description": "An egress proxy every connection goes through: {address: \"host:port\", \
            username, password (needs username), tls: {enabled, serverName, caCert (PEM)}}; \
            its rules span fields, see docs/network.md. Not described further here.",
    }))
}

/// `network.rules`: at most 10 domains, one rule each. Header transforms have rules
/// that span fields (placeholders must name existing secrets, some headers are
/// reserved), so the schema names only their absence; see docs/network.md.
pub fn rules() -> Schema {
    json_schema(serde_json::json!({
        "type": ["object", "null"],
        "maxProperties": 10,
        "propertyNames": {
            "type": "string",
            "pattern": "^(\\*\\.)?[a-z][a-z0-9]{0,20}(\\.[a-z][a-z0-9]{0,20}){0,3}\\.[a-z]{2,10}$",
        },
        "additionalProperties": {
            "type": "array",
            "maxItems": 1,
            "items": {
                "type": "object",
                "properties": {"transform": {"type": "null"}},
            },
        },
        "description": "Per-domain rules (at most 10 domain names or `*.` patterns, one rule \
            each). A rule's `transform: {headers: {name: value}}` sets those headers on \
            HTTP(S) requests to the domain, `${e2b.secrets.NAME}` replaced by the secret; \
            its rules span fields, see docs/network.md. Not described further here.",
    }))
}

/// `volumeMounts`: the team's volumes by name, at absolute clean paths outside the
/// sandbox's own mounts (`cubicle_node::volume::check_mounts`). A name that is not a
/// volume of the team is a 404.
pub fn volume_mounts() -> Schema {
    json_schema(serde_json::json!({
        "type": ["array", "null"],
        "maxItems": cubicle_node::volume::MAX_VOLUME_MOUNTS,
        "items": {
            "type": "object",
            "required": ["name", "path"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,128}$",
                    "description": "A volume of the team (else 404)"},
                "path": {"type": "string",
                    "pattern": "^/(mnt|home|data|workspace|srv|opt)(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}){0,8}$",
                    "description": "Mount point: absolute, without `.`/`..`, not `/` nor under \
                        /proc, /sys, /dev, /run/cubicle, each used once (described here as \
                        under /mnt, /home, /data, /workspace, /srv or /opt)"},
                "readOnly": {"type": "boolean", "description": "Cubicle's own: mount read-only"},
            },
        },
        "description": "Volumes to mount (at most 8).",
    }))
}

/// `network.httpsPorts`: not supported yet, so only an empty list (or none).
pub fn https_ports() -> Schema {
    json_schema(serde_json::json!({
        "type": ["array", "null"],
        "items": {"type": "integer", "minimum": 0, "maximum": 65535},
        "maxItems": 0,
        "description": "Ports served over HTTPS by the sandbox: not supported by Cubicle yet \
            (a non-empty list is refused, 400).",
    }))
}
