//! `cargo xtask bench fleet`: a fleet of supervisors sharing membership through a real etcd, on this
//! machine (each host on its own loopback address, its own control socket, the same gRPC port).
//!
//! **Propagation** ([`propagation`]): 3 hosts of 2 workers, an Envoy per host bootstrapped by
//! `peregrine envoy-bootstrap`, `routing = "fleet"`; `--changes` workers killed, one host after
//! another, each exit and each replacement timed until every Envoy shows it (admin `/clusters`
//! polled every `--poll-ms`). **Host loss** ([`loss`]): on the same fleet, `--losses` times a host's
//! supervisor and workers SIGKILLed, until every other Envoy has dropped them (default lease TTL,
//! 3 s), then the host started again. **Scale** ([`scale`]): `--hosts` supervisors of `--workers`
//! workers on a fresh etcd: bring-up, idle RSS and CPU per supervisor, etcd's writes and watch
//! events per worker change, CPU per change, and how long one more supervisor takes to sync.
//!
//! etcd is `--etcd-members` members on loopback (each phase starts its own cluster). Everything the
//! benchmark starts is owned by the harness's guards, and Ctrl-C ([`xtask::interrupt`]) unwinds
//! through them. The report goes to stdout and `target/bench/fleet.md`, the propagation latencies
//! to `target/bench/fleet-propagation.csv` and their plot to `target/bench/fleet-propagation.svg`
//! ([`report`]).
//!
//! **Code.** This module: the options and the order of the phases; [`host`]: one host (config,
//! supervisor, Envoy); [`poll`]: the Envoy pollers; [`xtask::logs`]: the supervisors' log lines as
//! timed events; [`metrics`]: etcd's counters and disk histograms; [`watcher`]: an `etcdctl watch`
//! of the worker keys, timed; [`noise`]: how busy the machine was.

mod host;
mod loss;
mod metrics;
mod noise;
mod poll;
mod propagation;
mod report;
mod scale;
mod watcher;

use std::{net::Ipv4Addr, path::Path, process::ExitCode, time::Duration, time::Instant};

use anyhow::{Context, bail, ensure};
use peregrine_e2e::{EtcdCluster, free_port, target_dir};
use xtask::envoy;

use self::{
    host::{FleetHost, Spec},
    metrics::Disk,
    noise::{Load, Noise},
    watcher::KeyWatch,
};
use super::Flags;

const USAGE: &str = "cargo xtask bench fleet [--hosts N] [--workers N] [--changes N] [--losses N] [--scale-changes N] [--etcd-members N] [--poll-ms MS] [--only propagation,loss,scale]";

/// Hosts and workers per host of the fleet with Envoys (propagation and host loss).
const ENVOY_HOSTS: usize = 3;
const ENVOY_WORKERS: u32 = 2;
/// The addresses of the fleet with Envoys: `127.1.0.x`.
const ENVOY_FLEET: u8 = 1;

/// The phases, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Propagation,
    Loss,
    Scale,
}

impl Phase {
    fn parse(name: &str) -> anyhow::Result<Phase> {
        Ok(match name {
            "propagation" => Phase::Propagation,
            "loss" => Phase::Loss,
            "scale" => Phase::Scale,
            other => bail!("--only: {other:?} is not propagation, loss or scale"),
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Options {
    /// Scale: supervisors, and workers each.
    hosts: usize,
    workers: u32,
    /// Propagation: workers killed.
    changes: usize,
    /// Host losses.
    losses: usize,
    /// Scale: workers killed in the large fleet.
    scale_changes: usize,
    etcd_members: usize,
    /// How often each Envoy's admin is polled.
    poll: Duration,
    /// Workers per host of the fleet with Envoys.
    fleet_workers: u32,
    phases: Vec<Phase>,
}

fn parse_args(args: &[String]) -> anyhow::Result<Options> {
    let mut options = Options {
        hosts: 50,
        workers: 20,
        changes: 50,
        losses: 10,
        scale_changes: 10,
        etcd_members: 3,
        poll: Duration::from_millis(2),
        fleet_workers: ENVOY_WORKERS,
        phases: vec![Phase::Propagation, Phase::Loss, Phase::Scale],
    };
    let mut args = Flags::new(args, USAGE);
    let number = |value: &str, flag: &str| -> anyhow::Result<usize> {
        value
            .parse()
            .with_context(|| format!("{flag} N: a whole number"))
    };
    while let Some(flag) = args.next() {
        let value = args.value(flag)?;
        match flag {
            "--hosts" => options.hosts = number(value, flag)?,
            "--workers" => options.workers = number(value, flag)? as u32,
            "--changes" => options.changes = number(value, flag)?,
            "--losses" => options.losses = number(value, flag)?,
            "--scale-changes" => options.scale_changes = number(value, flag)?,
            "--etcd-members" => options.etcd_members = number(value, flag)?,
            "--poll-ms" => options.poll = Duration::from_millis(number(value, flag)? as u64),
            "--only" => {
                options.phases = value
                    .split(',')
                    .map(|p| Phase::parse(p.trim()))
                    .collect::<anyhow::Result<_>>()?;
            }
            _ => return Err(args.unknown(flag)),
        }
    }
    ensure!(
        (2..=1000).contains(&options.hosts),
        "--hosts: from 2 to 1000"
    );
    ensure!(
        (1..=1000).contains(&options.workers),
        "--workers: from 1 to 1000"
    );
    ensure!(
        options.changes >= 1 && options.losses >= 1 && options.scale_changes >= 1,
        "--changes, --losses and --scale-changes: at least 1"
    );
    ensure!(
        options.etcd_members % 2 == 1,
        "--etcd-members: an odd number (1, 3, 5)"
    );
    Ok(options)
}

/// What one phase measured, how busy the machine was meanwhile, and what etcd's disk did.
#[derive(Debug)]
struct Phased<T> {
    measured: T,
    load: Load,
    disk: Disk,
}

/// What every phase measured, for the report.
#[derive(Debug, Default)]
struct Results {
    propagation: Option<Phased<propagation::Propagation>>,
    losses: Option<Phased<Vec<loss::Loss>>>,
    scale: Option<scale::Scale>,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let options = parse_args(args)?;
    xtask::interrupt::install()?;
    let peregrine = super::release_peregrine()?;
    let with_envoys = options
        .phases
        .iter()
        .any(|p| matches!(p, Phase::Propagation | Phase::Loss));
    let envoy = with_envoys.then(envoy::install).transpose()?;
    let started = Instant::now();
    let mut results = Results::default();

    if let Some(envoy) = &envoy {
        let etcd = start_etcd(&options)?;
        let mut fleet = envoy_fleet(&peregrine, envoy, &etcd, &options)?;
        if options.phases.contains(&Phase::Propagation) {
            let (noise, disk) = (Noise::start()?, Disk::read(&etcd)?);
            let watch = KeyWatch::start(&etcd.endpoint(0), host::WORKER_KEYS)?;
            let measured =
                propagation::run(&fleet, watch.as_ref(), &options).context("propagation")?;
            results.propagation = Some(Phased {
                measured,
                load: noise.stop()?,
                disk: Disk::read(&etcd)?.since(&disk),
            });
        }
        if options.phases.contains(&Phase::Loss) {
            let (noise, disk) = (Noise::start()?, Disk::read(&etcd)?);
            let measured = loss::run(&mut fleet, &options).context("host loss")?;
            results.losses = Some(Phased {
                measured,
                load: noise.stop()?,
                disk: Disk::read(&etcd)?.since(&disk),
            });
        }
    }
    if options.phases.contains(&Phase::Scale) {
        let etcd = start_etcd(&options)?;
        results.scale = Some(scale::run(&peregrine, &etcd, &options).context("scale")?);
    }

    let setting = report::Setting {
        command: super::command_line("fleet", args),
        elapsed: started.elapsed(),
        envoy_version: envoy.as_deref().map(envoy::short_version).transpose()?,
        etcd_version: report::etcd_version()?,
    };
    report::write(&target_dir().join("bench"), &options, &setting, &results)?;
    Ok(ExitCode::SUCCESS)
}

/// A fresh etcd of `options.etcd_members` members on loopback.
fn start_etcd(options: &Options) -> anyhow::Result<EtcdCluster> {
    EtcdCluster::start(Ipv4Addr::LOCALHOST.into(), options.etcd_members).context("starting etcd")
}

/// The fleet with Envoys: [`ENVOY_HOSTS`] hosts `h0`, `h1`, ... of `options.fleet_workers` workers,
/// each with its Envoy.
fn envoy_fleet(
    peregrine: &Path,
    envoy: &Path,
    etcd: &EtcdCluster,
    options: &Options,
) -> anyhow::Result<Vec<FleetHost>> {
    let endpoints = etcd.endpoints();
    let grpc_port = free_port();
    let mut fleet = (0..ENVOY_HOSTS)
        .map(|i| {
            FleetHost::start(
                peregrine,
                &Spec {
                    name: format!("h{i}"),
                    ip: host::address(ENVOY_FLEET, i),
                    grpc_port,
                    workers: options.fleet_workers,
                    etcd: &endpoints,
                },
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for host in &mut fleet {
        host.start_envoy(envoy)?;
    }
    Ok(fleet)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args;

    #[test]
    fn parses_the_options() {
        let defaults = parse_args(&[]).unwrap();
        assert_eq!(
            (
                defaults.hosts,
                defaults.workers,
                defaults.changes,
                defaults.losses
            ),
            (50, 20, 50, 10)
        );
        assert_eq!(defaults.phases.len(), 3);
        let other = parse_args(&args(
            "--hosts 5 --workers 3 --changes 7 --losses 2 --poll-ms 5 --only scale,loss --etcd-members 1",
        ))
        .unwrap();
        assert_eq!((other.hosts, other.workers, other.changes), (5, 3, 7));
        assert_eq!(other.poll, Duration::from_millis(5));
        assert_eq!(other.phases, vec![Phase::Scale, Phase::Loss]);
        assert!(parse_args(&args("--only nothing")).is_err());
        assert!(parse_args(&args("--etcd-members 2")).is_err());
        assert!(parse_args(&args("--hosts 1")).is_err());
        assert!(parse_args(&args("--fast 1")).is_err());
    }
}
