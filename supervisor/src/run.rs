//! `peregrine run`: wires the parts together and runs them until SIGINT or SIGTERM.
//!
//! Order of start: registry, registration socket, gRPC listener (so a bad address fails before any
//! worker starts), xDS, then the workers. Order of stop: workers (SIGTERM, then SIGKILL after a
//! deadline), then xDS, then the registration socket file is removed.

use std::{io, net::SocketAddr, os::fd::AsFd, path::PathBuf, sync::Arc, time::Duration};

use peregrine_worker::counter::CounterRegion;
use tokio::{net::TcpListener, signal::unix::SignalKind, sync::watch};

use crate::{
    config::Config,
    manager::{self, Children},
    registration,
    registry::Registry,
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
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers")]
    Signals(#[source] io::Error),
}

/// Runs the supervisor until SIGINT or SIGTERM; returns once every worker has stopped.
pub async fn run(config: Config) -> Result<(), RunError> {
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
    // Workers count requests in shared memory; the sampler (and `status`) read it from here.
    let (counters_fd, _counters) =
        CounterRegion::create(manager::slot_count(&config)).map_err(RunError::Workers)?;
    let mut workers = manager::start(
        &config,
        registry.clone(),
        children,
        counters_fd.as_fd(),
        stop_rx,
        STOP_TIMEOUT,
    )
    .map_err(RunError::Workers)?;

    let xds_result = tokio::select! {
        _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping workers"); None }
        _ = sigint.recv() => { tracing::info!("SIGINT: stopping workers"); None }
        result = &mut xds_task => Some(result),
    };
    let _ = stop_tx.send(true);
    while workers.join_next().await.is_some() {}
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
