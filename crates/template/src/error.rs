//! The template crate's single error type.

use std::path::PathBuf;

/// Everything that can go wrong with templates.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem or syscall operation failed on a known path.
    #[error("{op} {path}: {source}")]
    Io {
        /// What we were doing.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A template that is not built and is not a built-in.
    #[error(
        "template '{0}' not found (built-ins: tiny, base; build one with `cubicle template build NAME`)"
    )]
    TemplateNotFound(String),
    /// Building a template failed.
    #[error("building template '{name}' failed: {message}")]
    TemplateBuild {
        /// Template name.
        name: String,
        /// What failed.
        message: String,
    },
    /// An image (or an image layer) is unusable: not a tar, bad digest, an entry that
    /// leaves its layer, an unknown manifest... The message names the part.
    #[error("broken image: {0}")]
    BrokenImage(String),
    /// A registry refused or failed (unreachable, unknown image, bad credentials).
    #[error("registry: {0}")]
    Registry(String),
    /// A template lists a layer that is not stored (removed by hand, or a state directory
    /// copied without its `layers/`).
    #[error("layer {0} is missing from the layer store (<state>/layers); rebuild the template")]
    LayerMissing(String),
    /// The request is invalid (bad name, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A JSON record could not be read or written.
    #[error("record {path}: {source}")]
    Record {
        /// The record file.
        path: PathBuf,
        /// The decode error.
        #[source]
        source: serde_json::Error,
    },
}

/// Result alias for the template crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for an [`Error::Io`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Attach an operation and a path to an `io::Result`.
pub(crate) trait IoContext<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| Error::io(op, path, e))
    }
}
