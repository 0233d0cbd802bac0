//! A Peregrine worker.
//!
//! A worker binds its own listener, registers it with the supervisor and serves HTTP on io_uring.

pub mod settings;
pub mod url;
