//! cubicle-envd: the agent inside every Cubicle sandbox, wire-compatible with E2B's envd.
//!
//! It serves the Connect services `process.Process` and `filesystem.Filesystem` (JSON
//! codec) and envd's HTTP endpoints on port 49983 (and on a Unix socket for the node).
//! See shared/spec/e2b-compat.md §3.

pub mod auth;
pub mod build_op;
/// Connect framing: the codec shared with every client of envd (`cubicle_proto::connect`)
/// and its server half.
pub mod connect {
    pub use cubicle_proto::connect::server::*;
    pub use cubicle_proto::connect::*;
}
pub mod filesystem;
pub mod http;
pub mod identity;
pub mod init;
pub mod paths;
pub mod process;
pub mod server;
pub mod state;
pub mod users;
