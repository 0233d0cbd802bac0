//! The layouts shared with the kernel program, mirrored from `src/bpf/sampler.h`. The asserts fail the
//! build if either side changes alone.

use std::mem::{offset_of, size_of};

/// `struct peregrine_cell`: one worker slot's scheduler totals as seen by one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Cell {
    /// The process these totals belong to.
    pub tgid: u32,
    _pad: u32,
    /// Nanoseconds on a CPU.
    pub on_cpu_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    pub runq_wait_ns: u64,
    _reserved: [u64; 5],
}

/// `struct peregrine_counter`: one worker slot's request counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Counter {
    /// Requests served by the slot's current worker.
    pub requests: u64,
    _reserved: [u64; 7],
}

/// `PEREGRINE_LINE`: every shared entry is one cache line.
pub const LINE: usize = 64;

const _: () = assert!(size_of::<Cell>() == LINE);
const _: () = assert!(offset_of!(Cell, tgid) == 0);
const _: () = assert!(offset_of!(Cell, on_cpu_ns) == 8);
const _: () = assert!(offset_of!(Cell, runq_wait_ns) == 16);
const _: () = assert!(size_of::<Counter>() == LINE);
const _: () = assert!(offset_of!(Counter, requests) == 0);
