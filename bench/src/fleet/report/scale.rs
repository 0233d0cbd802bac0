//! The scale phase in the report: per supervisor (RSS, CPU idle and per change, view changes), etcd
//! per change (writes, watch events), and the new supervisor's sync.

use std::fmt::Write as _;

use super::{load_line, max, min, ms_cell};
use crate::{
    fleet::{
        ENVOY_HOSTS, Options,
        propagation::{Propagation, ms},
        scale::Scale,
    },
    table::{markdown, median},
};

fn spread(values: &[f64], unit: impl Fn(f64) -> String) -> (String, String, String) {
    (
        unit(median(values.to_vec())),
        unit(min(values)),
        unit(max(values)),
    )
}

/// The scale phase's tables and lines; its goals go into `goals`.
pub(super) fn section(
    scale: &Scale,
    small: Option<&Propagation>,
    options: &Options,
    goals: &mut Vec<String>,
) -> anyhow::Result<String> {
    let mut out = String::new();
    let n = scale.hosts;
    let kills = scale.kills.len() as f64;
    writeln!(
        out,
        "Scale: {n} supervisors x {} workers ({} workers), sampler off, no Envoy; {} workers killed one after another (each an exit and a registration)",
        scale.workers,
        n * scale.workers as usize,
        scale.kills.len()
    )?;
    for (phase, load) in [
        ("Bring-up", &scale.bring_up_noise),
        ("Idle", &scale.idle_noise),
        ("Changes", &scale.change_noise),
    ] {
        writeln!(out, "{}", load_line(phase, load))?;
    }
    writeln!(out)?;
    let mib = |kib: f64| format!("{:.1} MiB", kib / 1024.0);
    let msps = |v: f64| format!("{v:.2} ms/s");
    let msv = |v: f64| format!("{v:.2} ms");
    let count = |v: f64| format!("{v:.2}");
    let mut rows = vec![[
        "per supervisor".to_string(),
        "median".into(),
        "min".into(),
        "max".into(),
    ]];
    let mut row = |label: &str, (a, b, c): (String, String, String)| {
        rows.push([label.to_string(), a, b, c]);
    };
    row("RSS, fleet whole and idle", spread(&scale.rss_kib, mib));
    row("peak RSS (VmHWM)", spread(&scale.peak_rss_kib, mib));
    row(
        "CPU, idle (on-CPU time per second)",
        spread(&scale.idle_cpu_ms_per_s, msps),
    );
    row(
        "CPU per kill beyond idle (two worker changes)",
        spread(&scale.cpu_per_kill_ms, msv),
    );
    row(
        "view changes per remote kill (`Fleet view changed`)",
        spread(&scale.views_per_kill, count),
    );
    row(
        "view changes during the bring-up",
        spread(&scale.bring_up_views, |v| format!("{v:.0}")),
    );
    out.push_str(&markdown(&rows, 1));
    writeln!(
        out,
        "\nWorkers (host s0's {}): RSS median {}. etcd, per member: RSS {}, CPU idle {}, CPU per kill beyond idle {}.",
        scale.worker_rss_kib.len(),
        mib(median(scale.worker_rss_kib.clone())),
        join(&scale.etcd_rss_kib, mib),
        join(&scale.etcd_idle_cpu_ms_per_s, msps),
        join(&scale.etcd_cpu_per_kill_ms, msv),
    )?;
    let fleet_wide: f64 = scale.cpu_per_kill_ms.iter().sum::<f64>() / 2.0;
    writeln!(
        out,
        "All {n} supervisors together: {:.0} ms of CPU per worker change ({:.2} ms per supervisor per change, {:.1} µs per remote worker it holds).",
        fleet_wide,
        fleet_wide / n as f64,
        fleet_wide / n as f64 * 1e3 / ((n - 1) * scale.workers as usize) as f64,
    )?;
    if let Some(small) = small {
        writeln!(
            out,
            "For comparison, in the fleet of {ENVOY_HOSTS} x {} (with an Envoy each): CPU per kill per supervisor median {:.2} ms.",
            options.fleet_workers,
            median(small.cpu_per_kill_ms.clone())
        )?;
    }

    let e = &scale.change_etcd;
    let writes = e.revision;
    writeln!(
        out,
        "\netcd over the {} kills ({:.1} s; {} watchers):\n",
        scale.kills.len(),
        scale.change_s,
        e.watchers
    )?;
    let idle = &scale.idle_etcd;
    let per = |v: f64| format!("{:.2}", v / kills);
    let idle_per = |v: f64| format!("{:.2}", v / scale.idle_s * scale.change_s / kills);
    let mut rows = vec![[
        "etcd counter".to_string(),
        "per kill".into(),
        "per kill, idle rate only".into(),
        "total".into(),
    ]];
    for (label, value, idle_value) in [
        ("revisions (write transactions)", e.revision, idle.revision),
        ("keys put (`etcd_mvcc_put_total`)", e.puts, idle.puts),
        (
            "keys deleted (`etcd_mvcc_delete_total`)",
            e.deletes,
            idle.deletes,
        ),
        (
            "txns of more than one operation (`etcd_mvcc_txn_total`)",
            e.txns,
            idle.txns,
        ),
        (
            "raft proposals (`etcd_server_proposals_committed_total`)",
            e.proposals,
            idle.proposals,
        ),
        (
            "watch events sent (`etcd_debugging_mvcc_events_total`)",
            e.events,
            idle.events,
        ),
        ("ranges (`etcd_mvcc_range_total`)", e.ranges, idle.ranges),
    ] {
        rows.push([
            label.to_string(),
            per(value),
            idle_per(idle_value),
            format!("{value:.0}"),
        ]);
    }
    out.push_str(&markdown(&rows, 1));
    let events_per_write_per_watcher = e.events / writes.max(1.0) / e.watchers.max(1.0);
    writeln!(
        out,
        "\nPer worker change (a kill is two: the exit's delete and the replacement's put): {:.2} revisions, {:.2} watch events per supervisor.",
        writes / (2.0 * kills),
        events_per_write_per_watcher * writes / (2.0 * kills),
    )?;
    let registration: Vec<f64> = scale
        .kills
        .iter()
        .map(|k| ms(k.registered, k.added_everywhere))
        .collect();
    let exit: Vec<f64> = scale
        .kills
        .iter()
        .map(|k| ms(k.killed, k.removed_everywhere))
        .collect();
    writeln!(
        out,
        "In every other registry: exit (from SIGKILL) median {}, max {}; registration median {}, max {}.",
        ms_cell(median(exit.clone())),
        ms_cell(max(&exit)),
        ms_cell(median(registration.clone())),
        ms_cell(max(&registration)),
    )?;
    let s = &scale.sync;
    writeln!(
        out,
        "\nBring-up: every supervisor held the whole fleet {:.1} s after the first started.\nSync of one more supervisor (the {}), from its start: its registry held all {} remote workers after {} (`Fleet view changed`; `Joined the fleet` at {}), `peregrine status --json` listed them after {} (polled; one call took {}), and every other supervisor held its workers after {}.",
        scale.bring_up_s,
        ordinal(n + 1),
        n * scale.workers as usize,
        ms_cell(s.view_ms),
        ms_cell(s.joined_ms),
        ms_cell(s.status_ms),
        ms_cell(s.status_call_ms),
        ms_cell(s.everywhere_ms),
    )?;
    let per_change = writes / (2.0 * kills);
    goals.push(format!(
        "O(1) etcd writes per worker change: {} ({per_change:.2} revisions per change at {n} hosts)",
        if per_change <= 1.05 { "met" } else { "**not met**" },
    ));
    let events = events_per_write_per_watcher;
    goals.push(format!(
        "one watch event per supervisor per change: {} ({events:.2})",
        if events <= 1.05 { "met" } else { "**not met**" },
    ));
    Ok(out)
}

/// `1st`, `2nd`, `3rd`, `4th`, ..., `11th`, ..., `51st`.
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

fn join(values: &[f64], unit: impl Fn(f64) -> String) -> String {
    values
        .iter()
        .map(|v| unit(*v))
        .collect::<Vec<_>>()
        .join(" / ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals() {
        let names: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 51, 112].map(ordinal).to_vec();
        assert_eq!(
            names,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "51st", "112th"
            ]
        );
    }
}
