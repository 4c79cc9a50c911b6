//! The interpreter's error type.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("jupyter protocol: {0}")]
    Protocol(String),
    #[error("kernel: {0}")]
    Kernel(String),
    /// The kernel's process ended before it was ready (its language).
    #[error("kernel: {0} kernel exited during startup")]
    ExitedAtStart(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}
