//! `cargo xtask bench xds-scale`: one real supervisor (`peregrine run`, release build) serving `M`
//! endpoints in `S` services to `N` Envoy-like xDS clients of ours ([`client`]), state of the world
//! or delta, dedicated CDS and EDS streams or ADS. The endpoints are remote hosts' records in a real
//! etcd ([`records`]; the supervisor serves only its own children's registrations, and other hosts'
//! records are what a fleet serves), with `routing = "fleet"` so every client gets every endpoint.
//!
//! For each cell of the matrix ([`cell`]): from a worker change (its record's put returning) to the
//! ACK of every client, for one change and for a burst of 100 within 1 s, with the endpoints pushes
//! per stream; the supervisor's RSS per endpoint and per stream, its CPU and the bytes sent per
//! change; and a reconnect storm (every client at once): until all are served again, and the peak
//! RSS. `--supervisor [LABEL=]PATH` runs the same cells against another binary (a baseline built
//! from an older commit), each cell side by side. The report goes to stdout and
//! `target/bench/xds-scale.md`, each cell to `target/bench/xds-scale.csv` ([`report`]), and a plot of
//! the p99 and the memory per client against `N` to `target/bench/xds-scale.svg`.

mod cell;
mod client;
mod records;
mod report;

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, bail};
use peregrine_e2e::{Etcd, target_dir};

use self::{cell::Spec, client::Kind};
use super::{Flags, machine};

/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("xds_scale/plot.py");

const USAGE: &str = "cargo xtask bench xds-scale [--streams N,N...] [--endpoints M,M...] [--services S] [--kind sotw|delta|ads|delta-ads[,...]] [--changes N] [--one-service] [--quick] [--supervisor [LABEL=]PATH]... [--no-current]";

/// The options.
#[derive(Clone, Debug)]
struct Options {
    streams: Vec<usize>,
    endpoints: Vec<usize>,
    /// Services; `None`: `M / 100` (100 endpoints each).
    services: Option<usize>,
    /// The kinds of every cell; `None`: state of the world over the matrix, and the other kinds at
    /// its largest cell.
    kinds: Option<Vec<Kind>>,
    /// Single changes per cell; `None`: 10, or 5 from `N x M >= 1,000,000`.
    changes: Option<usize>,
    /// Also the largest cell with every endpoint in one service.
    one_service: bool,
    /// Binaries other than the current build, with their labels.
    others: Vec<(String, PathBuf)>,
    current: bool,
}

fn list(value: &str, flag: &str) -> anyhow::Result<Vec<usize>> {
    value
        .split(',')
        .map(|v| {
            v.trim()
                .parse()
                .with_context(|| format!("{flag}: {v:?} is not a number"))
        })
        .collect()
}

fn parse_args(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        streams: vec![10, 100, 1000],
        endpoints: vec![100, 1000, 10000],
        services: None,
        kinds: None,
        changes: None,
        one_service: false,
        others: Vec::new(),
        current: true,
    };
    let mut args = Flags::new(args, USAGE);
    while let Some(flag) = args.next() {
        match flag {
            "--streams" => options.streams = list(args.value(flag)?, flag)?,
            "--endpoints" => options.endpoints = list(args.value(flag)?, flag)?,
            "--services" => options.services = Some(list(args.value(flag)?, flag)?[0]),
            "--changes" => options.changes = Some(list(args.value(flag)?, flag)?[0]),
            "--kind" => {
                options.kinds = Some(
                    args.value(flag)?
                        .split(',')
                        .map(|k| {
                            Kind::parse(k).with_context(|| {
                                format!("--kind: {k:?} is not sotw, delta, ads or delta-ads")
                            })
                        })
                        .collect::<anyhow::Result<_>>()?,
                );
            }
            "--one-service" => options.one_service = true,
            "--quick" => {
                options.streams = vec![10, 100];
                options.endpoints = vec![100, 1000];
                options.changes = Some(3);
            }
            "--supervisor" => {
                let value = args.value(flag)?;
                let (label, path) = match value.split_once('=') {
                    Some((label, path)) => (label.to_owned(), PathBuf::from(path)),
                    None => ("baseline".to_owned(), PathBuf::from(value)),
                };
                if !path.is_file() {
                    bail!("--supervisor: {} is not a file", path.display());
                }
                options.others.push((label, path));
            }
            "--no-current" => options.current = false,
            other => return Err(args.unknown(other)),
        }
    }
    if options.streams.is_empty() || options.endpoints.is_empty() {
        bail!("--streams and --endpoints need at least one value\nusage: {USAGE}");
    }
    Ok(options)
}

/// The cells of the matrix, in the order they run (each one run by every binary in turn).
fn cells(options: &Options) -> Vec<(Kind, usize, usize, usize)> {
    let largest = (
        *options.streams.iter().max().expect("streams"),
        *options.endpoints.iter().max().expect("endpoints"),
    );
    let services = |m: usize| options.services.unwrap_or((m / 100).max(1)).min(m);
    let mut cells = Vec::new();
    for &m in &options.endpoints {
        for &n in &options.streams {
            let kinds = match &options.kinds {
                Some(kinds) => kinds.clone(),
                None if (n, m) == largest => Kind::ALL.to_vec(),
                None => vec![Kind::Sotw],
            };
            for kind in kinds {
                cells.push((kind, n, m, services(m)));
            }
        }
    }
    if options.one_service {
        let kinds = options
            .kinds
            .clone()
            .unwrap_or(vec![Kind::Sotw, Kind::Delta]);
        for kind in kinds {
            cells.push((kind, largest.0, largest.1, 1));
        }
    }
    cells
}

/// Set in the optimized build of the benchmarks this benchmark runs in.
const OPTIMIZED: &str = "PEREGRINE_XDS_SCALE_OPTIMIZED";

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    if cfg!(debug_assertions) && std::env::var_os(OPTIMIZED).is_none() {
        // The clients decode and count every response: unoptimized, they would take the CPU the
        // supervisor is measured on. The benchmark runs in a release build of the benchmarks.
        xtask::run_checked(xtask::cargo().args(["build", "--release", "-p", "peregrine-bench"]))?;
        let status = std::process::Command::new(target_dir().join("release/peregrine-bench"))
            .arg("xds-scale")
            .args(args)
            .env(OPTIMIZED, "1")
            .status()
            .context("running the release benchmarks")?;
        return Ok(if status.success() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    xtask::interrupt::install()?;
    let mut binaries: Vec<(String, PathBuf)> = Vec::new();
    if options.current {
        binaries.push(("current".to_owned(), super::release_peregrine()?));
    }
    binaries.extend(options.others.iter().cloned());
    if binaries.is_empty() {
        bail!("--no-current without --supervisor: nothing to measure");
    }
    let etcd = Etcd::start()?;
    let etcd_addr: SocketAddr = etcd
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .context("etcd's client address")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("a tokio runtime")?;
    let mut results = Vec::new();
    let mut id = 0;
    for (kind, n, m, s) in cells(&options) {
        for (label, binary) in &binaries {
            xtask::interrupt::check()?;
            id += 1;
            let changes = options
                .changes
                .unwrap_or(if n * m >= 1_000_000 { 5 } else { 10 });
            let spec = Spec {
                label,
                binary,
                kind,
                clients: n,
                endpoints: m,
                services: s,
                changes,
                burst: true,
                storm: true,
                id,
            };
            eprintln!("xds-scale: {label} {} N={n} M={m} S={s}", kind.name());
            match cell::run(&rt, etcd_addr, &spec) {
                Ok(cell) => {
                    eprintln!("{}", report::markdown_tables(std::slice::from_ref(&cell)));
                    results.push(cell);
                }
                Err(error) => eprintln!(
                    "xds-scale: {label} {} N={n} M={m} S={s} failed: {error:#}",
                    kind.name()
                ),
            }
        }
    }
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    drop(etcd);
    write(&target_dir().join("bench"), args, &binaries, &results)?;
    Ok(ExitCode::SUCCESS)
}

/// Prints the report and writes it, and the CSV, under `out`.
fn write(
    out: &Path,
    args: &[String],
    binaries: &[(String, PathBuf)],
    cells: &[cell::Cell],
) -> anyhow::Result<()> {
    let mut text = String::new();
    writeln!(
        text,
        "# xDS at scale\n\nCommand: `{}`",
        super::command_line("xds-scale", args)
    )?;
    machine::machine_lines(&mut text, &machine::cpu_line()?)?;
    for (label, binary) in binaries {
        writeln!(text, "Supervisor `{label}`: {}", binary.display())?;
    }
    writeln!(
        text,
        "Cores busy: the whole machine's over the cell (others': not this benchmark's tree); load1 at its end.\n"
    )?;
    text.push_str(&report::markdown_tables(cells));
    println!("{text}");
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("xds-scale.md"), &text)?;
    let csv = out.join("xds-scale.csv");
    std::fs::write(&csv, report::csv(cells))?;
    let svg = out.join("xds-scale.svg");
    // The figures are in the report already: a plot that cannot be made is only a warning.
    if let Err(error) = super::plot::run(
        out,
        "xds-scale-plot.py",
        PLOT_SCRIPT,
        [csv.as_os_str(), svg.as_os_str()],
    ) {
        eprintln!("xds-scale: no plot: {error:#}");
    }
    eprintln!(
        "xds-scale: wrote {}, xds-scale.csv and xds-scale.svg",
        out.join("xds-scale.md").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_default_matrix_and_its_largest_cell_in_every_kind() {
        let options = parse_args(&[]).unwrap();
        let matrix = cells(&options);
        assert_eq!(matrix.len(), 9 + 3);
        assert!(matrix.contains(&(Kind::DeltaAds, 1000, 10000, 100)));
        assert!(matrix.contains(&(Kind::Sotw, 10, 100, 1)));
        let options = parse_args(&args(
            "--streams 5 --endpoints 300 --kind delta,ads --one-service",
        ))
        .unwrap();
        assert_eq!(
            cells(&options),
            [
                (Kind::Delta, 5, 300, 3),
                (Kind::Ads, 5, 300, 3),
                (Kind::Delta, 5, 300, 1),
                (Kind::Ads, 5, 300, 1)
            ]
        );
        assert!(parse_args(&args("--kind grpc")).is_err());
    }
}
