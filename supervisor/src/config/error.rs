//! What a rejected configuration says: each [`Problem`] with its key and line, and the
//! [`ConfigError`] that [`Config::load`](super::Config::load) returns.
//!
//! Invariant: a problem's line is always computed from a byte span of the file's text by
//! [`Problem::at`], so every layer (syntax, serde, checks) counts lines the same way.

use std::{
    fmt,
    ops::Range,
    path::{Path, PathBuf},
};

/// One problem in a configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The 1-based line, when known.
    pub line: Option<usize>,
    /// The dotted key, e.g. `service.cluster.count`.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl Problem {
    /// A problem at `span` (a byte range of `source`), or at no line when there is no span.
    pub(super) fn at(
        source: &str,
        span: Option<Range<usize>>,
        key: String,
        message: impl Into<String>,
    ) -> Problem {
        Problem {
            line: span.map(|span| line_of(source, span)),
            key,
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}: {}", self.key, self.message),
            None => write!(f, "{}: {}", self.key, self.message),
        }
    }
}

/// The 1-based line of `source` on which `span` starts.
pub(super) fn line_of(source: &str, span: Range<usize>) -> usize {
    let end = span.start.min(source.len());
    source[..end].bytes().filter(|&b| b == b'\n').count() + 1
}

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}{}", if .source.kind() == std::io::ErrorKind::PermissionDenied {
        " as this user (run the command with sudo, or as a user who may read it)"
    } else {
        ""
    })]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file has problems; each is reported on a line of its own.
    #[error("{}", render(.path, .problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<Problem>,
    },
}

fn render(path: &Path, problems: &[Problem]) -> String {
    let lines: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {p}", path.display()))
        .collect();
    lines.join("\n")
}
