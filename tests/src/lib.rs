//! Harness for Peregrine's end-to-end tests: it starts the real supervisor (`peregrine run`), its workers
//! and a real Envoy, talks to them over plain HTTP/1.1 and waits for conditions with a deadline.
//!
//! Invariants: every process the harness starts lives in a [`ChildGuard`], whose `Drop` kills its whole
//! process group (so workers die with their supervisor even when a test panics) and reaps it; nothing
//! here sleeps for a fixed time, it polls with [`wait_until`]; stdout and stderr of every child go to log
//! files in the test's temporary directory and are printed when a test panics.
//!
//! Binaries: Envoy is found through [`envoy_path`] (the `ENVOY` variable, else the copy that
//! `cargo xtask envoy` installs) and `peregrine` through [`peregrine_path`] (the `PEREGRINE` variable,
//! else built once per test process). A test that needs Envoy calls [`envoy_or_skip`], which prints why
//! it skips when there is none, and fails instead when `PEREGRINE_REQUIRE_ENVOY` is set (as
//! `cargo xtask test` does), so a missing Envoy is never silently skipped in CI.
//!
//! Third-party HTTP servers run as workers (gunicorn, uvicorn, Node) come from
//! [`app_servers_or_skip`], which skips or fails the same way, and the applications they serve from
//! [`test_app`] (`tests/apps/`).
//!
//! Many hosts on one machine: a [`Network`] makes each host a network namespace on a bridge (root
//! only; [`netns_or_skip`]), runs processes there through [`NetHost::wrapper`] and the test's own
//! sockets through [`NetHost::run`], and cuts a host off and back; an [`EtcdCluster`] is etcd with
//! members that can be killed and started again ([`Etcd`]: one member, for the tests that need no
//! more); a [`FleetHostConfig`] is one host's supervisor config, and an [`AdminWatch`] records every
//! change of what an Envoy routes to.
//!
//! Workers under another user: [`proc_status`] reads a process's ids, capabilities and the processes
//! it forked from `/proc`, and looks up the [`Account`] a test runs workers as; a [`Stage`] gives
//! the paths of what those workers run (the supervisor's binary, gunicorn, the test applications)
//! as that account can reach them, copied into a directory every user may enter when the checkout
//! is somewhere it cannot (under `/root`, in a `mktemp -d` directory); the `register-as` binary
//! (`tests/src/bin/`) claims any registration it is told to.

#![forbid(unsafe_code)]

pub mod admin_watch;
pub mod config;
pub mod cpus;
pub mod deploy;
mod envoy;
mod etcd;
mod fleet;
mod hello_server;
mod http;
pub mod load;
mod netns;
mod paths;
pub mod pki;
pub mod proc_status;
mod process;
mod slots;
mod stack;
pub mod stage;
mod supervisor;
mod wait;

pub use admin_watch::AdminWatch;
pub use config::{PeregrineToml, ServiceTable};
pub use envoy::{Envoy, Host, hostname_pid, hosts};
pub use etcd::{Etcd, EtcdCluster, EtcdTls, etcd_or_skip, etcd_path};
pub use fleet::FleetHostConfig;
pub use hello_server::HelloServer;
pub use http::{http_get, http_get_with, http_post_json, worker_pid};
pub use load::{FailedRequest, Load, LoadOptions, LoadReport, requesting_while};
pub use netns::{NetHost, Network, netns_or_skip};
pub use paths::{
    AppServers, app_servers_or_skip, ebpf_or_skip, envoy_or_skip, envoy_path, example_path,
    free_port, gunicorn_command, install_program, peregrine_path, previous_release_or_skip,
    python_clients_or_skip, test_app, tool_or_skip,
};
/// Whether process `pid` has exited. A worker adopted from a killed supervisor is reaped by init, not
/// by the test: a zombie counts as gone too.
pub use peregrine_contract::procfs::gone;
pub use peregrine_testenv::{
    SKIPS_VAR, current_test, skip, target_dir, venv_envoy_binary, workspace_root,
};
pub use proc_status::{Account, Privileges, assert_unprivileged};
pub use process::ChildGuard;
pub use slots::{moved, route_keys, slots_by_pid, wait_for_slots};
pub use stack::{CLUSTER, Stack};
pub use stage::Stage;
pub use supervisor::{Supervisor, one_worker, workers_in};
pub use tempfile::TempDir;
pub use wait::{POLL_INTERVAL, try_wait_until, wait_until};
