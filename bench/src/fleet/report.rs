//! The report: the set-up, a table per phase with its spread (the scale phase's in [`scale`]), the
//! goals checked against the figures, and the machine's load per phase; printed and written to
//! `out/fleet.md`. The
//! propagation latencies also go to `out/fleet-propagation.csv`, plotted (matplotlib, [`plot`]) as
//! their distributions into `out/fleet-propagation.svg`.
//!
//! [`plot`]: crate::plot

use std::{fmt::Write as _, path::Path, process::Command, time::Duration};

use anyhow::Context;

use super::{
    ENVOY_HOSTS, Options, Results,
    loss::{Loss, MARGIN, TTL},
    metrics::{Disk, Histogram},
    noise::Load,
    propagation::{Kill, Propagation},
};
use crate::{
    machine::{cpu_line, machine_lines},
    plot,
    table::{format_duration, markdown, median},
};

mod scale;

/// The goal for a change to reach every Envoy (p99).
const PROPAGATION_GOAL_MS: f64 = 100.0;
/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("plot.py");

/// What the report says of the set-up, beside the options.
#[derive(Debug)]
pub(super) struct Setting {
    pub(super) command: String,
    pub(super) elapsed: Duration,
    pub(super) envoy_version: Option<String>,
    pub(super) etcd_version: String,
}

/// `etcd --version`'s first line (`etcd Version: 3.4.23`).
pub(super) fn etcd_version() -> anyhow::Result<String> {
    let etcd = peregrine_e2e::etcd_path().context("no etcd binary")?;
    let output = Command::new(&etcd)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", etcd.display()))?;
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .next()
        .unwrap_or("etcd ?")
        .trim()
        .to_owned())
}

/// The value at quantile `q` (nearest rank: with 50 values, p99 is the largest).
pub(super) fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied().unwrap_or(f64::NAN)
}

pub(super) fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::NAN, f64::max)
}

pub(super) fn min(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::NAN, f64::min)
}

/// Milliseconds as a duration cell.
pub(super) fn ms_cell(value: f64) -> String {
    if value.is_nan() {
        return "-".into();
    }
    if value < 0.0 {
        return format!("-{}", ms_cell(-value));
    }
    format_duration(Duration::from_secs_f64(value / 1e3))
}

/// What etcd's disk did during a phase: per member, the WAL fsyncs and backend commits, the slowest
/// bucket and how many took over 64 ms.
fn disk_line(phase: &str, disk: &Disk) -> String {
    let describe = |histograms: &[Histogram]| {
        histograms
            .iter()
            .map(|h| {
                format!(
                    "{:.0} (slowest <= {}, {:.0} over 64 ms)",
                    h.count(),
                    h.slowest().map_or("-".into(), |s| ms_cell(s * 1e3)),
                    h.above(0.064)
                )
            })
            .collect::<Vec<_>>()
            .join(" / ")
    };
    format!(
        "etcd's disk during {phase}, per member: WAL fsyncs {}; backend commits {}.",
        describe(&disk.wal_fsync),
        describe(&disk.backend_commit)
    )
}

pub(super) fn load_line(phase: &str, load: &Load) -> String {
    format!(
        "{phase}: machine busy {:.2} of 2 cores, {:.2} of them other work than the benchmark's; load average {:.2}",
        load.machine, load.others, load.load1
    )
}

/// Prints the report and writes it and the propagation series into `out`.
pub(super) fn write(
    out: &Path,
    options: &Options,
    setting: &Setting,
    results: &Results,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut report = String::new();
    writeln!(
        report,
        "Command: `{}` ({:.0?} in all)",
        setting.command, setting.elapsed
    )?;
    machine_lines(&mut report, &cpu_line()?)?;
    if let Some(envoy) = &setting.envoy_version {
        writeln!(report, "Envoy: {envoy}")?;
    }
    writeln!(
        report,
        "etcd: {} ({} member{} on loopback, data in a temporary directory)",
        setting.etcd_version,
        options.etcd_members,
        if options.etcd_members == 1 { "" } else { "s" }
    )?;
    let mut goals = Vec::new();
    if let Some(phase) = &results.propagation {
        report.push('\n');
        report.push_str(&propagation_section(
            &phase.measured,
            options,
            &phase.load,
            &mut goals,
        )?);
        writeln!(report, "{}", disk_line("propagation", &phase.disk))?;
        match write_series(out, &phase.measured.kills) {
            Ok(svg) => eprintln!("plot: {}", svg.display()),
            Err(error) => eprintln!("warning: no plot: {error:#}"),
        }
    }
    if let Some(phase) = &results.losses {
        report.push('\n');
        report.push_str(&loss_section(&phase.measured, &phase.load, &mut goals)?);
        writeln!(report, "{}", disk_line("host loss", &phase.disk))?;
    }
    if let Some(scale) = &results.scale {
        report.push('\n');
        let small = results.propagation.as_ref().map(|p| &p.measured);
        report.push_str(&scale::section(scale, small, options, &mut goals)?);
        writeln!(
            report,
            "{}",
            disk_line("the scale changes", &scale.change_disk)
        )?;
    }
    if !goals.is_empty() {
        writeln!(report, "\nGoals:")?;
        for goal in &goals {
            writeln!(report, "- {goal}")?;
        }
    }
    println!("{report}");
    let path = out.join("fleet.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("report: {}", path.display());
    Ok(())
}

/// One measure of a kill, in ms.
type Measure = fn(&Kill) -> f64;

/// The propagation measures, by row: label and value per kill.
fn propagation_rows() -> [(&'static str, Measure); 10] {
    [
        (
            "(exit noticed: SIGKILL -> `Worker exited` logged)",
            Kill::exit_noticed,
        ),
        ("exit: SIGKILL -> its host's own Envoy", Kill::exit_own),
        (
            "exit: SIGKILL -> etcd's watch event (the benchmark's watcher)",
            Kill::exit_etcd,
        ),
        (
            "exit: SIGKILL -> every other host's registry (etcd)",
            Kill::exit_remote_registries,
        ),
        ("exit: SIGKILL -> every Envoy", Kill::exit_everywhere),
        (
            "registration -> its host's own Envoy",
            Kill::registration_own,
        ),
        (
            "registration -> etcd's watch event (the benchmark's watcher)",
            Kill::registration_etcd,
        ),
        (
            "registration -> every other host's registry (etcd)",
            Kill::registration_remote_registries,
        ),
        ("registration -> every Envoy", Kill::registration_everywhere),
        (
            "(restart: SIGKILL -> registration, 100 ms backoff)",
            Kill::restart,
        ),
    ]
}

fn propagation_section(
    propagation: &Propagation,
    options: &Options,
    load: &Load,
    goals: &mut Vec<String>,
) -> anyhow::Result<String> {
    let kills = &propagation.kills;
    let mut out = String::new();
    let resolutions: Vec<f64> = kills
        .iter()
        .flat_map(Kill::resolutions)
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    writeln!(
        out,
        "Propagation: {} workers killed on {ENVOY_HOSTS} hosts of {} workers (in turn), each an exit and a registration; every Envoy's admin `/clusters` polled every {} ms (measured between answers: median {:.1} ms, p99 {:.1} ms)",
        kills.len(),
        options.fleet_workers,
        options.poll.as_millis(),
        median(resolutions.clone()),
        quantile(&resolutions, 0.99),
    )?;
    writeln!(out, "{}\n", load_line("During propagation", load))?;
    let mut rows = vec![[
        "worker change -> seen by".to_string(),
        "n".into(),
        "p50".into(),
        "p99".into(),
        "max".into(),
    ]];
    for (label, measure) in propagation_rows() {
        let values: Vec<f64> = kills.iter().map(measure).filter(|v| !v.is_nan()).collect();
        rows.push([
            label.to_string(),
            values.len().to_string(),
            ms_cell(quantile(&values, 0.5)),
            ms_cell(quantile(&values, 0.99)),
            ms_cell(max(&values)),
        ]);
    }
    out.push_str(&markdown(&rows, 1));
    let cpu = &propagation.cpu_per_kill_ms;
    writeln!(
        out,
        "\nCPU per kill (two worker changes) per supervisor: median {:.2} ms, max {:.2} ms (on-CPU time from schedstat, Envoy serving included)",
        median(cpu.clone()),
        max(cpu)
    )?;
    for (label, measure) in [
        ("exit", Kill::exit_everywhere as Measure),
        ("registration", Kill::registration_everywhere),
    ] {
        let values: Vec<f64> = kills.iter().map(measure).collect();
        let p99 = quantile(&values, 0.99);
        goals.push(format!(
            "propagation ({label} -> every Envoy), p99 < {PROPAGATION_GOAL_MS:.0} ms: {} ({} over {} changes)",
            if p99 < PROPAGATION_GOAL_MS { "met" } else { "**not met**" },
            ms_cell(p99),
            values.len()
        ));
    }
    Ok(out)
}

fn loss_section(losses: &[Loss], load: &Load, goals: &mut Vec<String>) -> anyhow::Result<String> {
    let mut out = String::new();
    writeln!(
        out,
        "Host loss: {} times a host's supervisor and workers SIGKILLed (the {ENVOY_HOSTS} hosts in turn), lease TTL {} s (the default), then the host started again",
        losses.len(),
        TTL.as_secs()
    )?;
    writeln!(out, "{}\n", load_line("During host loss", load))?;
    let mut rows = vec![[
        "host loss -> seen by".to_string(),
        "n".into(),
        "median".into(),
        "min".into(),
        "max".into(),
    ]];
    let everywhere: Vec<f64> = losses.iter().map(Loss::everywhere).collect();
    for (label, values) in [
        (
            "SIGKILL -> every other host's registry without it",
            losses.iter().map(Loss::registries_ms).collect::<Vec<_>>(),
        ),
        (
            "SIGKILL -> every other Envoy without it",
            everywhere.clone(),
        ),
        (
            "(restart -> every Envoy holds it again)",
            losses.iter().map(|l| l.rejoined_ms).collect(),
        ),
    ] {
        rows.push([
            label.to_string(),
            values.len().to_string(),
            ms_cell(median(values.clone())),
            ms_cell(min(&values)),
            ms_cell(max(&values)),
        ]);
    }
    out.push_str(&markdown(&rows, 1));
    writeln!(
        out,
        "\nEach loss (host: SIGKILL -> every other Envoy): {}",
        losses
            .iter()
            .map(|l| format!("h{} {}", l.host, ms_cell(l.everywhere())))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    let goal = (TTL + MARGIN).as_secs_f64() * 1e3;
    goals.push(format!(
        "host loss within the lease TTL + {} ms ({}): {} (median {}, max {} over {} losses)",
        MARGIN.as_millis(),
        ms_cell(goal),
        if max(&everywhere) <= goal {
            "met"
        } else {
            "**not met**"
        },
        ms_cell(median(everywhere.clone())),
        ms_cell(max(&everywhere)),
        everywhere.len()
    ));
    Ok(out)
}

/// Milliseconds for the CSV: empty when not measured.
fn csv_ms(value: f64) -> String {
    if value.is_nan() {
        String::new()
    } else {
        format!("{value:.3}")
    }
}

/// Writes `out/fleet-propagation.csv` and plots it into `out/fleet-propagation.svg`.
fn write_series(out: &Path, kills: &[Kill]) -> anyhow::Result<std::path::PathBuf> {
    let csv = out.join("fleet-propagation.csv");
    let mut text = String::from(
        "change,host,exit_own_ms,exit_registries_ms,exit_everywhere_ms,registration_own_ms,registration_registries_ms,registration_everywhere_ms,restart_ms,exit_etcd_ms,registration_etcd_ms\n",
    );
    for (i, kill) in kills.iter().enumerate() {
        writeln!(
            text,
            "{i},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{},{}",
            kill.host,
            kill.exit_own(),
            kill.exit_remote_registries(),
            kill.exit_everywhere(),
            kill.registration_own(),
            kill.registration_remote_registries(),
            kill.registration_everywhere(),
            kill.restart(),
            csv_ms(kill.exit_etcd()),
            csv_ms(kill.registration_etcd()),
        )?;
    }
    std::fs::write(&csv, text).with_context(|| format!("writing {}", csv.display()))?;
    let svg = out.join("fleet-propagation.svg");
    plot::run(
        out,
        "fleet-plot.py",
        PLOT_SCRIPT,
        [csv.as_os_str(), svg.as_os_str()],
    )?;
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let values: Vec<f64> = (1..=50).map(f64::from).collect();
        assert_eq!(quantile(&values, 0.5), 25.0);
        assert_eq!(quantile(&values, 0.99), 50.0);
        let values: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(quantile(&values, 0.99), 198.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }

    #[test]
    fn formats_milliseconds() {
        assert_eq!(ms_cell(12.345), "12.3 ms");
        assert_eq!(ms_cell(3210.0), "3.21 s");
        assert_eq!(ms_cell(-1.5), "-1.50 ms");
        assert_eq!(ms_cell(f64::NAN), "-");
    }
}
