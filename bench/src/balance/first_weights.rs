//! `cargo xtask bench balance --first-weights [--rounds N]`: how soon Envoy 1.40 applies a new
//! worker's first ORCA weight, for each `blackout_period` and sample interval worth comparing.
//!
//! The cold start of a deploy: an Envoy already runs (bootstrapped from the config), then
//! `peregrine run` starts two idle hello workers. Every 10 ms the admin `/clusters` is read: from
//! the moment Envoy holds both hosts to the moment both carry an ORCA weight (anything but the
//! endpoint weight 1). Until then Envoy round-robins them, whatever their cores are doing. Each
//! setting runs `rounds` times in a rotated order; the table has the median, min and max.

use std::{
    fmt::Write as _,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, TempDir, config::OrcaTable, free_port, hosts,
    http_get, target_dir,
};

use crate::table::{format_duration, markdown, median};

/// The settings compared: `blackout_period_ms` and `sample_interval_ms`.
const SETTINGS: [(u64, u64); 4] = [(2000, 1000), (0, 1000), (2000, 200), (0, 200)];
/// How long one start may take to get its weights.
const DEADLINE: Duration = Duration::from_secs(20);

/// Runs every setting `rounds` times and prints (and writes `target/bench/first-weights.md`) the
/// table.
pub(super) fn run(
    peregrine: &Path,
    envoy: &Path,
    rounds: usize,
    command: &str,
) -> anyhow::Result<()> {
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); SETTINGS.len()];
    for round in 0..rounds {
        for k in 0..SETTINGS.len() {
            let index = (k + round) % SETTINGS.len();
            let (blackout, sample) = SETTINGS[index];
            let took = one_start(peregrine, envoy, blackout, sample)
                .with_context(|| format!("blackout {blackout} ms, samples every {sample} ms"))?;
            eprintln!(
                "round {}/{rounds}: blackout {blackout} ms, samples every {sample} ms: first weights {} after Envoy held the hosts",
                round + 1,
                format_duration(took)
            );
            times[index].push(took);
        }
    }
    let mut rows = vec![
        [
            "blackout_period_ms",
            "sample_interval_ms",
            "hosts -> first weights: median",
            "min",
            "max",
        ]
        .map(str::to_owned),
    ];
    for ((blackout, sample), times) in SETTINGS.iter().zip(&times) {
        let secs: Vec<f64> = times.iter().map(Duration::as_secs_f64).collect();
        let (min, max) = (
            times.iter().min().copied().unwrap_or_default(),
            times.iter().max().copied().unwrap_or_default(),
        );
        rows.push([
            blackout.to_string(),
            sample.to_string(),
            format_duration(Duration::from_secs_f64(median(secs))),
            format_duration(min),
            format_duration(max),
        ]);
    }
    let mut report = String::new();
    writeln!(report, "Command: `{command}` ({rounds} rounds)\n")?;
    report.push_str(&markdown(&rows, 2));
    println!("{report}");
    let out = target_dir().join("bench");
    std::fs::create_dir_all(&out)?;
    let path = out.join("first-weights.md");
    std::fs::write(&path, &report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("report: {}", path.display());
    Ok(())
}

/// One cold start: Envoy first, then the supervisor and its two workers; the time from Envoy
/// holding both hosts to both having an ORCA weight.
fn one_start(
    peregrine: &Path,
    envoy_binary: &Path,
    blackout: u64,
    sample: u64,
) -> anyhow::Result<Duration> {
    let dir = TempDir::new()?;
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc)
        .control_in(dir.path())
        .with_envoy(listen, admin);
    config.supervisor.sample_interval_ms = Some(sample);
    config.orca = Some(OrcaTable {
        blackout_period_ms: Some(blackout),
        ..OrcaTable::default()
    });
    config.service("web", ServiceTable::at("http://127.0.0.1:0").count(2));
    let config = config.toml();
    // The bootstrap comes from the config alone: Envoy runs before the supervisor does.
    let envoy = super::envoy_bootstrapped_from(peregrine, envoy_binary, dir.path(), &config)?;
    let _supervisor = Supervisor::start_in(peregrine, dir.path(), &config)?;
    let started = Instant::now();
    let mut held = None;
    loop {
        let hosts = hosts(&http_get(envoy.admin_addr(), "/clusters")?.1, "web");
        let now = Instant::now();
        if hosts.len() == 2 {
            let since = *held.get_or_insert(now);
            if hosts.iter().all(|h| h.weight > 1) {
                return Ok(now - since);
            }
        }
        if started.elapsed() > DEADLINE {
            bail!("no ORCA weights within {DEADLINE:?} (hosts held: {held:?})");
        }
        thread::sleep(Duration::from_millis(10));
    }
}
