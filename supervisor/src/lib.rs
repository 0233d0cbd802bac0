//! The Peregrine supervisor.
//!
//! It reads `peregrine.toml` ([`config`]), starts and restarts worker processes ([`manager`]), accepts
//! their registrations over a Unix socket ([`registration`]), keeps the one source of truth about them
//! ([`registry`]) and serves it to Envoy over gRPC as CDS/EDS/ADS ([`xds`]). [`bootstrap`] writes an
//! Envoy bootstrap that points at it.

pub mod bootstrap;
pub mod config;
pub mod manager;
pub mod registration;
pub mod registry;
pub mod xds;
