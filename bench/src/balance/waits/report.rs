//! The report of `cargo xtask bench balance --waits`: the tables, the goals, the CSV.

use super::*;

/// What the report says about the runs as a whole.
pub(super) struct Setting {
    pub(super) command: String,
    pub(super) cpu_line: String,
    pub(super) envoy_version: String,
    pub(super) elapsed: Duration,
    /// The set-ups skipped, and why.
    pub(super) skipped: Vec<String>,
}

/// `median (min-max)` of durations in ms.
pub(super) fn ms_median_range(values: &[Option<Duration>]) -> String {
    if values.iter().any(Option::is_none) {
        let failed = values.iter().filter(|v| v.is_none()).count();
        let ok: Vec<f64> = values.iter().flatten().map(Duration::as_secs_f64).collect();
        if ok.is_empty() {
            return "failed".into();
        }
        return format!(
            "{} in {} rounds, {failed} on a failure",
            format_duration(Duration::from_secs_f64(median(ok))),
            values.len() - failed
        );
    }
    let secs: Vec<f64> = values.iter().flatten().map(Duration::as_secs_f64).collect();
    let (low, high) = secs
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    format!(
        "{} ({}-{})",
        format_duration(Duration::from_secs_f64(median(secs.clone()))),
        format_duration(Duration::from_secs_f64(low)),
        format_duration(Duration::from_secs_f64(high))
    )
}

/// The median of a figure over runs, `-` when no run has it.
pub(super) fn median_of(
    values: impl Iterator<Item = Option<f64>>,
    format: impl Fn(f64) -> String,
) -> String {
    let values: Vec<f64> = values.flatten().collect();
    if values.is_empty() {
        "-".into()
    } else {
        format(median(values))
    }
}

/// CPU per request in µs, or `< R` where it is within `resolution` µs of nothing (a process that
/// takes no more under load than idle, as far as 10 ms ticks tell).
pub(super) fn per_request_us(us: f64, resolution: Option<f64>) -> String {
    match resolution {
        Some(r) if us.abs() < r => format!("< {r:.0}"),
        _ => format!("{us:.0}"),
    }
}

/// `µs per request (idle cores)`, medians over runs.
pub(super) fn cpu(
    per_request: impl Iterator<Item = Option<f64>>,
    idle: impl Iterator<Item = Option<f64>>,
    resolution: impl Iterator<Item = Option<f64>>,
) -> String {
    let resolution: Vec<f64> = resolution.flatten().collect();
    let resolution = (!resolution.is_empty()).then(|| median(resolution));
    let per_request = median_of(per_request, |us| per_request_us(us, resolution));
    if per_request == "-" {
        return per_request;
    }
    format!("{per_request} ({})", median_of(idle, |c| format!("{c:.3}")))
}

/// The report's tables: one per cell, one row per set-up.
pub(super) fn tables(options: &Options, runs: &[WaitRun]) -> String {
    let mut out = String::new();
    for cell in Cell::ALL {
        let of_cell: Vec<&WaitRun> = runs.iter().filter(|r| r.cell == cell).collect();
        if of_cell.is_empty() {
            continue;
        }
        writeln!(out, "**{}**\n", cell.title(options)).expect("a String");
        let mut rows = vec![
            [
                "set-up",
                "p50",
                "p99 median (min-max)",
                "p99 of 5 ms requests, median (min-max)",
                "failed",
                "share per worker",
                "supervisor µs/req (idle)",
                "Envoy µs/req (idle)",
                "others (max)",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for setup in SetUp::ALL {
            let of: Vec<&WaitRun> = of_cell
                .iter()
                .copied()
                .filter(|r| r.setup == setup)
                .collect();
            if of.is_empty() {
                continue;
            }
            let p50s: Vec<f64> = of
                .iter()
                .filter_map(|r| r.p50)
                .map(|d| d.as_secs_f64())
                .collect();
            let workers = cell.workers() as usize;
            let share: Vec<f64> = (0..workers)
                .map(|i| median(of.iter().map(|r| r.shares[i]).collect()))
                .collect();
            let others = of.iter().map(|r| r.others).fold(0.0, f64::max);
            let unindexed: usize = of.iter().map(|r| r.unindexed).sum();
            rows.push(vec![
                setup.label(cell),
                if p50s.is_empty() {
                    "failed".into()
                } else {
                    format_duration(Duration::from_secs_f64(median(p50s)))
                },
                ms_median_range(&of.iter().map(|r| r.p99).collect::<Vec<_>>()),
                if cell.waits() {
                    ms_median_range(&of.iter().map(|r| r.p99_short).collect::<Vec<_>>())
                } else {
                    "-".into()
                },
                format!(
                    "{} of {}",
                    of.iter().map(|r| r.failed).sum::<usize>(),
                    of.iter().map(|r| r.requests).sum::<usize>()
                ),
                if unindexed > 0 {
                    format!("{} ({unindexed} unindexed)", shares(&share))
                } else {
                    shares(&share)
                },
                cpu(
                    of.iter().map(|r| r.machinery.map(|m| m.supervisor_us)),
                    of.iter().map(|r| r.machinery.map(|m| m.supervisor_idle)),
                    of.iter().map(|r| r.machinery.map(|m| m.resolution_us)),
                ),
                cpu(
                    of.iter().map(|r| r.machinery.map(|m| m.envoy_us)),
                    of.iter().map(|r| r.machinery.map(|m| m.envoy_idle)),
                    of.iter().map(|r| r.machinery.map(|m| m.resolution_us)),
                ),
                format!("{others:.2}"),
            ]);
        }
        out.push_str(&markdown(&rows, 1));
        out.push('\n');
    }
    out
}

/// Per round, the `SO_REUSEPORT` set-up's split and p99 in every cell it ran in. Each run opens its
/// connections afresh, from new ephemeral ports, and the kernel hashes each to one process: each
/// round is one draw of that split, the luckiest and the unluckiest among them.
pub(super) fn reuseport_rounds(runs: &[WaitRun]) -> String {
    let mut out = String::new();
    for cell in Cell::ALL {
        let mut of: Vec<&WaitRun> = runs
            .iter()
            .filter(|r| r.cell == cell && r.setup == SetUp::ReusePort)
            .collect();
        if of.is_empty() {
            continue;
        }
        of.sort_by_key(|r| r.round);
        writeln!(
            out,
            "**{}: SO_REUSEPORT per round** (each run's connections split by the kernel's hash)\n",
            cell.key()
        )
        .expect("a String");
        let mut rows = vec![
            ["round (seed)", "share per worker", "p50", "p99", "failed"]
                .map(String::from)
                .to_vec(),
        ];
        let duration = |d: Option<Duration>| d.map_or("failed".into(), format_duration);
        for run in of {
            rows.push(vec![
                format!("{} ({})", run.round + 1, run.seed),
                shares(&run.shares),
                duration(run.p50),
                duration(run.p99),
                format!("{} of {}", run.failed, run.requests),
            ]);
        }
        out.push_str(&markdown(&rows, 1));
        out.push('\n');
    }
    out
}

/// The median of the runs' p99s, a failed one counting as slower than any (`None` when the median
/// falls on a failure, or there is no run).
pub(super) fn median_p99<'a>(runs: impl Iterator<Item = &'a WaitRun>) -> Option<Duration> {
    let p99s: Vec<f64> = runs
        .map(|r| r.p99.map_or(f64::INFINITY, |d| d.as_secs_f64()))
        .collect();
    if p99s.is_empty() {
        return None;
    }
    let median = median(p99s);
    median.is_finite().then(|| Duration::from_secs_f64(median))
}

/// `a / b` as a ratio against `goal` (at most): `0.93x (goal: at most 1.1x): met`.
pub(super) fn against(a: Option<Duration>, b: Option<Duration>, goal: f64) -> String {
    match (a, b) {
        (Some(a), Some(b)) => {
            let ratio = a.as_secs_f64() / b.as_secs_f64();
            let verdict = if ratio <= goal { "met" } else { "not met" };
            format!("{ratio:.2}x (goal: at most {goal}x): {verdict}")
        }
        (Some(_), None) => format!("the other failed (goal: at most {goal}x): met"),
        (None, _) => format!("failed (goal: at most {goal}x): not met"),
    }
}

/// The goals of the async cells, for those whose runs have both sides: on async-io the default's
/// p99 within 1.1x of least request over every worker; under async-hog within 1.5x of
/// `SO_REUSEPORT`'s luckiest round and at most 0.5x its unluckiest.
pub(super) fn goals(runs: &[WaitRun]) -> Vec<String> {
    let of = |cell: Cell, setup: SetUp| -> Vec<&WaitRun> {
        runs.iter()
            .filter(|r| r.cell == cell && r.setup == setup)
            .collect()
    };
    let duration = |d: Option<Duration>| d.map_or("failed".into(), format_duration);
    let mut goals = Vec::new();
    let (default, lr) = (
        of(Cell::AsyncIo, SetUp::Shared),
        of(Cell::AsyncIo, SetUp::LrAll),
    );
    if !default.is_empty() && !lr.is_empty() {
        let (a, b) = (median_p99(default.into_iter()), median_p99(lr.into_iter()));
        goals.push(format!(
            "async-io: Peregrine's default, p99 {}, against least request over every worker, {}: {}",
            duration(a),
            duration(b),
            against(a, b, 1.1)
        ));
    }
    let (default, mut reuseport) = (
        of(Cell::AsyncHog, SetUp::Shared),
        of(Cell::AsyncHog, SetUp::ReusePort),
    );
    if !default.is_empty() && !reuseport.is_empty() {
        let a = median_p99(default.into_iter());
        // From the luckiest round to the unluckiest; a failed p99 is the unluckiest.
        reuseport.sort_by(|x, y| {
            let key = |r: &WaitRun| r.p99.map_or(f64::INFINITY, |d| d.as_secs_f64());
            key(x).total_cmp(&key(y))
        });
        let round = |r: &WaitRun| {
            format!(
                "round {}, shares {}, p99 {}",
                r.round + 1,
                shares(&r.shares),
                duration(r.p99)
            )
        };
        let (luckiest, unluckiest) = (reuseport[0], reuseport[reuseport.len() - 1]);
        goals.push(format!(
            "async-hog: Peregrine's default, p99 {}, against SO_REUSEPORT's luckiest round ({}): {}; against its unluckiest ({}): {}",
            duration(a),
            round(luckiest),
            against(a, luckiest.p99, 1.5),
            round(unluckiest),
            against(a, unluckiest.p99, 0.5)
        ));
    }
    goals
}

pub(super) fn write_report(
    out: &Path,
    options: &Options,
    setting: &Setting,
    runs: &[WaitRun],
) -> anyhow::Result<PathBuf> {
    let mut report = String::new();
    writeln!(
        report,
        "# Balance: servers whose requests wait, or burn CPU beside a hog, per set-up\n"
    )?;
    writeln!(report, "Command: `{}`", setting.command)?;
    machine_lines(&mut report, &setting.cpu_line)?;
    writeln!(
        report,
        "Envoy: {} (`--concurrency 1`; {ENVOYS} of them in four-envoys)",
        setting.envoy_version
    )?;
    let seeds: Vec<String> = (0..options.rounds)
        .map(|r| (options.seed + r as u64).to_string())
        .collect();
    writeln!(
        report,
        "Load: Poisson arrivals, open loop, latency from the scheduled time; {} rounds (seeds {}), {} s warm-up + {} s measured per run; {} in all",
        options.rounds,
        seeds.join(", "),
        options.warmup,
        options.duration,
        format_duration(setting.elapsed)
    )?;
    let others: Vec<f64> = runs.iter().map(|r| r.others).collect();
    if !others.is_empty() {
        writeln!(
            report,
            "Other processes' CPU during the kept runs: median {:.2} cores, max {:.2}",
            median(others.clone()),
            others.iter().copied().fold(0.0, f64::max)
        )?;
    }
    writeln!(
        report,
        "Generator: {} connections (in four-envoys, a quarter to each Envoy)",
        options.connections
    )?;
    for why in &setting.skipped {
        writeln!(report, "Skipped: {why}")?;
    }
    writeln!(report)?;
    let goals = goals(runs);
    if !goals.is_empty() {
        writeln!(report, "Goals:")?;
        for goal in goals {
            writeln!(report, "- {goal}")?;
        }
        writeln!(report)?;
    }
    report.push_str(&tables(options, runs));
    report.push_str(&reuseport_rounds(runs));
    writeln!(
        report,
        "p50 and p99: the median over rounds (p99 also its min-max; a p99 that falls on a failed request counts as none); p99 of 5 ms requests: of the requests that drew the short wait alone; failed: summed over rounds, of the requests scheduled in the measured windows; share: each worker's share of the answers (worker 0 first; the slowed or hogged one), median over rounds; supervisor and Envoy (in four-envoys, the four Envoys together): their CPU per answered request over the whole run (`/proc/PID/stat`, 10 ms ticks), less what they took idle in the 2 s before it (in brackets, in cores), median over rounds (`-`: not in the path; `< R`: within the R µs that 10 ms ticks can tell from idle); others: the most CPU other processes took during a kept run, in cores."
    )?;
    let path = out.join("balance-waits.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    print!("{report}");
    Ok(path)
}

/// `cell,setup,label,round,p50_ms,p99_ms,failed,shares` per run (an empty p99 where it fell on a
/// failure; shares in percent, worker 0 first, `/` between them).
pub(super) fn write_csv(out: &Path, runs: &[WaitRun]) -> anyhow::Result<PathBuf> {
    let mut csv = String::from("cell,setup,label,round,p50_ms,p99_ms,failed,shares\n");
    let ms =
        |d: Option<Duration>| d.map_or(String::new(), |d| format!("{:.3}", d.as_secs_f64() * 1e3));
    for run in runs {
        writeln!(
            csv,
            "{},{},{},{},{},{},{},{}",
            run.cell.key(),
            run.setup.key(),
            run.setup.label(run.cell).replace(',', ";"),
            run.round + 1,
            ms(run.p50),
            ms(run.p99),
            run.failed,
            shares(&run.shares).trim_end_matches('%')
        )?;
    }
    let path = out.join("balance-waits.csv");
    std::fs::write(&path, csv).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// One line per run, as it ends.
pub(super) fn describe(run: &WaitRun) -> String {
    let duration = |d: Option<Duration>| d.map_or("failed".into(), format_duration);
    format!(
        "{} {} round {}: p50 {}, p99 {}, failed {}/{}, shares {}, supervisor {}, Envoy {}, others {:.2} cores",
        run.cell.key(),
        run.setup.key(),
        run.round + 1,
        duration(run.p50),
        duration(run.p99),
        run.failed,
        run.requests,
        shares(&run.shares),
        run.machinery.map_or("-".into(), |m| format!(
            "{} µs/req (idle {:.3} cores)",
            per_request_us(m.supervisor_us, Some(m.resolution_us)),
            m.supervisor_idle
        )),
        run.machinery.map_or("-".into(), |m| format!(
            "{} µs/req (idle {:.3} cores)",
            per_request_us(m.envoy_us, Some(m.resolution_us)),
            m.envoy_idle
        )),
        run.others
    )
}

/// Shares in percent, `25/25/25/25%`.
pub(super) fn shares(shares: &[f64]) -> String {
    let parts: Vec<String> = shares.iter().map(|s| format!("{:.0}", s * 100.0)).collect();
    format!("{}%", parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cost_within_what_ticks_can_tell_is_shown_as_its_bound() {
        // Ticks of 10 ms over a 20 s run and a 2 s idle measure, 2,268 answers: about 50 µs.
        assert_eq!(per_request_us(-35.0, Some(50.0)), "< 50");
        assert_eq!(per_request_us(49.0, Some(50.0)), "< 50");
        assert_eq!(per_request_us(647.2, Some(50.0)), "647");
        assert_eq!(per_request_us(-35.0, None), "-35");
        assert_eq!(
            cpu(
                [Some(-2.0), Some(8.0)].into_iter(),
                [Some(0.02)].into_iter(),
                [Some(50.0)].into_iter()
            ),
            "< 50 (0.020)"
        );
        assert_eq!(
            cpu([None].into_iter(), [None].into_iter(), [None].into_iter()),
            "-"
        );
    }

    #[test]
    fn the_goals_of_the_async_cells() {
        let run = |cell, setup, round, p99_ms: Option<u64>, share0: f64| WaitRun {
            cell,
            setup,
            round,
            seed: 1 + round as u64,
            requests: 100,
            failed: usize::from(p99_ms.is_none()),
            p50: Some(Duration::from_millis(5)),
            p99: p99_ms.map(Duration::from_millis),
            p99_short: None,
            shares: vec![share0, 1.0 - share0],
            unindexed: 0,
            machinery: None,
            others: 0.0,
        };
        let runs = vec![
            run(Cell::AsyncIo, SetUp::Shared, 0, Some(105), 0.5),
            run(Cell::AsyncIo, SetUp::LrAll, 0, Some(100), 0.5),
            run(Cell::AsyncHog, SetUp::Shared, 0, Some(30), 0.3),
            run(Cell::AsyncHog, SetUp::ReusePort, 0, Some(25), 0.45),
            run(Cell::AsyncHog, SetUp::ReusePort, 1, None, 0.55),
            run(Cell::AsyncHog, SetUp::ReusePort, 2, Some(900), 0.5),
        ];
        let goals = goals(&runs);
        assert_eq!(goals.len(), 2, "{goals:?}");
        assert!(
            goals[0].contains("1.05x (goal: at most 1.1x): met"),
            "{}",
            goals[0]
        );
        assert!(
            goals[1].contains("luckiest round (round 1, shares 45/55%, p99 25.0 ms): 1.20x"),
            "{}",
            goals[1]
        );
        assert!(
            goals[1].contains("unluckiest (round 2, shares 55/45%, p99 failed): the other failed"),
            "{}",
            goals[1]
        );
        assert_eq!(
            median_p99(runs[3..].iter()),
            Some(Duration::from_millis(900))
        );
        let rounds = reuseport_rounds(&runs);
        assert!(
            rounds.contains("async-hog: SO_REUSEPORT per round"),
            "{rounds}"
        );
        assert!(super::goals(&runs[..1]).is_empty(), "one side only");
    }
}
