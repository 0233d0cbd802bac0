//! An error with its causes on one line: how every part prints an error it cannot return (a log
//! field, a test's skip message), so that they all read the same.

use std::{error::Error, fmt};

/// Displays an error and its [`source`](Error::source) chain, `: `-separated.
#[derive(Clone, Copy, Debug)]
pub struct ErrorChain<'a>(pub &'a dyn Error);

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn joins_the_causes() {
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(ErrorChain(&error).to_string(), "outer: inner");
    }
}
