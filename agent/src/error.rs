//! What the agent's error types share: the way a cause is printed
//! ([`Chain`]) and the file system failure naming its action and path
//! ([`IoError`]).
//!
//! The typed errors of the areas (dataplane, CNI, sources, listeners) keep their
//! cause as a field and end their message with it and its own causes,
//! `: `-separated (what `anyhow`'s `{:#}` printed), rather than exposing it as
//! [`std::error::Error::source`]: the whole chain is printed once, whichever
//! way the error is printed.

use std::{fmt, io, path::PathBuf};

/// Displays an error and its sources, `: `-separated.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

/// A file system operation that failed: `{action} {path}: {error}`.
#[derive(Debug, thiserror::Error)]
#[error("{action} {}: {error}", path.display())]
pub struct IoError {
    /// What was done: `reading`, `writing`, `creating`, `removing`, `binding`…
    pub action: &'static str,
    /// The file, directory or socket.
    pub path: PathBuf,
    /// The system call's error.
    pub error: io::Error,
}

impl IoError {
    /// The [`IoError`] of `action` on `path`, for `map_err`.
    pub fn at(action: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |error| IoError {
            action,
            path,
            error,
        }
    }
}
