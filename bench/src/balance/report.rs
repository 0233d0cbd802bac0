//! The report: one line per run as it ends, and `target/bench/balance.md` (the set-up, then per
//! scenario a table of medians over the rounds and the goals checked against them).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context;
use serde_json::Value;

use super::{NOISY, NOISY_RETRIES, Options, Policy, Run, Scenario, TIMEOUT};
use crate::{
    machine::machine_lines,
    table::{format_duration, markdown, median},
};

/// What the report says of the set-up, beside the options.
#[derive(Debug)]
pub(super) struct Setting {
    /// The command line.
    pub(super) command: String,
    /// How long all the runs took.
    pub(super) elapsed: Duration,
    /// The `CPU:` line.
    pub(super) cpu_line: String,
    pub(super) envoy_version: String,
    /// `peregrine status --json` after the last run (for the sampler and its interval).
    pub(super) status: Value,
}

/// Prints the report and writes it to `out/balance.md`; returns that path.
pub(super) fn write(
    out: &Path,
    options: &Options,
    setting: &Setting,
    runs: &[Run],
) -> anyhow::Result<PathBuf> {
    let Setting {
        command,
        elapsed,
        cpu_line,
        envoy_version,
        status,
    } = setting;
    let mut report = String::new();
    writeln!(
        report,
        "Command: `{command}` ({} rounds, {} s warm-up + {} s measured per run, {elapsed:.0?} in all)",
        options.rounds, options.warmup, options.duration
    )?;
    machine_lines(&mut report, cpu_line)?;
    writeln!(report, "Envoy: {envoy_version}")?;
    writeln!(
        report,
        "Sampler: {}, every {} ms",
        status["sampler"].as_str().unwrap_or("?"),
        status["sample_interval_ms"].as_u64().unwrap_or(0)
    )?;
    let others: Vec<f64> = runs.iter().map(|r| r.others).collect();
    writeln!(
        report,
        "Other processes' CPU use during the runs: median {:.2} cores, max {:.2} ({} of {} runs above {NOISY} after up to {NOISY_RETRIES} repeats of a noisy run)",
        median(others.clone()),
        others.iter().copied().fold(0.0, f64::max),
        others.iter().filter(|&&o| o > NOISY).count(),
        others.len(),
    )?;
    writeln!(
        report,
        "Load: {:.0} requests/s of `?cpu={}` ({:.0}% of 2 cores), {} keep-alive connections{}; \
         side load (B): {:.0} requests/s of `?cpu={}` straight to worker 0",
        options.rate(),
        options.cpu_ms,
        options.load * 100.0,
        options.connections,
        if options.per_connection {
            ", each a client with its own schedule"
        } else {
            ", each taking the next request when free"
        },
        options.side_rate(),
        options.side_cpu_ms()
    )?;
    for scenario in Scenario::ALL {
        let runs: Vec<&Run> = runs.iter().filter(|r| r.scenario == scenario).collect();
        writeln!(report, "\n### {}\n", scenario.title())?;
        report.push_str(&table(&runs, Policy::of(scenario)));
        writeln!(report)?;
        report.push_str(&goals(scenario, &runs, options.rate()));
    }
    println!("{report}");
    let report_path = out.join("balance.md");
    std::fs::write(&report_path, &report)
        .with_context(|| format!("writing {}", report_path.display()))?;
    Ok(report_path)
}

pub(super) fn latency(value: Option<Duration>) -> String {
    value.map_or_else(|| "failed".into(), format_duration)
}

pub(super) fn describe(run: &Run, options: &Options) -> String {
    format!(
        "{} round {}/{} {:>13}: {:.1} req/s, {} failed, p50 {}, p99 {}, worker 0 {:.1}%, busy {} / {}{}, {} sent late, others {:.2} cores",
        run.scenario.key(),
        run.round + 1,
        options.rounds,
        run.policy.label(),
        run.throughput,
        run.failed,
        latency(run.p50),
        latency(run.p99),
        run.shares[0] * 100.0,
        cores(run.busy[0]),
        cores(run.busy[1]),
        run.weight0
            .map(|w| format!(", weight share {:.1}%", w * 100.0))
            .unwrap_or_default(),
        run.late,
        run.others,
    )
}

fn cores(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

/// The median over rounds of a latency; a failure counts as slower than any answer.
fn median_latency(values: impl Iterator<Item = Option<Duration>>) -> Option<Duration> {
    let mut values: Vec<Option<Duration>> = values.collect();
    values.sort_by_key(|l| l.map_or((1, Duration::ZERO), |d| (0, d)));
    // The upper middle of an even count, so that a failed round is never averaged away.
    values.get(values.len() / 2).copied().flatten()
}

/// One row per policy of `policies`: medians over rounds (p99 also its range), failures summed.
fn table(runs: &[&Run], policies: &[Policy]) -> String {
    let mut rows = vec![
        [
            "policy",
            "requests/s",
            "failed",
            "p50",
            "p99",
            "p99 of each round",
            "worker 0 share",
            "busy: worker 0 / 1",
            "worker 0 weight",
        ]
        .map(str::to_owned),
    ];
    for &policy in policies {
        let runs: Vec<&&Run> = runs.iter().filter(|r| r.policy == policy).collect();
        if runs.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&Run) -> Option<f64>| {
            let values: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
            (!values.is_empty()).then(|| median(values))
        };
        let mut rounds = runs.clone();
        rounds.sort_by_key(|r| r.round);
        rows.push([
            policy.label().to_owned(),
            format!("{:.1}", med(&|r| Some(r.throughput)).unwrap_or(0.0)),
            runs.iter().map(|r| r.failed).sum::<usize>().to_string(),
            latency(median_latency(runs.iter().map(|r| r.p50))),
            latency(median_latency(runs.iter().map(|r| r.p99))),
            rounds
                .iter()
                .map(|r| latency(r.p99))
                .collect::<Vec<_>>()
                .join(", "),
            format!("{:.1}%", med(&|r| Some(r.shares[0])).unwrap_or(0.0) * 100.0),
            format!(
                "{} / {}",
                cores(med(&|r| r.busy[0])),
                cores(med(&|r| r.busy[1]))
            ),
            med(&|r| r.weight0).map_or_else(|| "-".into(), |w| format!("{:.1}%", w * 100.0)),
        ]);
    }
    markdown(&rows, 1)
}

/// The goals, checked against the medians.
fn goals(scenario: Scenario, runs: &[&Run], rate: f64) -> String {
    let of =
        |policy: Policy| -> Vec<&&Run> { runs.iter().filter(|r| r.policy == policy).collect() };
    let (rr, cswrr) = (of(Policy::RoundRobin), of(Policy::Cswrr));
    if rr.is_empty() || cswrr.is_empty() {
        return String::new();
    }
    let met = |ok: bool| if ok { "met" } else { "not met" };
    let mut text = String::new();
    let (rr_p99, cswrr_p99) = (
        median_latency(rr.iter().map(|r| r.p99)),
        median_latency(cswrr.iter().map(|r| r.p99)),
    );
    match (cswrr_p99, rr_p99) {
        (Some(c), Some(r)) => {
            let ratio = c.as_secs_f64() / r.as_secs_f64();
            let _ = writeln!(
                text,
                "- CSWRR p99 / ROUND_ROBIN p99: {} / {} = {ratio:.3} (goal <= 0.5): {}",
                format_duration(c),
                format_duration(r),
                met(ratio <= 0.5)
            );
        }
        (Some(c), None) => {
            let _ = writeln!(
                text,
                "- CSWRR p99 {} against a ROUND_ROBIN p99 that failed (over {TIMEOUT:?}): met",
                format_duration(c)
            );
        }
        (None, _) => {
            let _ = writeln!(text, "- CSWRR p99 failed: not met");
        }
    }
    let throughput = |runs: &[&&Run]| median(runs.iter().map(|r| r.throughput).collect());
    let (rr_t, cswrr_t) = (throughput(&rr), throughput(&cswrr));
    let ratio = cswrr_t / rr_t;
    let _ = writeln!(
        text,
        "- CSWRR throughput / ROUND_ROBIN: {cswrr_t:.1} / {rr_t:.1} = {ratio:.3} (goal: not lower): {}",
        if ratio >= 1.0 {
            "met"
        } else if ratio >= 0.99 && cswrr_t >= 0.99 * rate {
            "met within 1% (both at the offered rate)"
        } else {
            "not met"
        }
    );
    let reuseport = of(Policy::ReusePort);
    if !reuseport.is_empty() {
        text.push_str(&against_reuseport(&cswrr, &reuseport));
    }
    let share = median(cswrr.iter().map(|r| r.shares[0]).collect());
    let _ = writeln!(
        text,
        "- {} 's share under CSWRR: {:.1}% (goal <= 35%): {}",
        scenario.worker0(),
        share * 100.0,
        met(share <= 0.35)
    );
    let in_band = of(Policy::CswrrInBand);
    if !in_band.is_empty() {
        text.push_str(&in_band_against_oob(scenario, &cswrr, &in_band));
    }
    text.replace(" 's", "'s")
}

/// In-band reports against out-of-band ones, in the same rounds: worker 0's share within 2 points
/// of out of band's, and the p99 at most 1.5x (medians over the rounds).
fn in_band_against_oob(scenario: Scenario, oob: &[&&Run], in_band: &[&&Run]) -> String {
    let share = |runs: &[&&Run]| median(runs.iter().map(|r| r.shares[0]).collect());
    let (oob_share, in_band_share) = (share(oob), share(in_band));
    let points = (in_band_share - oob_share) * 100.0;
    let mut text = format!(
        "- {} 's share, in band against out of band: {:.1}% against {:.1}% ({points:+.1} points; goal: within 2): {}\n",
        scenario.worker0(),
        in_band_share * 100.0,
        oob_share * 100.0,
        if points.abs() <= 2.0 {
            "met"
        } else {
            "not met"
        }
    );
    let (oob_p99, in_band_p99) = (
        median_latency(oob.iter().map(|r| r.p99)),
        median_latency(in_band.iter().map(|r| r.p99)),
    );
    let _ = match (in_band_p99, oob_p99) {
        (Some(i), Some(o)) => {
            let ratio = i.as_secs_f64() / o.as_secs_f64();
            writeln!(
                text,
                "- p99, in band against out of band: {} / {} = {ratio:.2}x (goal <= 1.5x): {}",
                format_duration(i),
                format_duration(o),
                if ratio <= 1.5 { "met" } else { "not met" }
            )
        }
        (Some(i), None) => writeln!(
            text,
            "- p99 in band {} against an out-of-band p99 that failed: met",
            format_duration(i)
        ),
        (None, _) => writeln!(text, "- p99 in band failed: not met"),
    };
    text
}

/// The steady goal against the baseline people run: CSWRR's p99 in every round at most 1.5x the
/// luckiest `SO_REUSEPORT` split's and at most 0.5x the unluckiest's.
fn against_reuseport(cswrr: &[&&Run], reuseport: &[&&Run]) -> String {
    let slowest = |runs: &[&&Run]| -> Option<Option<Duration>> {
        let mut p99s: Vec<Option<Duration>> = runs.iter().map(|r| r.p99).collect();
        p99s.sort_by_key(|l| l.map_or((1, Duration::ZERO), |d| (0, d)));
        p99s.last().copied()
    };
    let luckiest = reuseport.iter().filter_map(|r| r.p99).min();
    let unluckiest = slowest(reuseport).flatten();
    let worst = slowest(cswrr);
    let shares: Vec<String> = reuseport
        .iter()
        .map(|r| format!("{:.0}%", r.shares[0] * 100.0))
        .collect();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "- SO_REUSEPORT: the hogged process got {} of the requests; p99 of \
         each round {}",
        shares.join(", "),
        reuseport
            .iter()
            .map(|r| latency(r.p99))
            .collect::<Vec<_>>()
            .join(", ")
    );
    match (worst, luckiest, unluckiest) {
        (Some(Some(worst)), Some(lucky), unlucky) => {
            let lucky_ok = worst.as_secs_f64() <= 1.5 * lucky.as_secs_f64();
            // An unluckiest split that failed is slower than any answer: half of it is met.
            let unlucky_ok = unlucky.is_none_or(|u| worst.as_secs_f64() <= 0.5 * u.as_secs_f64());
            let _ = writeln!(
                text,
                "- CSWRR's slowest p99 {} against SO_REUSEPORT's luckiest {} (goal <= 1.5x: {}) and \
                 unluckiest {} (goal <= 0.5x: {})",
                format_duration(worst),
                format_duration(lucky),
                if lucky_ok { "met" } else { "not met" },
                latency(unlucky),
                if unlucky_ok { "met" } else { "not met" },
            );
        }
        _ => {
            let _ = writeln!(text, "- CSWRR against SO_REUSEPORT: a p99 failed: not met");
        }
    }
    text
}
