//! The envd wire protocol's messages: `process` and `filesystem` packages.
//!
//! Types are generated at build time from `proto/` (our own definitions, matching the
//! package, message and field numbers the E2B SDKs use). Every message implements
//! `serde::Serialize`/`Deserialize` following the proto3 JSON mapping, which is the only
//! codec the SDKs use over Connect.
//!
//! [`connect`] is the one implementation of Connect's framing (server half for envd,
//! client half for everything that talks to envd), [`ENVD_PORT`] is envd's port and
//! [`ENVD_SOCKET_IN_SANDBOX`] its socket.

#![forbid(unsafe_code)]

pub mod connect;

/// envd's port inside every sandbox (what the SDKs send as `E2b-Sandbox-Port`).
pub const ENVD_PORT: u16 = 49983;

/// envd's Unix socket as seen inside every sandbox (the node talks to envd there from the
/// host side, the code interpreter from inside).
pub const ENVD_SOCKET_IN_SANDBOX: &str = "/run/cubicle/ctl/envd.sock";

#[allow(clippy::all, missing_docs)]
pub mod process {
    include!(concat!(env!("OUT_DIR"), "/process.rs"));
    include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
}

#[allow(clippy::all, missing_docs)]
pub mod filesystem {
    include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
    include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
}

pub use pbjson_types::Timestamp;
