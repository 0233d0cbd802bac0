//! The HTTP/1 request path, from bytes on the wire to bytes written back: the input is split into the
//! reads a client's segments would make (the first bytes choose the cuts), served on one connection, and
//! the output is checked to be well-formed responses (see `peregrine_worker::fuzzing`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (cuts, input) = data.split_at(data.len().min(4));
    let cuts: Vec<usize> = cuts.iter().map(|&c| usize::from(c) * 7).collect();
    peregrine_worker::fuzzing::http1_connection(input, &cuts);
});
