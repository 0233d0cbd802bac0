//! A warning about a config on this host: what the supervisor says when it starts, and `peregrine
//! check` prints before it, without refusing anything.

use std::fmt;

/// One warning: what it is about, and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// The service it is about, if one.
    pub service: Option<String>,
    /// What is wrong and what to do, in a sentence or two.
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.service {
            Some(service) => write!(f, "service.{service}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl Warning {
    /// A warning about the host as a whole, no service in particular.
    pub fn about_the_host(message: impl Into<String>) -> Warning {
        Warning {
            service: None,
            message: message.into(),
        }
    }

    /// Logs it as a warning.
    pub fn log(&self) {
        match &self.service {
            Some(service) => tracing::warn!(%service, "{}", self.message),
            None => tracing::warn!("{}", self.message),
        }
    }
}
