//! `peregrine run`: wires the parts together and runs them until SIGINT or SIGTERM.
//!
//! Order of start: the sampler's sources ([`choose_sampler`]: an unavailable sampler fails before
//! anything starts), registry, registration socket, gRPC listener (so a bad address fails before any
//! worker starts), xDS, the workers, then the sampling loop. Order of stop: workers (SIGTERM, then
//! SIGKILL after a deadline), then the sampler and xDS, then the registration socket file is removed.

use std::{io, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::{net::TcpListener, signal::unix::SignalKind, sync::watch};

use crate::{
    config::{Config, SamplerSetting},
    manager::{self, Children},
    registration,
    registry::Registry,
    sampler::{self, Counters, ErrorChain, SchedSource, ebpf::EbpfSource, procfs::ProcfsSource},
    xds,
};

/// How long a stopping worker may take before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the supervisor could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
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
    /// The xDS server failed.
    #[error("xDS server failed")]
    Xds(#[from] xds::XdsError),
    /// Workers could not be prepared.
    #[error("cannot prepare workers")]
    Workers(#[source] io::Error),
    /// The request counter region could not be created.
    #[error("cannot create the request counter region")]
    Counters(#[source] io::Error),
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
    let slots = manager::slot_count(config);
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
        }),
        SamplerSetting::Procfs => Ok(SamplerSources {
            sched: Some(procfs()?),
            counters: memfd()?,
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
                "Sampler: eBPF programs attached to the scheduler's tracepoints"
            );
            Ok(SamplerSources {
                sched: Some(Box::new(source)),
                counters,
            })
        }
        SamplerSetting::Auto => match EbpfSource::load(slots) {
            Ok((source, counters)) => {
                tracing::info!(
                    sampler = "ebpf",
                    why = "the eBPF programs loaded and attached",
                    "Sampler chosen for sampler = \"auto\""
                );
                Ok(SamplerSources {
                    sched: Some(Box::new(source)),
                    counters,
                })
            }
            Err(error) => {
                let sources = SamplerSources {
                    sched: Some(procfs()?),
                    counters: memfd()?,
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
pub async fn run(config: Config) -> Result<(), RunError> {
    let sources = choose_sampler(&config)?;
    let registry = Arc::new(Registry::new(config.services.keys().cloned()));
    let children = Arc::new(Children::default());
    let control = config.supervisor.control.clone();
    let registrations = registration::bind(&control)?;
    let _socket_file = RemoveOnDrop(control.clone());
    let bind = config.supervisor.bind;
    let grpc = TcpListener::bind(bind)
        .await
        .map_err(|source| RunError::Grpc { addr: bind, source })?;
    let bound = grpc.local_addr().unwrap_or(bind);
    if !bind.ip().is_loopback() {
        tracing::warn!(%bound, "The gRPC port is reachable from other hosts: supervisor.bind is not loopback");
    }
    let mut sigterm =
        tokio::signal::unix::signal(SignalKind::terminate()).map_err(RunError::Signals)?;
    let mut sigint =
        tokio::signal::unix::signal(SignalKind::interrupt()).map_err(RunError::Signals)?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let registration_task = tokio::spawn(registration::serve(
        registrations,
        registry.clone(),
        children.clone(),
    ));
    let xds_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let mut xds_task = tokio::spawn(xds::serve(
        grpc,
        registry.subscribe(),
        xds_options(&config),
        xds_stop,
    ));
    tracing::info!(grpc = %bound, control = %control.display(), services = config.services.len(), "Supervisor running");
    let mut workers = manager::start(
        &config,
        registry.clone(),
        children,
        sources.counters.clone(),
        stop_rx.clone(),
        STOP_TIMEOUT,
    )
    .map_err(RunError::Workers)?;
    let sampler_task = sources.sched.map(|sched| {
        tokio::spawn(sampler::run(
            sched,
            sources.counters,
            registry.clone(),
            sampler::Options {
                interval: config.supervisor.sample_interval,
                slots: manager::slot_numbers(&config),
            },
            stop_rx,
        ))
    });

    let xds_result = tokio::select! {
        _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping workers"); None }
        _ = sigint.recv() => { tracing::info!("SIGINT: stopping workers"); None }
        result = &mut xds_task => Some(result),
    };
    let _ = stop_tx.send(true);
    while workers.join_next().await.is_some() {}
    if let Some(Err(error)) = match sampler_task {
        Some(task) => Some(task.await),
        None => None,
    } {
        tracing::error!(%error, "Sampler task failed");
    }
    registration_task.abort();
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

fn xds_options(config: &Config) -> xds::XdsOptions {
    xds::XdsOptions {
        xds_cluster_name: config.supervisor.xds_cluster.clone(),
        ..xds::XdsOptions::default()
    }
}

/// Removes the registration socket file when the supervisor stops.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
