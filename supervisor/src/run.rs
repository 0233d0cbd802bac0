//! `peregrine run`: wires the parts together and runs them until SIGINT or SIGTERM.
//!
//! Order of start: the signal handlers, the control socket's instance lock ([`InstanceLock`]: a
//! second supervisor on the socket stops here), the open-file limit raised, the sampler's sources
//! ([`choose_sampler`]: an unavailable sampler fails before anything starts), registry,
//! registration socket, gRPC listener (so a bad address fails before any worker starts), adoption
//! of an earlier supervisor's workers (those of the lock's lineage) and the slot tasks, the
//! registration server, then, once adopted workers have registered again, the fleet's membership
//! and xDS behind the gRPC port's admission, then the sampling loop. Restarts, reloads (control
//! socket, SIGHUP) and upgrades (control socket, SIGUSR2) run one at a time in an operation task;
//! an upgrade execs a new image of this process, which starts here again (its signal handlers first
//! of all). Order of stop: workers (drained, then SIGTERM, then SIGKILL after a deadline), then the
//! sampler, then xDS, then the registration socket file is removed.

use std::{io, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use peregrine_proto::v1;
use tokio::{
    net::TcpListener,
    signal::unix::SignalKind,
    sync::{mpsc, oneshot, watch},
};

mod envoy_facing;
mod exposure;
pub mod grpc;
pub mod host_state;
mod operations;
pub mod warnings;

pub use self::envoy_facing::orca_listen_addresses;
use self::{
    envoy_facing::{OrcaReach, Sampling, orca_services, xds_options},
    operations::operate,
};
use crate::{
    adopt,
    children::{self, Children, Counters, Lanes},
    config::{Config, SamplerSetting},
    fleet,
    grpc_port::{self, Admission},
    instance::{InstanceLock, LockError},
    manager::{self, Manager},
    metrics,
    orca::{self, OrcaService},
    registration,
    registry::Registry,
    sampler::{self, ErrorChain, SchedSource, ebpf::EbpfSource, procfs::ProcfsSource},
    service_manager, status,
    timings::Timings,
    tls::server::ServerTls,
    upgrade::Image,
    xds,
};

/// How long a supervisor whose lock file names its own pid (an earlier image of this process, before
/// an upgrade's exec) waits for the lock: a child forked at that moment holds the lock's descriptor
/// until its own exec.
const LOCK_AFTER_EXEC: Duration = Duration::from_secs(5);

/// The longest xDS waits at start for adopted workers to register again (they retry at least every
/// 100 ms; `register_timeout_ms` if shorter). A slot whose adopted worker has not registered by
/// `register_timeout_ms` replaces it.
pub const ADOPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the supervisor could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Another supervisor runs on the control socket, or its lock cannot be taken.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The registration socket could not be opened.
    #[error(transparent)]
    Registration(#[from] registration::BindError),
    /// The gRPC address could not be bound.
    #[error("cannot bind the gRPC (xDS) address {addr}")]
    Grpc {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The metrics address could not be bound.
    #[error(
        "cannot listen for Prometheus metrics on {addr} (supervisor.metrics, or PEREGRINE_METRICS; \"\" turns them off)"
    )]
    Metrics {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The gRPC server (xDS, ORCA) failed.
    #[error(transparent)]
    Serve(#[from] grpc::ServeError),
    /// Workers could not be prepared.
    #[error("cannot prepare workers")]
    Workers(#[source] io::Error),
    /// The request counter region could not be created.
    #[error("cannot create the request counter region")]
    Counters(#[source] peregrine_contract::shm::ShmError),
    /// An address Envoy's ORCA streams need could not be bound.
    #[error(
        "cannot listen on {addr} for ORCA: the workers of {services} listen on {ip}, and Envoy opens \
         their ORCA streams to that IP with the gRPC port; free the port, set supervisor.bind to an \
         address that covers {ip} (e.g. [::]:{port}), or set orca = false for those services",
        ip = addr.ip(),
        port = addr.port()
    )]
    OrcaBind {
        /// The address.
        addr: SocketAddr,
        /// The services with ORCA on.
        services: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The gRPC port's TLS files cannot be used.
    #[error("cannot serve the gRPC port over TLS")]
    Tls(#[from] crate::tls::server::LoadError),
    /// This host cannot join its fleet as configured.
    #[error(transparent)]
    Fleet(#[from] fleet::preflight::PreflightError),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers")]
    Signals(#[source] io::Error),
    /// The configured sampler cannot run here.
    #[error("sampler = \"{setting}\": {reason}")]
    Sampler {
        /// The configured value.
        setting: SamplerSetting,
        /// Why it cannot run.
        reason: String,
        /// The cause, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

/// What the sampler reads: the workers' scheduler time and their request counters.
#[derive(Debug)]
pub struct SamplerSources {
    /// The scheduler source; `None` with `sampler = "off"`.
    pub sched: Option<Box<dyn SchedSource>>,
    /// The request counters the workers count in (the manager hands them out).
    pub counters: Arc<Counters>,
    /// The lanes of both: one per live worker.
    pub lanes: Arc<Lanes>,
}

/// Chooses the sampler's sources for `config.supervisor.sampler`.
///
/// - `"ebpf"`: the eBPF sampler, with its mmapable BPF map as the counter region, or an error that
///   says why it cannot load (no clang at build time, no BTF, no CAP_BPF/CAP_PERFMON, ...).
/// - `"auto"`: the eBPF sampler if it loads, else procfs with a memfd; one log line says which and why.
/// - `"procfs"`: procfs and a memfd.
/// - `"off"`: no scheduler source; workers still count requests in a memfd.
pub fn choose_sampler(config: &Config) -> Result<SamplerSources, RunError> {
    let setting = config.supervisor.sampler;
    let slots = children::lane_capacity(config);
    let lanes = Lanes::new(slots);
    let memfd = || {
        Counters::memfd(slots)
            .map(Arc::new)
            .map_err(RunError::Counters)
    };
    let procfs = || {
        let source = ProcfsSource::new();
        source.available().map_err(|error| RunError::Sampler {
            setting,
            reason: "procfs has no per-thread schedstat".into(),
            source: Some(Box::new(error)),
        })?;
        Ok::<_, RunError>(Box::new(source) as Box<dyn SchedSource>)
    };
    match setting {
        SamplerSetting::Off => Ok(SamplerSources {
            sched: None,
            counters: memfd()?,
            lanes,
        }),
        SamplerSetting::Procfs => Ok(SamplerSources {
            sched: Some(procfs()?),
            counters: memfd()?,
            lanes,
        }),
        SamplerSetting::Ebpf => {
            let (source, counters) =
                EbpfSource::load(slots).map_err(|error| RunError::Sampler {
                    setting,
                    reason: "the eBPF sampler cannot load (use \"procfs\" or \"auto\")".into(),
                    source: Some(Box::new(error)),
                })?;
            tracing::info!(
                slots,
                sends = %source.sends(),
                "Sampler: eBPF programs attached to the scheduler's tracepoints"
            );
            Ok(SamplerSources {
                sched: Some(Box::new(source)),
                counters,
                lanes,
            })
        }
        SamplerSetting::Auto => match EbpfSource::load(slots) {
            Ok((source, counters)) => {
                tracing::info!(
                    sampler = "ebpf",
                    why = "the eBPF programs loaded and attached",
                    sends = %source.sends(),
                    "Sampler chosen for sampler = \"auto\""
                );
                Ok(SamplerSources {
                    sched: Some(Box::new(source)),
                    counters,
                    lanes,
                })
            }
            Err(error) => {
                let sources = SamplerSources {
                    sched: Some(procfs()?),
                    counters: memfd()?,
                    lanes,
                };
                tracing::warn!(
                    sampler = "procfs",
                    why = %ErrorChain(&error),
                    "Sampler chosen for sampler = \"auto\": eBPF is not available, falling back to procfs"
                );
                Ok(sources)
            }
        },
    }
}

/// Runs the supervisor until SIGINT or SIGTERM; returns once every worker has stopped.
///
/// `path` is the config file `config` came from: `peregrine restart`, `peregrine reload` and SIGHUP
/// read it again. `image` is what this process was started as: `peregrine upgrade` execs it again.
pub async fn run(config: Config, path: PathBuf, image: Image) -> Result<(), RunError> {
    let control = config.supervisor.control.clone();
    let started = tokio::time::Instant::now();
    // The signals first: from here on SIGTERM drains and stops, even in an image that an upgrade
    // has just started and that is still adopting.
    let signal = |kind| tokio::signal::unix::signal(kind).map_err(RunError::Signals);
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut sigusr2 = signal(SignalKind::user_defined2())?;
    // Then: a second supervisor on this socket stops here, before it touches anything. Held until
    // this function returns (after the socket file is removed).
    let lock = InstanceLock::acquire_after_exec(&control, LOCK_AFTER_EXEC)?;
    let nofile = grpc_port::raise_nofile_limit();
    let sources = choose_sampler(&config)?;
    let registry = Registry::new(config.services.keys().cloned());
    let registry = Arc::new(match &config.cluster {
        Some(cluster) => registry.in_fleet(&cluster.host),
        None => registry,
    });
    let children = Arc::new(Children::default());
    // What a worker leaves running when it exits (a server that daemonizes) is handed to this
    // supervisor, which stops it and reaps it.
    if let Err(error) = manager::become_subreaper() {
        tracing::warn!(%error, "Cannot become the subreaper of the workers: what a worker leaves running when it exits goes to init");
    }
    let _reaper = AbortOnDrop(tokio::spawn(manager::reap_orphans(children.clone())));
    let registrations = registration::bind(&control, &lock)?;
    let _socket_file = RemoveOnDrop(control.clone());
    let bind = config.supervisor.bind;
    let grpc = grpc_port::bind(bind).map_err(|source| RunError::Grpc { addr: bind, source })?;
    let bound = grpc.local_addr().unwrap_or(bind);
    let metrics_listener = match config.supervisor.metrics {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| RunError::Metrics { addr, source })?,
        ),
        None => None,
    };
    // Read before any worker starts: a certificate that cannot be used stops the start here.
    let tls = config
        .supervisor
        .tls
        .as_ref()
        .map(ServerTls::load)
        .transpose()?;
    let _tls_watch = tls.as_ref().map(|tls| AbortOnDrop(tls.spawn_watch()));
    let sampling = Sampling::of(sources.sched.as_deref());
    let orca = orca_services(&config, sampling);
    let mut orca_listeners = Vec::new();
    for addr in orca_listen_addresses(&config, &orca, bound) {
        if !addr.ip().is_loopback() {
            tracing::warn!(%addr, "ORCA listens on a non-loopback address, where workers listen: it serves only load reports there, no xDS");
        }
        let listener = grpc_port::bind(addr).map_err(|source| RunError::OrcaBind {
            addr,
            services: orca.iter().cloned().collect::<Vec<_>>().join(", "),
            source,
        })?;
        tracing::info!(%addr, "Listening for ORCA streams to workers on this address family too");
        orca_listeners.push(listener);
    }
    let orca_reach = OrcaReach {
        sampling,
        bound,
        listening: orca_listeners
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect(),
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let (commands_tx, mut commands_rx) = mpsc::channel(16);
    // xDS stops only once every worker has: their drains are published to Envoy until the end.
    let (xds_stop_tx, xds_stop_rx) = oneshot::channel::<()>();
    let xds_stop = async move {
        let _ = xds_stop_rx.await;
    };
    // What the status report and the metrics read beside the registry. The ACKs are shared by the
    // xDS streams (which record what Envoy ACKed) and the manager (whose drains wait on them).
    let records = status::Records {
        supervisor: Some(image.status()),
        ..Default::default()
    };
    records.services.set(&config);
    let acks = records.acks.clone();
    let remembered = remember_envoys(
        &acks,
        &control,
        started,
        config.supervisor.lifecycle.drain_timeout,
    );
    // With a sampler, ORCA is served even if no service uses it yet: a reload may add one.
    let orca_service = sampling.loads.then(|| {
        OrcaService::new(
            registry.clone(),
            records.orca.clone(),
            config.orca.min_report_interval,
        )
    });
    let timings = Timings::default();
    let xds_counters = Arc::new(xds::counters::XdsCounters::new(
        timings.xds_convergence.clone(),
    ));
    let _metrics_task = metrics_listener.map(|listener| {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "Serving Prometheus metrics at /metrics");
        }
        let metrics = Arc::new(metrics::registry(
            registry.clone(),
            records.clone(),
            xds_counters.clone(),
            &timings,
        ));
        AbortOnDrop(tokio::spawn(metrics::server::serve(listener, metrics)))
    });
    let (xds_options_tx, xds_options_rx) =
        watch::channel(xds_options(&config, &orca, bound.port()));
    // In-band ORCA: each worker's report into its shared memory, at every sample.
    let _in_band = AbortOnDrop(tokio::spawn(orca::in_band::run(
        registry.clone(),
        children.clone(),
        xds_options_tx.subscribe(),
    )));
    // In a fleet, the host's workers go to etcd and the other hosts' come back into the registry. The
    // session outlives the workers' drains (the other hosts' Envoys must see them drain), then
    // revokes its lease.
    if let Some(cluster) = &config.cluster {
        match fleet::preflight::check(cluster, bound.port(), !orca.is_empty()).await? {
            fleet::preflight::Checked::Fine { hosts } => {
                tracing::debug!(hosts, "The fleet in etcd agrees with this host's config");
            }
            fleet::preflight::Checked::Unchecked(why) => {
                tracing::warn!(%why, etcd = ?cluster.etcd, "Could not check this host's config against the fleet in etcd: starting unchecked");
            }
        }
    }
    let (fleet_stop_tx, fleet_stop_rx) = watch::channel(false);
    // What drains wait on for the other hosts' Envoys.
    let fleet_drains = config
        .cluster
        .as_ref()
        .map(|_| Arc::new(fleet::FleetDrains::default()));
    let context = Arc::new(manager::Context {
        registry: registry.clone(),
        children: children.clone(),
        lanes: sources.lanes.clone(),
        acks: acks.clone(),
        fleet: fleet_drains.clone(),
        counters: sources.counters.clone(),
        lineage: lock.lineage().clone(),
        timings: timings.clone(),
        starting: manager::starting_gate(),
    });
    let server = registration::Server {
        registry: registry.clone(),
        children: children.clone(),
        records: records.clone(),
        commands: commands_tx,
    };
    for warning in warnings::at_start(&config, &path) {
        warning.log();
    }
    // The sockets the workers of a service with a `user` register on, there before they start.
    let mut worker_sockets = registration::WorkerSockets::new(&control, server.clone());
    worker_sockets.open(&config)?;
    // Workers of an earlier supervisor are adopted before registrations are read: a worker that
    // reconnects is then admitted as one of ours (registrations wait in the sockets' backlogs).
    let adopted = adopt::find(&config, lock.lineage());
    let adopted_pids: Vec<u32> = adopted.values().map(|a| a.pid).collect();
    let manager =
        Manager::start(&config, context, adopted, stop_rx.clone()).map_err(RunError::Workers)?;
    let registration_task = tokio::spawn(registration::serve(registrations, server));
    worker_sockets.serve();
    // Envoy keeps the endpoints it has while no control plane answers; it must not get a set without
    // the adopted workers, so xDS waits (bounded) until they have registered again.
    if !adopted_pids.is_empty() {
        let timeout = ADOPT_TIMEOUT.min(config.supervisor.lifecycle.register_timeout);
        adopt::await_registrations(&registry, &children, &adopted_pids, timeout).await;
    }
    // The same goes for the fleet: a new session puts this host's record under a new lease, and the
    // other hosts count a worker record only under its host record's lease, so the adopted workers
    // would leave every other host's Envoys until their records were put again.
    let fleet_task = config
        .cluster
        .clone()
        .zip(fleet_drains.clone())
        .map(|(cluster, drains)| {
            tokio::spawn(
                fleet::Membership::new(
                    cluster,
                    bound.port(),
                    registry.clone(),
                    xds_options_tx.subscribe(),
                    fleet::membership::Shared {
                        acks: acks.clone(),
                        drains,
                        status: records.fleet.clone(),
                    },
                )
                .run(fleet_stop_rx),
            )
        });
    let lanes = sources.lanes.capacity();
    let cap = grpc_port::connection_cap(&config.supervisor.grpc, nofile, lanes);
    if cap < config.supervisor.grpc.max_connections {
        tracing::warn!(
            cap,
            configured = config.supervisor.grpc.max_connections,
            open_files = ?nofile,
            reserved = grpc_port::reserved_fds(lanes),
            "gRPC connections capped below supervisor.grpc_max_connections by the open-file limit"
        );
    }
    let admission = Admission::with_tls(config.supervisor.grpc, cap, tls.clone());
    crate::trim::spawn();
    let mut xds_task = tokio::spawn(grpc::serve(
        grpc::Ports {
            listeners: vec![grpc],
            orca_listeners,
            admission,
        },
        grpc::Inputs {
            snapshots: registry.subscribe(),
            options: xds_options_rx,
            acks,
            counters: xds_counters,
            orca: orca_service,
        },
        xds_stop,
    ));
    tracing::info!(grpc = %bound, control = %control.display(), services = config.services.len(), adopted = adopted_pids.len(), "Supervisor running");
    let status = format!("serving xDS on {bound}: {} services", config.services.len());
    service_manager::ready(&status);
    let sampler_task = sources.sched.map(|sched| {
        tokio::spawn(sampler::run(
            sched,
            children.clone(),
            registry.clone(),
            sampler::Options {
                interval: config.supervisor.sample_interval,
                pass_time: Some(timings.sampler_pass.clone()),
            },
            stop_rx,
        ))
    });

    // Restarts and reloads run one at a time, in their own task, so that a signal to stop is heard
    // while one is under way.
    let (operations_tx, operations_rx) = mpsc::channel(16);
    let operations = tokio::spawn(operate(
        manager,
        path,
        operations_rx,
        operations::Outputs {
            xds_options: xds_options_tx,
            orca: orca_reach,
            tls,
            worker_sockets,
            image,
            cluster: config.cluster.clone(),
            services: records.services.clone(),
        },
    ));
    // The watchdog's pings come from this loop: if it stops turning, they stop.
    let watchdog = service_manager::watchdog_interval();
    let mut pings = tokio::time::interval(watchdog.unwrap_or(Duration::from_secs(3600)));
    let xds_result = loop {
        tokio::select! {
            _ = pings.tick(), if watchdog.is_some() => service_manager::watchdog(),
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping workers"); break None; }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping workers"); break None; }
            _ = sighup.recv() => {
                tracing::info!("SIGHUP: reloading the config and restarting every worker");
                let restart = v1::ControlRequest {
                    action: Some(v1::control_request::Action::Restart(v1::Restart::default())),
                };
                let _ = operations_tx.send((restart, None)).await;
            }
            _ = sigusr2.recv() => {
                tracing::info!("SIGUSR2: upgrading in place to the program file this supervisor was started from");
                let upgrade = v1::ControlRequest {
                    action: Some(v1::control_request::Action::Upgrade(v1::Upgrade {})),
                };
                let _ = operations_tx.send((upgrade, None)).await;
            }
            Some((request, reply)) = commands_rx.recv() => {
                let _ = operations_tx.send((request, Some(reply))).await;
            }
            result = &mut xds_task => break Some(result),
        }
    };
    service_manager::stopping();
    let _ = stop_tx.send(true);
    registration_task.abort();
    drop(operations_tx);
    match operations.await {
        Ok(manager) => manager.stopped().await,
        Err(error) => tracing::error!(%error, "The restart task failed"),
    }
    let _ = fleet_stop_tx.send(true);
    if let Some(Err(error)) = match fleet_task {
        Some(task) => Some(task.await),
        None => None,
    } {
        tracing::error!(%error, "Fleet task failed");
    }
    // The Envoys stay remembered as they are now: their streams end with xDS, and the next
    // supervisor must wait for them.
    drop(remembered);
    let _ = xds_stop_tx.send(());
    if let Some(Err(error)) = match sampler_task {
        Some(task) => Some(task.await),
        None => None,
    } {
        tracing::error!(%error, "Sampler task failed");
    }
    let xds_result = match xds_result {
        Some(result) => result,
        None => xds_task.await,
    };
    match xds_result {
        Ok(result) => result?,
        Err(join) => tracing::error!(error = %join, "xDS task failed"),
    }
    tracing::info!("Supervisor stopped");
    Ok(())
}

/// Makes `acks` wait for the Envoys the supervisor before this one served (remembered beside the
/// control socket), until `drain_timeout` after `started`, and keeps remembering the proven ones
/// until the returned task is dropped.
fn remember_envoys(
    acks: &Arc<xds::acks::Acks>,
    control: &std::path::Path,
    started: tokio::time::Instant,
    drain_timeout: Duration,
) -> AbortOnDrop {
    use xds::acks::remembered;
    let path = remembered::path(control);
    let nodes = remembered::load(&path).unwrap_or_else(|error| {
        tracing::warn!(%error, path = %path.display(), "Cannot read the Envoys the supervisor before this one served: the first drains wait only for Envoys connected to this one");
        remembered::Nodes::new()
    });
    if !nodes.is_empty() {
        tracing::info!(envoys = ?nodes.keys().collect::<Vec<_>>(), grace = ?drain_timeout, "Drains wait for the Envoys the supervisor before this one served, until they reconnect and ACK or the grace ends");
        acks.remember(nodes.clone(), started + drain_timeout);
    }
    AbortOnDrop(tokio::spawn(remembered::keep(acks.clone(), path, nodes)))
}

/// Stops a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Removes the registration socket file when the supervisor stops.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
