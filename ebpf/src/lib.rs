//! Peregrine's eBPF sampler: the kernel program (C, CO-RE, in `src/bpf/`, built by `build.rs` with
//! clang) and its loader on aya.
//!
//! [`Probe::load`] loads and attaches the program for a fixed number of worker lanes. The supervisor
//! then [`track`](Probe::track)s each worker's pid in its lane and [`read`](Probe::read)s the lane's
//! totals: on-CPU and run-queue wait nanoseconds of the worker and every process it forks, summed over
//! CPUs from a memory-mapped map, so a read costs no syscall. The shared request counter lanes live in
//! an mmapable map too ([`Probe::counters`]): there the kernel counts the sends of a server that
//! cannot count its own requests, on the listener it was passed ([`Probe::count_sends`]). A worker
//! that counts its own gets a memfd of its own instead (`peregrine_contract::report_slot`).

mod layout;
mod probe;

pub use layout::{Cell, Counter, Descendants, LINE, Tracked};
pub use probe::{Error, MAX_DESCENDANTS, Probe, SchedTotals, SendHook, SendsError};

mod object {
    include!(concat!(env!("OUT_DIR"), "/object.rs"));
}

/// The compiled kernel program, or why this build has none (for example: clang was missing).
pub fn object() -> Result<&'static [u8], &'static str> {
    object::OBJECT
}
