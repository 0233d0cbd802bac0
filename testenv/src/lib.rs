//! What the xtask and the end-to-end harness (`peregrine-e2e`) agree on, in one place:
//!
//! - [`paths`]: the workspace root, cargo's target directory, and where in a virtualenv
//!   `cargo xtask envoy` finds the Envoy it installed,
//! - [`skips`]: how a test that cannot run here says so, and the variable (`PEREGRINE_SKIPS`)
//!   through which `cargo xtask test` lists the skips at the end of its run.
//!
//! Invariant: std only. The xtask links this crate instead of the harness, so that building the
//! xtask builds neither the harness nor what it links (the worker, tonic, envoy-types, the eBPF
//! crate).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod paths;
pub mod skips;

pub use paths::{target_dir, venv_envoy_binary, workspace_root};
pub use skips::{SKIPS_VAR, current_test, skip};
