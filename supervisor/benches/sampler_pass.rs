//! The cost of one sample pass (reading every tracked worker's scheduler totals, as the sampling loop
//! does each tick) with the eBPF and the procfs sources, for 8, 64 and 512 tracked processes.
//!
//! Run by `cargo xtask bench sampler` (or `cargo bench -p peregrine-supervisor --bench sampler_pass`);
//! needs root for the eBPF source. The tracked processes are idle `sleep`s (one thread each, which is
//! the cheapest case for procfs, so the ratio is a lower bound).

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use peregrine_supervisor::sampler::{SchedSource, ebpf::EbpfSource, procfs::ProcfsSource};

const SIZES: [usize; 3] = [8, 64, 512];

struct Sleepers(Vec<Child>);

impl Drop for Sleepers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
        }
        for child in &mut self.0 {
            let _ = child.wait();
        }
    }
}

/// The median time of `passes` passes of `source.read` over every (slot, pid).
fn pass(source: &mut dyn SchedSource, pids: &[u32], passes: usize) -> Duration {
    let mut times = Vec::with_capacity(passes);
    for _ in 0..passes {
        let start = Instant::now();
        for (slot, &pid) in pids.iter().enumerate() {
            std::hint::black_box(source.read(slot, pid).expect("read a live process"));
        }
        times.push(start.elapsed());
    }
    times.sort();
    times[times.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let largest = *SIZES.iter().max().unwrap();
    let sleepers = Sleepers(
        (0..largest)
            .map(|_| {
                Command::new("sleep")
                    .arg("600")
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("spawn sleep")
            })
            .collect(),
    );
    let pids: Vec<u32> = sleepers.0.iter().map(Child::id).collect();
    let mut ebpf = match EbpfSource::load(largest) {
        Ok((source, _counters)) => Some(source),
        Err(error) => {
            eprintln!("the eBPF source cannot load ({error}); measuring procfs only");
            None
        }
    };
    let mut procfs = ProcfsSource::new();
    println!("| tracked processes | eBPF pass | procfs pass | procfs / eBPF |");
    println!("|------------------:|----------:|------------:|--------------:|");
    for n in SIZES {
        let pids = &pids[..n];
        for (slot, &pid) in pids.iter().enumerate() {
            procfs.track(slot, pid).expect("track with procfs");
            if let Some(ebpf) = ebpf.as_mut() {
                ebpf.track(slot, pid).expect("track with eBPF");
            }
        }
        let procfs_pass = pass(&mut procfs, pids, 21);
        let ebpf_pass = ebpf.as_mut().map(|e| pass(e, pids, 201));
        println!(
            "| {n} | {} | {:.1} µs | {} |",
            ebpf_pass.map_or("-".into(), |d| format!("{:.1} µs", micros(d))),
            micros(procfs_pass),
            ebpf_pass.map_or("-".into(), |d| format!(
                "{:.0}x",
                procfs_pass.as_secs_f64() / d.as_secs_f64()
            )),
        );
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
