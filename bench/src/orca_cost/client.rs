//! The load client: simulated Envoys, each holding one ORCA stream per worker as Envoy does (its own
//! HTTP/2 connection per stream, `:authority` = the worker's EDS hostname, one request asking for
//! reports every `interval`, then a half-close), each Envoy from a loopback address of its own.
//!
//! The client runs on a tokio runtime of its own, on one thread pinned to a CPU apart from the
//! supervisor's; it counts the reports it receives and the streams that failed.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Context;
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use peregrine_proto::xds::service::orca::v3::{
    OrcaLoadReportRequest, open_rca_service_client::OpenRcaServiceClient,
};
use tokio::sync::{Semaphore, oneshot};
use tonic::transport::Endpoint;

/// How many streams are being opened at once (connections in their handshake).
const OPENING_AT_ONCE: usize = 128;

/// What the client has seen so far, shared with the thread that measures.
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Reports received, all streams together.
    pub(super) reports: AtomicU64,
    /// Streams that received their first report.
    pub(super) served: AtomicU64,
    /// Streams that failed to connect, were refused, or ended.
    pub(super) failed: AtomicU64,
}

/// The source address of simulated Envoy `envoy` (0, 1, ...): 127.0.1.1, 127.0.1.2, ... 127.0.1.250,
/// 127.0.2.1, ...: every Envoy of a fleet dials from an address of its own, and the supervisor's
/// per-address connection cap applies to each.
pub(super) fn envoy_address(envoy: usize) -> IpAddr {
    let (high, low) = (envoy / 250, envoy % 250);
    IpAddr::V4(Ipv4Addr::new(
        127,
        0,
        u8::try_from(1 + high).expect("at most 250 x 254 simulated Envoys"),
        u8::try_from(1 + low).expect("below 251"),
    ))
}

/// The streams to open: `(source address, hostname)` for `streams` streams over `hostnames`, each
/// simulated Envoy holding one stream per hostname (the last one fewer when `streams` is not a
/// multiple).
pub(super) fn plan(hostnames: &[String], streams: usize) -> Vec<(IpAddr, String)> {
    (0..streams)
        .map(|i| {
            (
                envoy_address(i / hostnames.len()),
                hostnames[i % hostnames.len()].clone(),
            )
        })
        .collect()
}

/// A running client; the streams close when it is stopped (or dropped).
#[derive(Debug)]
pub(super) struct Client {
    pub(super) counters: Arc<Counters>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Client {
    /// Opens `plan`'s streams to the gRPC port `127.0.0.1:port`, asking for a report every
    /// `interval`, from a thread pinned to `cpu`.
    pub(super) fn start(
        port: u16,
        plan: Vec<(IpAddr, String)>,
        interval: Duration,
        cpu: usize,
    ) -> anyhow::Result<Client> {
        let counters = Arc::new(Counters::default());
        let (stop, stopped) = oneshot::channel();
        let shared = counters.clone();
        let thread = std::thread::Builder::new()
            .name("orca-client".into())
            .spawn(move || -> anyhow::Result<()> {
                pin_this_thread(cpu)?;
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("the client's runtime")?;
                runtime.block_on(hold(port, plan, interval, shared, stopped));
                // The streams' tasks go with the runtime.
                runtime.shutdown_timeout(Duration::from_secs(5));
                Ok(())
            })
            .context("starting the client's thread")?;
        Ok(Client {
            counters,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Closes every stream and waits for the client's thread.
    pub(super) fn stop(mut self) -> anyhow::Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| anyhow::anyhow!("the client's thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Pins the calling thread to CPU `cpu`.
fn pin_this_thread(cpu: usize) -> anyhow::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)
        .with_context(|| format!("pinning the client to CPU {cpu}"))
}

/// Opens every stream of `plan` ([`OPENING_AT_ONCE`] at a time) and reads reports until `stopped`.
async fn hold(
    port: u16,
    plan: Vec<(IpAddr, String)>,
    interval: Duration,
    counters: Arc<Counters>,
    stopped: oneshot::Receiver<()>,
) {
    let opening = Arc::new(Semaphore::new(OPENING_AT_ONCE));
    let mut streams = tokio::task::JoinSet::new();
    for (source, hostname) in plan {
        let (counters, opening) = (counters.clone(), opening.clone());
        streams.spawn(async move {
            if let Err(error) = stream(port, source, &hostname, interval, &counters, &opening).await
            {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                eprintln!("ORCA stream of {hostname} from {source}: {error:#}");
            }
        });
    }
    let _ = stopped.await;
    streams.shutdown().await;
}

/// One stream, as Envoy opens it: its own connection from `source`, `:authority` = `hostname`.
async fn stream(
    port: u16,
    source: IpAddr,
    hostname: &str,
    interval: Duration,
    counters: &Counters,
    opening: &Semaphore,
) -> anyhow::Result<()> {
    let mut reports = {
        let _permit = opening.acquire().await?;
        let channel = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
            .origin(format!("http://{hostname}").parse()?)
            .local_address(Some(source))
            .connect()
            .await
            .context("connecting")?;
        OpenRcaServiceClient::new(channel)
            .stream_core_metrics(OrcaLoadReportRequest {
                report_interval: Some(ProtoDuration {
                    seconds: i64::try_from(interval.as_secs())?,
                    nanos: i32::try_from(interval.subsec_nanos())?,
                }),
                request_cost_names: Vec::new(),
            })
            .await
            .context("opening the stream")?
            .into_inner()
    };
    let mut first = true;
    while reports
        .message()
        .await
        .context("reading a report")?
        .is_some()
    {
        counters.reports.fetch_add(1, Ordering::Relaxed);
        if first {
            counters.served.fetch_add(1, Ordering::Relaxed);
            first = false;
        }
    }
    anyhow::bail!("the supervisor ended the stream")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_envoy_has_an_address_and_a_stream_per_worker() {
        assert_eq!(envoy_address(0).to_string(), "127.0.1.1");
        assert_eq!(envoy_address(249).to_string(), "127.0.1.250");
        assert_eq!(envoy_address(250).to_string(), "127.0.2.1");
        let hostnames: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let plan = plan(&hostnames, 7);
        assert_eq!(plan.len(), 7);
        assert_eq!(plan[0], (envoy_address(0), "a".to_owned()));
        assert_eq!(plan[2], (envoy_address(0), "c".to_owned()));
        assert_eq!(plan[3], (envoy_address(1), "a".to_owned()));
        assert_eq!(plan[6], (envoy_address(2), "a".to_owned()));
    }
}
