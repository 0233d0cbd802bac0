//! What the supervisor, its workers and its kernel program agree on, in one place.
//!
//! - [`settings`]: the environment a supervisor starts a worker with (the names are the contract),
//! - [`url`]: the bind url of a worker's own listener,
//! - [`counters`]: the request counters' layout and region, over [`shm`], the one checked `mmap`,
//! - [`report_slot`]: a worker's latest load report (in-band ORCA), in its own counter region,
//! - [`rings`]: the size of a worker's io_uring, and the locked memory it costs the worker's user,
//! - [`procfs`]: the kernel's accounting of a process as procfs shows it, read one way by every part,
//! - [`ErrorChain`]: an error and its causes on one line, printed one way by every part.
//!
//! Invariant: this crate knows no runtime, no HTTP and no xDS; it depends on std, `rustix` and
//! `thiserror` only, so that linking it pulls nothing of one part into another.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod counters;
mod error_chain;
pub mod procfs;
pub mod report_slot;
pub mod rings;
pub mod settings;
#[allow(unsafe_code, reason = "maps shared memory; each use has a SAFETY line")]
pub mod shm;
pub mod url;

pub use error_chain::ErrorChain;
