//! Why a worker was not started or replaced: the causes a rolling restart or reload reports, one
//! variant each, so that callers (and tests) match on what happened rather than on text.

use std::{io, time::Duration};

use super::process::Ending;

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Every lane is taken by a live worker.
    #[error("every counter lane is in use")]
    NoLane,
    /// The process could not be spawned or watched.
    #[error(transparent)]
    Spawn(#[from] io::Error),
}

/// What became of a slot whose replacement failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// The worker that was to be replaced keeps serving.
    OldKeepsServing,
    /// It was stopped first (its successor needed its fixed address); the slot starts again with
    /// backoff.
    RestartWithBackoff,
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Fallback::OldKeepsServing => "the old one keeps serving",
            Fallback::RestartWithBackoff => "the slot is restarted with backoff",
        })
    }
}

/// Why a slot's worker was not replaced.
#[derive(Debug, thiserror::Error)]
pub enum ReplaceError {
    /// The new launch could not be prepared (its program could not be found).
    #[error("cannot prepare")]
    Prepare(#[source] io::Error),
    /// The slot's task is gone.
    #[error("its task has stopped")]
    TaskStopped,
    /// The new worker could not be started.
    #[error("cannot start")]
    Start(#[source] StartError),
    /// The new worker exited before it registered.
    #[error("the new worker ended before registering ({ending}); {fallback}")]
    ExitedBeforeRegistering {
        /// How it ended.
        ending: Ending,
        /// What the slot does instead.
        fallback: Fallback,
    },
    /// The new worker did not register within the register timeout; it was stopped.
    #[error("the new worker did not register within {timeout:?}; {fallback}")]
    RegisterTimeout {
        /// The timeout.
        timeout: Duration,
        /// What the slot does instead.
        fallback: Fallback,
    },
    /// The supervisor began to stop meanwhile.
    #[error("the supervisor is stopping")]
    Stopping,
}
