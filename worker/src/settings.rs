//! What a worker learns from the environment its supervisor sets.
//!
//! The supervisor is the only writer of these variables; the names are the contract between the two.

use std::{collections::HashMap, path::PathBuf};

use crate::url::{BindUrl, UrlError};

/// The service (Envoy cluster) the worker belongs to.
pub const ENV_SERVICE: &str = "PEREGRINE_SERVICE";
/// The worker's slot within its service, `0..count`.
pub const ENV_INDEX: &str = "PEREGRINE_WORKER_INDEX";
/// The bind url (see [`BindUrl`]).
pub const ENV_URL: &str = "PEREGRINE_URL";
/// The path of the supervisor's registration socket.
pub const ENV_CONTROL: &str = "PEREGRINE_CONTROL_SOCKET";

/// A worker's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The service name.
    pub service: String,
    /// The slot index.
    pub index: u32,
    /// Where to bind.
    pub url: BindUrl,
    /// The registration socket.
    pub control: PathBuf,
}

/// A missing or invalid setting.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A variable is not set.
    #[error("{0} is not set: a worker is started by `peregrine run`, which sets it")]
    Missing(&'static str),
    /// The index is not a number.
    #[error("{ENV_INDEX} must be a non-negative integer, got {0:?}")]
    Index(String),
    /// The url is invalid.
    #[error("{ENV_URL} is invalid")]
    Url(#[source] UrlError),
}

impl Settings {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Self, SettingsError> {
        Self::from_map(&std::env::vars().collect())
    }

    /// Reads the settings from a map of variables (tests pass one instead of mutating the environment).
    pub fn from_map(vars: &HashMap<String, String>) -> Result<Self, SettingsError> {
        let get = |k: &'static str| vars.get(k).ok_or(SettingsError::Missing(k));
        let index = get(ENV_INDEX)?;
        Ok(Settings {
            service: get(ENV_SERVICE)?.clone(),
            index: index
                .parse()
                .map_err(|_| SettingsError::Index(index.clone()))?,
            url: get(ENV_URL)?.parse().map_err(SettingsError::Url)?,
            control: get(ENV_CONTROL)?.into(),
        })
    }

    /// The variables that make up these settings, for the supervisor to pass to a worker.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (ENV_SERVICE, self.service.clone()),
            (ENV_INDEX, self.index.to_string()),
            (ENV_URL, self.url.to_string()),
            (ENV_CONTROL, self.control.display().to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_the_environment() {
        let settings = Settings {
            service: "cluster".into(),
            index: 3,
            url: "http://localhost:0".parse().unwrap(),
            control: "/run/peregrine.sock".into(),
        };
        let map = settings
            .to_env()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(Settings::from_map(&map).unwrap(), settings);
    }

    #[test]
    fn names_the_missing_variable() {
        let err = Settings::from_map(&HashMap::new()).unwrap_err();
        assert!(err.to_string().contains("PEREGRINE_"), "{err}");
    }
}
