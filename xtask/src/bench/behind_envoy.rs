//! `cargo xtask bench http --behind-envoy`: each server the way Peregrine runs it, behind Envoy over
//! HTTP/2. For each server, an Envoy of its own (one worker thread, pinned to the load generator's
//! core) has one static cluster of that server alone, with an explicit HTTP/2 upstream, so Envoy
//! speaks to it as it speaks to a worker. `h2load -c10 -m10` loads Envoy's listener, and both
//! processes' CPU time is counted.
//!
//! The figures are the server's CPU per request, with its ratio to hyper's, and Envoy's own CPU per
//! request beside them, so a reader sees which share of the whole path the server is.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, ensure};
use peregrine_contract::procfs;
use peregrine_e2e::{ChildGuard, TempDir, free_port, http_get, try_wait_until};

use super::{parse, server::LOAD_CPU};

/// One run behind Envoy.
#[derive(Clone, Copy, Debug)]
pub(super) struct Behind {
    pub(super) requests_per_sec: f64,
    /// The server's CPU time per request.
    pub(super) server: Duration,
    /// Envoy's CPU time per request (all its threads).
    pub(super) envoy: Duration,
}

/// An Envoy in front of the server on `port`; killed on drop.
#[derive(Debug)]
pub(super) struct Front {
    process: ChildGuard,
    _dir: TempDir,
    listen: u16,
}

impl Front {
    /// Starts Envoy (`envoy`) routing everything to `127.0.0.1:port` over HTTP/2, and waits until a
    /// request through it is answered.
    pub(super) fn start(envoy: &Path, port: u16) -> anyhow::Result<Front> {
        let dir = TempDir::new().context("a temporary directory")?;
        let (listen, admin) = (free_port(), free_port());
        let bootstrap = dir.path().join("envoy.yaml");
        std::fs::write(&bootstrap, bootstrap_yaml(listen, admin, port))
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
        })
    }
}

/// A static Envoy: a listener on `listen` routing every request to the one HTTP/2 upstream on
/// `upstream`.
fn bootstrap_yaml(listen: u16, admin: u16, upstream: u16) -> String {
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
            address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_names_its_ports_and_an_http2_upstream() {
        let yaml = bootstrap_yaml(1, 2, 3);
        assert!(yaml.contains("port_value: 1}"), "{yaml}");
        assert!(yaml.contains("port_value: 2}"), "{yaml}");
        assert!(yaml.contains("port_value: 3}"), "{yaml}");
        assert!(yaml.contains("http2_protocol_options: {}"), "{yaml}");
    }
}
