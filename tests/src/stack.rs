//! A supervisor running the service `cluster` with hello workers, and an Envoy bootstrapped from it,
//! both on free ports: the set-up most end-to-end tests start from.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use crate::{
    Envoy, Host, PeregrineToml, Supervisor, deploy::Deployed, free_port, hosts, http_get,
    wait_until, worker_pid,
};

/// The Envoy cluster (and service) a [`Stack`] runs.
pub const CLUSTER: &str = "cluster";

/// A supervisor with hello workers in [`CLUSTER`] and an Envoy bootstrapped from it.
#[derive(Debug)]
pub struct Stack {
    // Envoy first: it is killed before the supervisor when the stack is dropped.
    /// The Envoy.
    pub envoy: Envoy,
    /// The supervisor.
    pub supervisor: Supervisor,
    /// Envoy's HTTP listener.
    pub listen: SocketAddr,
    /// The config the supervisor was started with (`{dir}` as written), to change and
    /// [`Supervisor::rewrite_config`] with.
    pub config: PeregrineToml,
}

impl Stack {
    /// The stack's Envoy and supervisor as the zero-downtime steps see them ([`Deployed`]).
    pub fn deployed(&self) -> Deployed<'_> {
        Deployed {
            envoy: &self.envoy,
            supervisor: &self.supervisor,
            cluster: CLUSTER,
            listen: self.listen,
        }
    }

    /// `workers` hello workers on `http://localhost:0`, dedicated CDS/EDS streams.
    #[track_caller]
    pub fn start(workers: u32) -> Stack {
        Stack::start_configured(workers, |_| {})
    }

    /// Like [`Stack::start`], with the config ([`PeregrineToml::one_service`]) changed by
    /// `configure` first (e.g. `ads` in `[envoy]`, or the workers' `url`; `{dir}` is the
    /// supervisor's directory).
    #[track_caller]
    pub fn start_configured(workers: u32, configure: impl FnOnce(&mut PeregrineToml)) -> Stack {
        let (grpc, listen, admin) = (free_port(), free_port(), free_port());
        let mut config = PeregrineToml::one_service(grpc, listen, admin, workers);
        configure(&mut config);
        let supervisor = Supervisor::start(&config.toml());
        Stack::around(supervisor, config, listen)
    }

    /// A stack of `supervisor`, started however the test needed (another binary, another user's
    /// directory) with `config`, and an Envoy bootstrapped from it, listening on loopback at
    /// `listen`.
    #[track_caller]
    pub fn around(supervisor: Supervisor, config: PeregrineToml, listen: u16) -> Stack {
        let bootstrap = supervisor.envoy_bootstrap().expect("envoy-bootstrap");
        let envoy = Envoy::start(&bootstrap);
        Stack {
            envoy,
            supervisor,
            listen: SocketAddr::from(([127, 0, 0, 1], listen)),
            config,
        }
    }

    /// The [`CLUSTER`] hosts in Envoy's admin `/clusters`.
    pub fn hosts(&self) -> Vec<Host> {
        hosts(&self.envoy.clusters(), CLUSTER)
    }

    /// Waits (30 s at most) until Envoy holds exactly `n` healthy hosts, and returns them.
    #[track_caller]
    pub fn wait_for_hosts(&self, n: usize) -> Vec<Host> {
        wait_until(
            Duration::from_secs(30),
            &format!("{n} hosts in Envoy"),
            || {
                let hosts = self.hosts();
                (hosts.len() == n && hosts.iter().all(|h| h.healthy)).then_some(hosts)
            },
        )
    }

    /// Sends `n` requests through Envoy, one at a time; returns how many each worker pid answered.
    /// Panics on a failed request.
    #[track_caller]
    pub fn spread(&self, n: usize) -> BTreeMap<u32, usize> {
        let mut answered = BTreeMap::new();
        for i in 0..n {
            let (status, body) =
                http_get(self.listen, "/").unwrap_or_else(|e| panic!("request {i} failed: {e:#}"));
            assert_eq!(status, 200, "request {i}: {body}");
            let pid = worker_pid(&body).unwrap_or_else(|| panic!("not a hello body: {body:?}"));
            *answered.entry(pid).or_default() += 1;
        }
        answered
    }
}
