//! `cargo xtask bench http --behind-envoy`: each server the way Peregrine runs it, behind Envoy over
//! HTTP/2. For each server, an Envoy of its own (one worker thread, pinned to the load generator's
//! core) has one static cluster of that server alone, with an explicit HTTP/2 upstream, so Envoy
//! speaks to it as it speaks to a worker. `h2load -c10 -m10` loads Envoy's listener, and both
//! processes' CPU time is counted.
//!
//! The figures are the server's CPU per request, with its ratio to hyper's, and Envoy's own CPU per
//! request beside them, so a reader sees which share of the whole path the server is.
//!
//! The worker is measured twice, side by side in the same rounds: on a loopback TCP port and on a
//! `unix://` listener (a second `peregrine run`, its worker pinned to the same core), each behind an
//! Envoy of its own whose upstream is that address; the report adds the Unix socket's CPU per
//! request over TCP's, for the worker and for Envoy, round by round.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::{
    ChildGuard, PeregrineToml, Supervisor, TempDir, free_port, http_get, try_wait_until,
};

use super::{
    machine::{Busy, cpu_line, load_average, machine_lines},
    parse,
    server::{LOAD_CPU, SERVER_CPU, pinned_hello},
    table::{format_duration, markdown, median, median_and_range},
};

/// Where Envoy sends a server's requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Upstream {
    /// `127.0.0.1:PORT`.
    Tcp(u16),
    /// A Unix socket at this path.
    Unix(PathBuf),
}

/// A server to measure behind Envoy.
#[derive(Clone, Debug)]
pub(super) struct Target {
    /// Its name in the table.
    pub(super) name: String,
    /// The pid whose CPU time is counted.
    pub(super) pid: u32,
    pub(super) upstream: Upstream,
}

/// The worker on a `unix://` listener, under a `peregrine run` of its own; stopped on drop.
#[derive(Debug)]
pub(super) struct UnixWorker {
    _supervisor: Supervisor,
    /// The worker's pid.
    pub(super) pid: u32,
    pub(super) path: PathBuf,
    _dir: TempDir,
}

impl UnixWorker {
    /// `peregrine run` (pinned to [`LOAD_CPU`], where it idles) with one hello worker listening on
    /// `unix://DIR/hello.sock`, pinned to [`SERVER_CPU`] as the TCP worker is; waits until it is
    /// ready.
    pub(super) fn start(peregrine: &Path) -> anyhow::Result<UnixWorker> {
        let dir = TempDir::new().context("a temporary directory")?;
        let path = dir.path().join("hello.sock");
        let mut config = PeregrineToml::local(free_port());
        config.service(
            "hello",
            pinned_hello(peregrine, format!("unix://{}", path.display()))?,
        );
        let supervisor = Supervisor::start_wrapped_at(
            &["taskset", "-c", LOAD_CPU],
            peregrine,
            dir.path(),
            &config.toml(),
        )?;
        let pid = try_wait_until(Duration::from_secs(20), "the unix worker ready", || {
            let status = supervisor.status_json().ok()?;
            let worker = &status["workers"][0];
            (worker["state"].as_str() == Some("ready")).then_some(())?;
            worker["pid"].as_u64().map(|pid| pid as u32)
        })
        .with_context(|| supervisor.logs())?;
        Ok(UnixWorker {
            _supervisor: supervisor,
            pid,
            path,
            _dir: dir,
        })
    }
}

/// One run behind Envoy.
#[derive(Clone, Copy, Debug)]
pub(super) struct Behind {
    pub(super) requests_per_sec: f64,
    /// The server's CPU time per request.
    pub(super) server: Duration,
    /// Envoy's CPU time per request (all its threads).
    pub(super) envoy: Duration,
    /// Cores busy over the run with work other than the benchmark's (this process's tree).
    pub(super) others: f64,
}

/// An Envoy in front of the server on `port`; killed on drop.
#[derive(Debug)]
pub(super) struct Front {
    process: ChildGuard,
    _dir: TempDir,
    listen: u16,
}

impl Front {
    /// Starts Envoy (`envoy`) routing everything to `upstream` over HTTP/2, and waits until a
    /// request through it is answered.
    pub(super) fn start(envoy: &Path, upstream: &Upstream) -> anyhow::Result<Front> {
        let dir = TempDir::new().context("a temporary directory")?;
        let (listen, admin) = (free_port(), free_port());
        let bootstrap = dir.path().join("envoy.yaml");
        std::fs::write(&bootstrap, bootstrap_yaml(listen, admin, upstream))
            .context("writing Envoy's bootstrap")?;
        let mut process = ChildGuard::spawn(
            "envoy",
            Command::new("taskset")
                .args(["-c", LOAD_CPU])
                .arg(envoy)
                .arg("-c")
                .arg(&bootstrap)
                .args(["--concurrency", "1", "--log-level", "warn"])
                .args(["--base-id", &listen.to_string()]),
            dir.path(),
        )?;
        try_wait_until(Duration::from_secs(30), "Envoy to answer", || {
            process.ensure_running().ok()?;
            let (status, _) = http_get(([127, 0, 0, 1], listen), "/").ok()?;
            (status == 200).then_some(())
        })
        .with_context(|| process.logs())?;
        Ok(Front {
            process,
            _dir: dir,
            listen,
        })
    }

    /// Loads Envoy with `h2load -c10 -m10` for `duration` seconds; counts the server `pid`'s and
    /// Envoy's CPU time per request.
    pub(super) fn measure(&self, pid: u32, duration: u64) -> anyhow::Result<Behind> {
        let envoy = self.process.id();
        let ticks = |pid: u32| procfs::stat(pid).map(|s| s.cpu_ticks());
        let (server_before, envoy_before) = (ticks(pid)?, ticks(envoy)?);
        let busy = Busy::now_for_this_tree()?;
        let started = Instant::now();
        let url = format!("http://127.0.0.1:{}/", self.listen);
        let output = Command::new("timeout")
            .args(["--kill-after=2", &(duration + 10).to_string()])
            .args(["taskset", "-c", LOAD_CPU])
            .args(["h2load", "-c10", "-m10", "-D", &duration.to_string(), &url])
            .output()
            .context("running h2load")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        ensure!(output.status.success(), "h2load failed:\n{stdout}");
        let (server_after, envoy_after) = (ticks(pid)?, ticks(envoy)?);
        let (_, others) = Busy::now_for_this_tree()?.since(busy);
        let report = parse::h2load(&stdout)?;
        ensure!(
            report.succeeded > 0 && report.failed == 0,
            "through Envoy: {} succeeded, {} failed, in {:?}:\n{stdout}",
            report.succeeded,
            report.failed,
            started.elapsed()
        );
        let per_request = |ticks: u64| {
            Duration::from_secs_f64(
                ticks as f64 / procfs::clock_ticks_per_second() as f64 / report.done as f64,
            )
        };
        Ok(Behind {
            requests_per_sec: report.requests_per_sec,
            server: per_request(server_after - server_before),
            envoy: per_request(envoy_after - envoy_before),
            others,
        })
    }
}

/// Every target behind an Envoy of its own, `rounds` runs each, targets alternating within a round:
/// its CPU per request (median and range) and ratio to `baseline`'s (hyper's), and Envoy's; then,
/// when both are measured, the worker on a Unix socket against the worker on TCP.
pub(super) fn report(
    targets: &[Target],
    baseline: &str,
    duration: u64,
    rounds: usize,
) -> anyhow::Result<String> {
    let envoy = xtask::envoy::install()?;
    let fronts = targets
        .iter()
        .map(|target| Front::start(&envoy, &target.upstream))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut runs: Vec<Vec<Behind>> = targets.iter().map(|_| Vec::new()).collect();
    let started = Instant::now();
    for round in 0..rounds {
        for i in (0..targets.len()).map(|i| (i + round) % targets.len()) {
            let target = &targets[i];
            let behind = fronts[i].measure(target.pid, duration)?;
            eprintln!(
                "round {}/{rounds} behind Envoy {:>13}: {:.0} req/s, server {} CPU/req, Envoy {} CPU/req, others {:.2} cores",
                round + 1,
                target.name,
                behind.requests_per_sec,
                format_duration(behind.server),
                format_duration(behind.envoy),
                behind.others,
            );
            runs[i].push(behind);
        }
    }
    let elapsed = started.elapsed();
    drop(fronts);
    let load = load_average()?;
    let base = targets
        .iter()
        .position(|t| t.name == baseline)
        .context("the baseline is always measured")?;
    let medians: Vec<f64> = runs
        .iter()
        .map(|r| median(r.iter().map(|b| b.server.as_secs_f64()).collect()))
        .collect();
    let mut report = String::new();
    machine_lines(&mut report, &cpu_line()?)?;
    let others: Vec<f64> = runs.iter().flatten().map(|b| b.others).collect();
    writeln!(
        report,
        "Machine: other work took median {:.2}, max {:.2} of the 2 cores during the runs; load average {:.2} {:.2} {:.2} at the end ({elapsed:.0?} of runs)",
        median(others.clone()),
        others.iter().copied().fold(0.0, f64::max),
        load[0],
        load[1],
        load[2],
    )?;
    writeln!(
        report,
        "`h2load -c10 -m10` into an Envoy (one worker thread, CPU {LOAD_CPU}) per server, HTTP/2 to the server (CPU {SERVER_CPU}); {rounds} rounds of {duration} s, median (range):\n"
    )?;
    let mut rows = vec![[
        "server".to_owned(),
        "requests/s".to_owned(),
        "server CPU/request".to_owned(),
        format!("server/{baseline}"),
        "Envoy CPU/request".to_owned(),
    ]];
    let time = |v: f64| format_duration(Duration::from_secs_f64(v));
    for (i, target) in targets.iter().enumerate() {
        let spread = |get: fn(&Behind) -> f64, format: &dyn Fn(f64) -> String| {
            median_and_range(runs[i].iter().map(get).collect(), format)
        };
        rows.push([
            target.name.clone(),
            spread(|b| b.requests_per_sec, &|v| format!("{v:.0}")),
            spread(|b| b.server.as_secs_f64(), &time),
            format!("{:.2}", medians[i] / medians[base]),
            spread(|b| b.envoy.as_secs_f64(), &time),
        ]);
    }
    report.push_str(&markdown(&rows, 1));
    let unix = targets
        .iter()
        .position(|t| matches!(t.upstream, Upstream::Unix(_)));
    let tcp = targets.iter().position(|t| t.name == "worker");
    if let (Some(unix), Some(tcp)) = (unix, tcp) {
        let (worker, envoy) = unix_over_tcp(&runs[tcp], &runs[unix]);
        let ratio = |v: f64| format!("{v:.2}");
        writeln!(
            report,
            "\nThe worker on a Unix socket over the worker on TCP, CPU per request, paired round by round, median (range): worker {}, Envoy {}.",
            median_and_range(worker, ratio),
            median_and_range(envoy, ratio),
        )?;
    }
    Ok(report)
}

/// The Unix socket's CPU per request over TCP's, for the server and for Envoy, round by round (the
/// two runs of a round are minutes apart at most, under the same other load).
fn unix_over_tcp(tcp: &[Behind], unix: &[Behind]) -> (Vec<f64>, Vec<f64>) {
    tcp.iter()
        .zip(unix)
        .map(|(t, u)| {
            (
                u.server.as_secs_f64() / t.server.as_secs_f64(),
                u.envoy.as_secs_f64() / t.envoy.as_secs_f64(),
            )
        })
        .unzip()
}

/// A static Envoy: a listener on `listen` routing every request to the one HTTP/2 upstream
/// `upstream`.
fn bootstrap_yaml(listen: u16, admin: u16, upstream: &Upstream) -> String {
    let upstream = match upstream {
        Upstream::Tcp(port) => {
            format!("{{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}")
        }
        Upstream::Unix(path) => format!("{{pipe: {{path: \"{}\"}}}}", path.display()),
    };
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: front
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {upstream}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_names_its_ports_and_an_http2_upstream() {
        let yaml = bootstrap_yaml(1, 2, &Upstream::Tcp(3));
        assert!(yaml.contains("port_value: 1}"), "{yaml}");
        assert!(yaml.contains("port_value: 2}"), "{yaml}");
        assert!(yaml.contains("port_value: 3}"), "{yaml}");
        assert!(yaml.contains("http2_protocol_options: {}"), "{yaml}");
        let yaml = bootstrap_yaml(1, 2, &Upstream::Unix("/run/w.sock".into()));
        assert!(
            yaml.contains(r#"address: {pipe: {path: "/run/w.sock"}}"#),
            "{yaml}"
        );
    }

    fn behind(server: f64, envoy: f64) -> Behind {
        Behind {
            requests_per_sec: 1.0,
            server: Duration::from_secs_f64(server),
            envoy: Duration::from_secs_f64(envoy),
            others: 0.0,
        }
    }

    #[test]
    fn unix_over_tcp_is_paired_round_by_round() {
        let tcp = [behind(10.0, 40.0), behind(20.0, 40.0)];
        let unix = [behind(8.0, 30.0), behind(18.0, 20.0)];
        let (worker, envoy) = unix_over_tcp(&tcp, &unix);
        assert_eq!(worker, vec![0.8, 0.9]);
        assert_eq!(envoy, vec![0.75, 0.5]);
    }
}
