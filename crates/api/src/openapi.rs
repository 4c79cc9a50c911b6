//! The API's OpenAPI description (`GET /openapi.json`), generated from the route
//! definitions: each handler's `#[utoipa::path]` (path, parameters, body, answers) and
//! the request and response types' `ToSchema` derives, which sit on the very types the
//! handlers parse and return (`commands.rs`, `model.rs`). What is written here is only
//! the frame — title, security schemes, tags — and [`finish`], which puts this server's
//! configured limits (the longest timeout, the node's CPUs, memory and disk) into the schemas.
//!
//! The description covers E2B's routes Cubicle implements (same paths, bodies and
//! answers as E2B's API) and Cubicle's own (`/cubicle/pool`, `/metrics`, `/health`,
//! `/openapi.json`). The data plane (envd's Connect and HTTP API behind the
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
            tag("events", "Lifecycle events and webhooks"),
            tag("cubicle", "Cubicle's own routes for operators"),
        ]))
        .build();
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "ApiKeyAuth",
        SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("X-API-KEY"))),
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
const TIMEOUT_BODIES: &[&str] = &["NewSandbox", "TimeoutBody", "ConnectBody", "ConnectBodyV1"];

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
