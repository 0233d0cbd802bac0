//! The usual `process_*` metrics of the supervisor itself, from `/proc/self` (the
//! `prometheus-client` crate has no process collector): CPU seconds, resident memory, open file
//! descriptors and their limit, threads, and the start time.

use std::fmt;

use peregrine_contract::procfs;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

/// Reads `/proc/self` at each scrape; a figure that cannot be read is left out.
#[derive(Debug)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let pid = std::process::id();
        let hz = procfs::clock_ticks_per_second() as f64;
        if let Ok(stat) = procfs::stat(pid) {
            let cpu = stat.cpu_ticks() as f64 / hz;
            let family = encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time of the supervisor, in seconds",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(family)?;
            if let Some(start) = start_time_seconds(stat.starttime, hz) {
                gauge(
                    &mut encoder,
                    "process_start_time_seconds",
                    "Start time of the supervisor since the Unix epoch, in seconds",
                    start,
                )?;
            }
        }
        let status = procfs::StatusText::read_self().ok();
        if let Some(rss) = status.as_ref().and_then(|s| s.kib("VmRSS")) {
            gauge(
                &mut encoder,
                "process_resident_memory_bytes",
                "Resident memory of the supervisor, in bytes",
                (rss * 1024) as f64,
            )?;
        }
        if let Some(threads) = status.as_ref().and_then(|s| s.number("Threads")) {
            gauge(
                &mut encoder,
                "process_threads",
                "Threads of the supervisor",
                threads as f64,
            )?;
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            gauge(
                &mut encoder,
                "process_open_fds",
                "Open file descriptors of the supervisor",
                fds.count() as f64,
            )?;
        }
        if let Some(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
            gauge(
                &mut encoder,
                "process_max_fds",
                "The supervisor's limit of open file descriptors",
                limit as f64,
            )?;
        }
        Ok(())
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), fmt::Error> {
    let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(value).encode(family)
}

/// The process's start (`starttime`, in ticks since boot) in seconds since the Unix epoch, from the
/// boot time in `/proc/stat` (`btime`).
fn start_time_seconds(start_ticks: u64, hz: f64) -> Option<f64> {
    let boot = procfs::boot_time().ok()?;
    Some(boot as f64 + start_ticks as f64 / hz)
}
