//! The timeline's figures: per run, the p99 of each [`WINDOW`], the steady p99, the settle time and
//! the failures; per event and set-up, their medians and spread over the rounds; the report
//! (`target/bench/balance-timeline.md`), the series (`balance-timeline.csv`) and the plot
//! (`balance-timeline.png`).

use std::{fmt::Write as _, time::Duration};

use anyhow::Context;

use super::{
    BURST_FACTOR, CLIENTS, CPU_MS, EVENT_AT, Event, LENGTH, RATE, STEADY_FROM, Timeline, VARIANTS,
    WINDOW,
};
use crate::{
    balance::{
        measure::percentile,
        openloop::{Answer, Record},
    },
    machine::machine_lines,
    plot,
    table::{format_duration, markdown, median},
};
use peregrine_e2e::target_dir;

/// The plot's script.
const PLOT_SCRIPT: &str = include_str!("plot.py");
/// The cold start's goal window and goal.
const COLD_WINDOW: Duration = Duration::from_secs(10);
const COLD_GOAL: Duration = Duration::from_millis(100);
/// The settle goal: back within [`SETTLE_FACTOR`] times the steady p99 in this long.
const SETTLE_GOAL: Duration = Duration::from_secs(1);
const SETTLE_FACTOR: u32 = 2;
/// The span each p99 of the settle time is taken over.
const SECOND: Duration = Duration::from_secs(1);

/// What one run's requests say.
#[derive(Clone, Debug)]
pub(super) struct Figures {
    /// The p99 of each window by scheduled time, from 0; `None` where it falls on a failure.
    pub(super) windows: Vec<Option<Duration>>,
    /// The p99 of the requests scheduled from [`STEADY_FROM`] on.
    pub(super) steady: Option<Duration>,
    /// The p99 of those scheduled in the 4 s before the event (transitions only).
    pub(super) before: Option<Duration>,
    /// The p99 of the first [`COLD_WINDOW`], and of each of its seconds.
    pub(super) first: Option<Duration>,
    pub(super) seconds: Vec<Option<Duration>>,
    /// The worst window from the event on.
    pub(super) peak: Option<Duration>,
    /// From the event's end until every second (a span of 1 s starting at any window) has a p99
    /// within twice the steady p99 (zero if all did); `None` when there is no steady p99.
    pub(super) settle: Option<Duration>,
    /// Requests without a worker's answer.
    pub(super) failed: usize,
    /// Worker 0's share of the answers after the event has settled (from [`STEADY_FROM`]).
    pub(super) share0: f64,
    /// From the load's start to Envoy's first weights that favour worker 1 (worker 0's weight
    /// share below 45%): when the hog starts to count.
    pub(super) weighted_after: Option<Duration>,
    /// The windows over twice the steady p99 from a second after the event on (spikes), and how
    /// many of them had hypervisor steal on a CPU in the same window or the one before.
    pub(super) spikes: usize,
    pub(super) spikes_with_steal: usize,
    /// The requests over twice the steady p99 in those windows, by the worker that answered them.
    pub(super) spike_requests: [usize; 2],
    /// Steal on both CPUs over the run.
    pub(super) steal: Duration,
}

pub(super) fn figures(timeline: &Timeline) -> Figures {
    let records = &timeline.records;
    let within = |from: Duration, to: Duration| -> Vec<Record> {
        records
            .iter()
            .filter(|r| r.scheduled >= from && r.scheduled < to)
            .copied()
            .collect()
    };
    let p99 = |from: Duration, to: Duration| percentile(&within(from, to), 0.99);
    let count = LENGTH.as_millis().div_ceil(WINDOW.as_millis()) as u32;
    let windows: Vec<Option<Duration>> = (0..count)
        .map(|k| p99(WINDOW * k, WINDOW * (k + 1)))
        .collect();
    let steady = p99(STEADY_FROM, LENGTH);
    let event = timeline.event;
    let over = timeline.over;
    let first_after = (event.at().as_millis() / WINDOW.as_millis()) as usize;
    let peak = windows[first_after.min(windows.len())..]
        .iter()
        .copied()
        .max_by_key(|w| w.map_or((1, Duration::ZERO), |d| (0, d)))
        .flatten();
    // The first window start from which every second's p99 is within the limit.
    let settle = steady.map(|steady| {
        let limit = steady * SETTLE_FACTOR;
        let steps = (LENGTH - SECOND).as_millis() / WINDOW.as_millis();
        let over_limit = |k: u32| {
            let from = WINDOW * k;
            p99(from, from + SECOND).is_none_or(|p| p > limit)
        };
        let last_bad = (0..=steps as u32)
            .filter(|&k| WINDOW * k + WINDOW > over)
            .filter(|&k| over_limit(k))
            .max();
        last_bad.map_or(Duration::ZERO, |k| (WINDOW * (k + 1)).saturating_sub(over))
    });
    let failed = records
        .iter()
        .filter(|r| !matches!(r.answer, Answer::Worker(_)))
        .count();
    let index_of = |pid: u32| {
        timeline
            .pids
            .iter()
            .find(|(p, _)| *p == pid)
            .map(|(_, index)| *index)
    };
    let after = within(STEADY_FROM, LENGTH);
    let answered: Vec<usize> = after
        .iter()
        .filter_map(|r| match r.answer {
            Answer::Worker(pid) => index_of(pid),
            _ => None,
        })
        .collect();
    let share0 = answered.iter().filter(|&&i| i == 0).count() as f64 / answered.len().max(1) as f64;
    let weighted_after = timeline
        .weights
        .iter()
        .find(|(_, w)| match w {
            [Some(w0), Some(w1)] => (*w0 as f64) < 0.45 * (*w0 + *w1) as f64,
            _ => false,
        })
        .map(|(t, _)| *t);
    let (spikes, spikes_with_steal) = steady.map_or((Vec::new(), 0), |steady| {
        let limit = steady * SETTLE_FACTOR;
        let spiking: Vec<usize> = windows
            .iter()
            .enumerate()
            .filter(|(k, w)| WINDOW * *k as u32 >= over + SECOND && w.is_none_or(|w| w > limit))
            .map(|(k, _)| k)
            .collect();
        let with_steal = spiking
            .iter()
            .filter(|&&k| {
                let from = (WINDOW * k as u32).saturating_sub(WINDOW);
                steal_within(timeline, from, WINDOW * (k as u32 + 1)) > Duration::ZERO
            })
            .count();
        (spiking, with_steal)
    });
    let spike_requests = steady.map_or([0, 0], |steady| {
        let mut by_worker = [0; 2];
        for k in &spikes {
            let from = WINDOW * *k as u32;
            for record in within(from, from + WINDOW) {
                if let Answer::Worker(pid) = record.answer
                    && record.latency() > steady * SETTLE_FACTOR
                    && let Some(index) = index_of(pid)
                {
                    by_worker[index.min(1)] += 1;
                }
            }
        }
        by_worker
    });
    let spikes = spikes.len();
    let steal = steal_within(timeline, Duration::ZERO, LENGTH + SECOND);
    Figures {
        spikes,
        spikes_with_steal,
        spike_requests,
        steal,
        windows,
        steady,
        before: (event != Event::ColdStart)
            .then(|| p99(EVENT_AT - Duration::from_secs(4), EVENT_AT))
            .flatten(),
        first: (event == Event::ColdStart)
            .then(|| p99(Duration::ZERO, COLD_WINDOW))
            .flatten(),
        seconds: (0..COLD_WINDOW.as_secs() as u32)
            .map(|s| {
                p99(
                    Duration::from_secs(s.into()),
                    Duration::from_secs(u64::from(s) + 1),
                )
            })
            .collect(),
        peak,
        settle,
        failed,
        share0,
        weighted_after,
    }
}

/// The steal on both CPUs between the monitor's last sample at or before `from` and its first at or
/// after `to` (so a little more than the span, never less).
fn steal_within(timeline: &Timeline, from: Duration, to: Duration) -> Duration {
    let before = timeline.steal.iter().rev().find(|(t, _)| *t <= from);
    let after = timeline.steal.iter().find(|(t, _)| *t >= to);
    let (Some((_, before)), Some((_, after))) = (
        before.or(timeline.steal.first()),
        after.or(timeline.steal.last()),
    ) else {
        return Duration::ZERO;
    };
    let ticks: u64 = (0..2)
        .map(|cpu| after[cpu].saturating_sub(before[cpu]))
        .sum();
    Duration::from_secs_f64(
        ticks as f64 / peregrine_contract::procfs::clock_ticks_per_second() as f64,
    )
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "failed".to_owned(), format_duration)
}

/// One line for a run as it ends.
pub(super) fn describe(timeline: &Timeline) -> String {
    let f = figures(timeline);
    let mut line = format!(
        "{} / {} / round {}: steady p99 {}, peak {}, settle {}, {} failed, worker 0 {:.1}% after",
        timeline.event.key(),
        timeline.variant.label,
        timeline.round + 1,
        ms(f.steady),
        ms(f.peak),
        f.settle.map_or("-".into(), format_duration),
        f.failed,
        f.share0 * 100.0,
    );
    if timeline.event == Event::ColdStart {
        let _ = write!(
            line,
            "; first 10 s p99 {}, per second [{}], weights favour worker 1 after {}",
            ms(f.first),
            f.seconds
                .iter()
                .map(|s| ms(*s))
                .collect::<Vec<_>>()
                .join(", "),
            f.weighted_after.map_or("never".into(), format_duration),
        );
    }
    let _ = write!(
        line,
        "; {} spikes ({} with steal; slow requests from worker 0: {}, worker 1: {}), steal {} (others {:.2} cores)",
        f.spikes,
        f.spikes_with_steal,
        f.spike_requests[0],
        f.spike_requests[1],
        format_duration(f.steal),
        timeline.others
    );
    line
}

/// The median and range of `values` (durations), as `median (min-max)`.
fn spread(values: &[Option<Duration>]) -> String {
    if values.iter().any(Option::is_none) {
        return format!(
            "failed in {} of {}",
            values.iter().filter(|v| v.is_none()).count(),
            values.len()
        );
    }
    let values: Vec<Duration> = values.iter().flatten().copied().collect();
    if values.is_empty() {
        return "-".into();
    }
    let mid = Duration::from_secs_f64(median(values.iter().map(Duration::as_secs_f64).collect()));
    let (min, max) = (values.iter().min().unwrap(), values.iter().max().unwrap());
    if values.len() == 1 {
        format_duration(mid)
    } else {
        format!(
            "{} ({}-{})",
            format_duration(mid),
            format_duration(*min),
            format_duration(*max)
        )
    }
}

/// Writes the report, the series and the plot; prints the report.
pub(super) fn write(
    timelines: &[Timeline],
    command: &str,
    cpu_line: &str,
    elapsed: Duration,
) -> anyhow::Result<()> {
    let rounds = timelines.iter().map(|t| t.round + 1).max().unwrap_or(0);
    let mut report = String::new();
    writeln!(
        report,
        "Command: `{command}` ({rounds} rounds per event and set-up, {elapsed:.0?} in all)"
    )?;
    machine_lines(&mut report, cpu_line)?;
    let others: Vec<f64> = timelines.iter().map(|t| t.others).collect();
    writeln!(
        report,
        "Load: {CLIENTS} keep-alive clients, each its own schedule, {RATE:.0} requests/s of `?cpu={CPU_MS}` in all ({:.0}/s outside the burst's 2 s), {} s per run, the event at {} s; other processes' CPU: median {:.2} cores, max {:.2}\n",
        RATE / BURST_FACTOR,
        LENGTH.as_secs(),
        EVENT_AT.as_secs(),
        median(others.clone()),
        others.iter().copied().fold(0.0, f64::max),
    )?;
    let all: Vec<(&Timeline, Figures)> = timelines.iter().map(|t| (t, figures(t))).collect();
    let of = |event: Event, key: &str| -> Vec<&Figures> {
        all.iter()
            .filter(|(t, _)| t.event == event && t.variant.key == key)
            .map(|(_, f)| f)
            .collect()
    };
    // The cold start: the goal figures.
    writeln!(
        report,
        "**{}**: p99 of the first 10 s (goal <= {}), of each second, and when Envoy's weights first favoured worker 1\n",
        Event::ColdStart.title(),
        format_duration(COLD_GOAL)
    )?;
    let mut rows = vec![
        [
            "set-up",
            "first 10 s p99",
            "worst second",
            "weights favour worker 1 after",
            "steady p99 (10-14 s)",
            "failed",
        ]
        .map(str::to_owned),
    ];
    let mut seconds_rows = vec![
        std::iter::once("set-up".to_owned())
            .chain((0..COLD_WINDOW.as_secs()).map(|s| format!("{s}-{} s", s + 1)))
            .collect::<Vec<_>>(),
    ];
    for variant in VARIANTS {
        let runs = of(Event::ColdStart, variant.key);
        if runs.is_empty() {
            continue;
        }
        let worst: Vec<Option<Duration>> = runs
            .iter()
            .map(|f| {
                f.seconds
                    .iter()
                    .copied()
                    .max_by_key(|w| w.map_or((1, Duration::ZERO), |d| (0, d)))
                    .flatten()
            })
            .collect();
        rows.push([
            variant.label.to_owned(),
            spread(&runs.iter().map(|f| f.first).collect::<Vec<_>>()),
            spread(&worst),
            spread(&runs.iter().map(|f| f.weighted_after).collect::<Vec<_>>()),
            spread(&runs.iter().map(|f| f.steady).collect::<Vec<_>>()),
            runs.iter()
                .map(|f| f.failed.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        ]);
        let mut row = vec![variant.label.to_owned()];
        for s in 0..COLD_WINDOW.as_secs() as usize {
            row.push(spread(
                &runs.iter().map(|f| f.seconds[s]).collect::<Vec<_>>(),
            ));
        }
        seconds_rows.push(row);
    }
    report.push_str(&markdown(&rows, 1));
    writeln!(
        report,
        "\nThe p99 of each second of the cold start (median over the rounds, range):\n"
    )?;
    let width = seconds_rows[0].len();
    report.push_str(&markdown_dynamic(&seconds_rows, width));
    // The transitions.
    writeln!(
        report,
        "\n**Transitions**: the p99 before the event (2-6 s) and after it settled (10-14 s), the worst 250 ms window from the event on, and the settle time (from the event's end until the p99 of every second from then on is within {SETTLE_FACTOR}x the settled p99; goal <= {})\n",
        format_duration(SETTLE_GOAL)
    )?;
    let mut rows = vec![
        [
            "event",
            "set-up",
            "p99 before",
            "p99 after",
            "worst window",
            "settle",
            "failed",
            "worker 0 after",
        ]
        .map(str::to_owned),
    ];
    for event in Event::ALL {
        for variant in VARIANTS {
            let runs = of(event, variant.key);
            if runs.is_empty() {
                continue;
            }
            rows.push([
                event.title().to_owned(),
                variant.label.to_owned(),
                if event == Event::ColdStart {
                    "-".into()
                } else {
                    spread(&runs.iter().map(|f| f.before).collect::<Vec<_>>())
                },
                spread(&runs.iter().map(|f| f.steady).collect::<Vec<_>>()),
                spread(&runs.iter().map(|f| f.peak).collect::<Vec<_>>()),
                spread(&runs.iter().map(|f| f.settle).collect::<Vec<_>>()),
                runs.iter()
                    .map(|f| f.failed.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                format!(
                    "{:.1}%",
                    median(runs.iter().map(|f| f.share0 * 100.0).collect())
                ),
            ]);
        }
    }
    report.push_str(&markdown(&rows, 2));
    // Spikes: what else moves the latency.
    writeln!(
        report,
        "\n**Spikes**: 250 ms windows whose p99 is over {SETTLE_FACTOR}x their run's settled p99, from a second after the event on, and how many of them had hypervisor steal (`/proc/stat`) on a CPU in the same window or the one before\n"
    )?;
    let mut rows = vec![
        [
            "set-up",
            "spikes",
            "with steal",
            "slow answers in them: worker 0 / 1",
            "windows",
            "steal per run: median",
            "max",
        ]
        .map(str::to_owned),
    ];
    for variant in VARIANTS {
        let runs: Vec<&Figures> = all
            .iter()
            .filter(|(t, _)| t.variant.key == variant.key)
            .map(|(_, f)| f)
            .collect();
        if runs.is_empty() {
            continue;
        }
        let steal: Vec<f64> = runs.iter().map(|f| f.steal.as_secs_f64()).collect();
        rows.push([
            variant.label.to_owned(),
            runs.iter().map(|f| f.spikes).sum::<usize>().to_string(),
            runs.iter()
                .map(|f| f.spikes_with_steal)
                .sum::<usize>()
                .to_string(),
            format!(
                "{} / {}",
                runs.iter().map(|f| f.spike_requests[0]).sum::<usize>(),
                runs.iter().map(|f| f.spike_requests[1]).sum::<usize>()
            ),
            runs.iter()
                .map(|f| f.windows.len())
                .sum::<usize>()
                .to_string(),
            format_duration(Duration::from_secs_f64(median(steal.clone()))),
            format_duration(Duration::from_secs_f64(
                steal.iter().copied().fold(0.0, f64::max),
            )),
        ]);
    }
    report.push_str(&markdown(&rows, 1));
    println!("{report}");
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out)?;
    let path = out.join("balance-timeline.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    let csv = out.join("balance-timeline.csv");
    std::fs::write(&csv, series(&all)).with_context(|| format!("writing {}", csv.display()))?;
    let png = out.join("balance-timeline.png");
    plot::run(
        &out,
        "balance-timeline-plot.py",
        PLOT_SCRIPT,
        [csv.as_os_str(), png.as_os_str()],
    )?;
    eprintln!(
        "report: {}\nseries: {}\nplot: {}",
        path.display(),
        csv.display(),
        png.display()
    );
    Ok(())
}

/// A markdown table of rows of any one width.
fn markdown_dynamic(rows: &[Vec<String>], width: usize) -> String {
    let mut out = String::new();
    for (k, row) in rows.iter().enumerate() {
        out.push('|');
        for cell in row.iter().take(width) {
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
        if k == 0 {
            out.push('|');
            for n in 0..width {
                out.push_str(if n == 0 { "---|" } else { "---:|" });
            }
            out.push('\n');
        }
    }
    out
}

/// The CSV of every run's windows: `event,setup,round,t_s,p99_ms,weight0_share,steal_ms`, where
/// `weight0_share` is worker 0's share of Envoy's weights at the window's start (empty when Envoy
/// held fewer than two weighted hosts) and `steal_ms` the steal on both CPUs around the window
/// ([`steal_within`]).
fn series(all: &[(&Timeline, Figures)]) -> String {
    let mut csv = String::from("event,setup,round,t_s,p99_ms,weight0_share,steal_ms\n");
    for (timeline, figures) in all {
        for (k, p99) in figures.windows.iter().enumerate() {
            let t = WINDOW * k as u32;
            let share = timeline
                .weights
                .iter()
                .rev()
                .find(|(at, _)| *at <= t)
                .and_then(|(_, w)| match w {
                    [Some(w0), Some(w1)] if w0 + w1 > 0 => Some(*w0 as f64 / (*w0 + *w1) as f64),
                    _ => None,
                });
            let _ = writeln!(
                csv,
                "{},{},{},{:.3},{},{},{:.0}",
                timeline.event.key(),
                timeline.variant.key,
                timeline.round + 1,
                t.as_secs_f64(),
                p99.map_or(String::new(), |d| format!(
                    "{:.3}",
                    d.as_secs_f64() * 1000.0
                )),
                share.map_or(String::new(), |s| format!("{s:.4}")),
                steal_within(timeline, t, t + WINDOW).as_secs_f64() * 1000.0,
            );
        }
    }
    csv
}
