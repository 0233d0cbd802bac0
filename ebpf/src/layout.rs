//! The layouts shared with the kernel program, mirrored from `src/bpf/sampler.h`. The asserts fail the
//! build if either side changes alone. The request counter's layout has its one home in
//! [`peregrine_contract::counters`] (the worker and the supervisor map it too); it is asserted here
//! against the header's.

use std::mem::{offset_of, size_of};

/// `struct peregrine_tracked`: a value of map `tracked` (key: the tgid), the lane a process is
/// accounted to and its root, the process the supervisor tracked (a root names itself).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tracked {
    /// The lane.
    pub lane: u32,
    /// The root's tgid.
    pub root: u32,
}

// SAFETY: `#[repr(C)]`, two `u32`s, no padding: every bit pattern is a valid value.
unsafe impl aya::Pod for Tracked {}

/// `struct peregrine_descendants`: how many entries of `tracked` are descendants'.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Descendants {
    /// The entries.
    pub entries: u64,
    _reserved: [u64; 7],
}

/// `struct peregrine_cell`: one worker lane's scheduler totals as seen by one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Cell {
    /// The root whose totals these are (its descendants' time included).
    pub tgid: u32,
    _pad: u32,
    /// Nanoseconds on a CPU.
    pub on_cpu_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    pub runq_wait_ns: u64,
    _reserved: [u64; 5],
}

/// `struct peregrine_counter`: one lane's request counter; defined with the counters' layout.
pub use peregrine_contract::counters::Counter;
/// `PEREGRINE_LINE`: every shared entry is one cache line, the request counters' too.
pub use peregrine_contract::counters::LINE;

const _: () = assert!(size_of::<Tracked>() == 8);
const _: () = assert!(offset_of!(Tracked, lane) == 0);
const _: () = assert!(offset_of!(Tracked, root) == 4);
const _: () = assert!(size_of::<Descendants>() == LINE);
const _: () = assert!(offset_of!(Descendants, entries) == 0);
const _: () = assert!(size_of::<Cell>() == LINE);
const _: () = assert!(offset_of!(Cell, tgid) == 0);
const _: () = assert!(offset_of!(Cell, on_cpu_ns) == 8);
const _: () = assert!(offset_of!(Cell, runq_wait_ns) == 16);
const _: () = assert!(size_of::<Counter>() == LINE);
const _: () = assert!(offset_of!(Counter, requests) == 0);
const _: () = assert!(offset_of!(Counter, in_flight) == 8);
const _: () = assert!(offset_of!(Counter, features) == 16);
