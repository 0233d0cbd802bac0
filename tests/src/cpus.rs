//! Whether this machine's CPUs are free: tests that measure how load is shared between cores (a hog
//! on one, workers pinned to each) mean nothing while other processes keep the cores busy.

use std::time::{Duration, Instant};

/// Busy and total jiffies over all CPUs, from `/proc/stat`'s `cpu` line.
fn jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    let total: u64 = fields.iter().take(8).sum();
    Some((total - idle, total))
}

/// The share of all CPU time spent busy over the next `window` (0.0 to 1.0).
pub fn busy_share(window: Duration) -> f64 {
    let Some((busy0, total0)) = jiffies() else {
        return 0.0;
    };
    std::thread::sleep(window);
    let Some((busy1, total1)) = jiffies() else {
        return 0.0;
    };
    (busy1 - busy0) as f64 / (total1 - total0).max(1) as f64
}

/// Waits, up to `within`, for a 1 s window in which the machine is at most `max_busy` busy; `Err`
/// with the last share seen if none comes.
pub fn wait_for_idle_cpus(max_busy: f64, within: Duration) -> Result<(), f64> {
    let deadline = Instant::now() + within;
    loop {
        let busy = busy_share(Duration::from_secs(1));
        if busy <= max_busy {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(busy);
        }
    }
}
