//! The real supervisor (`peregrine run`) and its workers.
//!
//! Workers run in process groups of their own and outlive a supervisor that dies (they wait for the
//! next one), so a [`Supervisor`] finds them by their environment (their control socket is in its
//! directory) and kills them when it is dropped, whatever happened to the supervisor.

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    time::Duration,
};

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::{ChildGuard, PeregrineToml, ServiceTable, Stage, paths::peregrine_path};

/// How long [`Supervisor::stop`] waits after SIGTERM before killing.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// A running `peregrine run CONFIG.toml`, killed on drop together with its workers (every process whose
/// control socket is in its directory).
#[derive(Debug)]
pub struct Supervisor {
    // Declared before `_temp` so the processes die before their directory is removed.
    process: ChildGuard,
    /// The program and arguments `peregrine run` is started through (empty: none), every time.
    wrapper: Vec<String>,
    binary: PathBuf,
    dir: PathBuf,
    config: PathBuf,
    /// The config path as `peregrine run` is given it: absolute, or relative to `dir`.
    run_arg: PathBuf,
    /// Supervisor processes killed by [`Supervisor::kill_and_start_again`] (for their logs).
    previous: Vec<ChildGuard>,
    /// Environment every `peregrine run` of this supervisor is started with (beside `RUST_LOG`).
    env: Vec<(String, String)>,
    restarts: u32,
    _temp: Option<TempDir>,
    /// Where the binary is staged for the workers' user, if it is: kept until the processes that
    /// run from it are gone (fields drop after [`Drop::drop`] killed them).
    _stage: Option<Stage>,
}

// === impl Supervisor ===

impl Supervisor {
    /// Writes `config_toml` to `peregrine.toml` in a fresh temporary directory, replacing every `{dir}`
    /// with that directory's path (for the control socket), and starts `peregrine run` on it.
    ///
    /// # Panics
    ///
    /// When `peregrine` cannot be built or started.
    #[track_caller]
    pub fn start(config_toml: &str) -> Self {
        Self::start_in_temp(&[], config_toml, false)
    }

    /// Writes `config_toml` to `dir/peregrine.toml`, every `{dir}` replaced by `dir`, and starts
    /// `binary run` on it, logging into `dir`. `RUST_LOG` is passed on, and set to `info` when unset.
    pub fn start_in(binary: &Path, dir: &Path, config_toml: &str) -> anyhow::Result<Self> {
        Self::start_wrapped(&[], binary, dir, config_toml, false)
    }

    /// Like [`Supervisor::start_in`], with `env` set for this `peregrine run` and every later one
    /// ([`Supervisor::start_again`]), e.g. `RUST_LOG`.
    pub fn start_in_with_env(
        binary: &Path,
        dir: &Path,
        config_toml: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self::start_wrapped_with_env(&[], binary, dir, config_toml, false, env)
    }

    /// Like [`Supervisor::start`], but started as `peregrine run peregrine.toml` from within the
    /// directory: every path in the config is relative unless it says otherwise.
    #[track_caller]
    pub fn start_relative(config_toml: &str) -> Self {
        Self::start_in_temp(&[], config_toml, true)
    }

    /// Like [`Supervisor::start`], but started through `wrapper` (a program and its arguments that
    /// exec the rest, e.g. `prlimit --nofile=1024:1024 --`, or a
    /// [`NetHost::wrapper`](crate::NetHost::wrapper)), so the supervisor keeps the pid. A supervisor
    /// started again ([`Supervisor::start_again`]) goes through the same wrapper.
    #[track_caller]
    pub fn start_wrapped_in(wrapper: &[&str], config_toml: &str) -> Self {
        Self::start_in_temp(wrapper, config_toml, false)
    }

    /// Like [`Supervisor::start`], but with no capabilities at all, even as root (through `setpriv`,
    /// which execs, so the supervisor keeps the pid): what a machine that forbids eBPF looks like.
    #[track_caller]
    pub fn start_without_capabilities(config_toml: &str) -> Self {
        let wrapper = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"];
        Self::start_in_temp(&wrapper, config_toml, false)
    }

    /// Like [`Supervisor::start_in`], but started (and started again) through `wrapper`, as
    /// [`Supervisor::start_wrapped_in`] is; every `{dir}` in `config_toml` becomes `dir` (e.g. in a
    /// [`FleetHostConfig`](crate::FleetHostConfig)'s control socket).
    pub fn start_wrapped_at(
        wrapper: &[&str],
        binary: &Path,
        dir: &Path,
        config_toml: &str,
    ) -> anyhow::Result<Self> {
        Self::start_wrapped(wrapper, binary, dir, config_toml, false)
    }

    /// Like [`Supervisor::start_wrapped_in`] (no wrapper when `wrapper` is empty), for workers of
    /// `stage`'s account: in a directory every user may enter (mode 0755, as the package's
    /// `/run/peregrine`), where the workers of a service with `user` open their registration
    /// socket, and from the `peregrine` binary as [`Stage::program`] gives it, so that a built-in
    /// worker (the supervisor's own binary, `current_exe`) can be executed by that account wherever
    /// the checkout is. The stage is kept as long as the supervisor.
    #[track_caller]
    pub fn start_open_to_workers(stage: &Stage, wrapper: &[&str], config_toml: &str) -> Self {
        let temp = stage.open_temp_dir("peregrine-");
        let binary = stage.program(&peregrine_path());
        let mut supervisor = Self::start_in_dir(wrapper, &binary, temp, config_toml, false);
        supervisor._stage = Some(stage.clone());
        supervisor
    }

    /// [`Supervisor::start_wrapped`] in a fresh temporary directory (`{dir}` in `config_toml`),
    /// removed when the supervisor is dropped.
    #[track_caller]
    fn start_in_temp(wrapper: &[&str], config_toml: &str, relative: bool) -> Self {
        let temp = tempfile::Builder::new()
            .prefix("peregrine-")
            .tempdir()
            .expect("a temp dir");
        Self::start_in_dir(wrapper, &peregrine_path(), temp, config_toml, relative)
    }

    /// Starts `binary` in `temp` (`{dir}` in `config_toml`), which is removed when the supervisor
    /// is dropped.
    #[track_caller]
    fn start_in_dir(
        wrapper: &[&str],
        binary: &Path,
        temp: TempDir,
        config_toml: &str,
        relative: bool,
    ) -> Self {
        let mut supervisor =
            Self::start_wrapped(wrapper, binary, temp.path(), config_toml, relative)
                .unwrap_or_else(|error| panic!("starting the supervisor: {error:?}"));
        supervisor._temp = Some(temp);
        supervisor
    }

    /// Starts `wrapper... binary run dir/peregrine.toml` (no wrapper when `wrapper` is empty), or
    /// `run peregrine.toml` if `relative`.
    fn start_wrapped(
        wrapper: &[&str],
        binary: &Path,
        dir: &Path,
        config_toml: &str,
        relative: bool,
    ) -> anyhow::Result<Self> {
        Self::start_wrapped_with_env(wrapper, binary, dir, config_toml, relative, Vec::new())
    }

    /// [`Supervisor::start_wrapped`] with `env` for every `peregrine run`.
    fn start_wrapped_with_env(
        wrapper: &[&str],
        binary: &Path,
        dir: &Path,
        config_toml: &str,
        relative: bool,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Self> {
        let config = dir.join("peregrine.toml");
        let run_arg = if relative {
            PathBuf::from("peregrine.toml")
        } else {
            config.clone()
        };
        let config_toml = config_toml.replace("{dir}", &dir.display().to_string());
        std::fs::write(&config, config_toml)
            .with_context(|| format!("writing {}", config.display()))?;
        let wrapper: Vec<String> = wrapper.iter().map(|s| (*s).to_owned()).collect();
        let mut command = run_command(&wrapper, binary, &run_arg, dir);
        command.envs(env.iter().map(|(k, v)| (k, v)));
        let process = ChildGuard::spawn("peregrine", &mut command, dir)?;
        Ok(Self {
            process,
            wrapper,
            binary: binary.to_path_buf(),
            dir: dir.to_path_buf(),
            run_arg,
            config,
            previous: Vec::new(),
            env,
            restarts: 0,
            _temp: None,
            _stage: None,
        })
    }

    /// The directory holding the config and the logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The `peregrine` binary it runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The config file.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The supervisor's pid.
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// The process, for signals, logs or exit status.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.process
    }

    /// `peregrine envoy-bootstrap` on this supervisor's config: the Envoy bootstrap YAML.
    pub fn envoy_bootstrap(&self) -> anyhow::Result<String> {
        envoy_bootstrap(&self.binary, &self.config)
    }

    /// `peregrine check` on this supervisor's config: what it printed.
    pub fn check(&self) -> anyhow::Result<String> {
        run_peregrine(&self.binary, "check", &[self.config.as_os_str()])
    }

    /// `peregrine status --json` on this supervisor's config: the parsed JSON object.
    pub fn status_json(&self) -> anyhow::Result<serde_json::Value> {
        let stdout = status(&self.binary, &[self.config.as_os_str(), "--json".as_ref()])?;
        serde_json::from_str(&stdout).with_context(|| format!("status --json printed {stdout:?}"))
    }

    /// The rows (`workers`) of `peregrine status --json`.
    fn status_workers(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let status = self.status_json()?;
        match status["workers"].as_array() {
            Some(workers) => Ok(workers.clone()),
            None => bail!("no workers in {status}"),
        }
    }

    /// The pids of the workers `peregrine status --json` lists.
    pub fn status_pids(&self) -> anyhow::Result<std::collections::BTreeSet<u32>> {
        Ok(self
            .status_workers()?
            .iter()
            .filter_map(|w| w["pid"].as_u64().map(|p| p as u32))
            .collect())
    }

    /// The `peregrine status --json` rows of `service`, by index.
    pub fn status_rows(
        &self,
        service: &str,
    ) -> anyhow::Result<std::collections::BTreeMap<u64, serde_json::Value>> {
        Ok(self
            .status_workers()?
            .into_iter()
            .filter(|row| row["service"] == service)
            .map(|row| (row["index"].as_u64().unwrap_or(u64::MAX), row))
            .collect())
    }

    /// `peregrine COMMAND CONFIG EXTRA...` (`restart`, `reload`) on this supervisor's config: what it
    /// prints; an error with its output if it fails.
    pub fn control(&self, command: &str, extra: &[&str]) -> anyhow::Result<String> {
        let output = Command::new(&self.binary)
            .arg(command)
            .arg(&self.config)
            .args(extra)
            .output()
            .with_context(|| format!("running {} {command}", self.binary.display()))?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() {
            bail!(
                "peregrine {command} failed ({}): {stdout}{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(stdout)
    }

    /// Replaces the config file with `config_toml`, every `{dir}` replaced by the supervisor's
    /// directory as at the start; apply it with [`Supervisor::control`]`("reload", &[])`.
    pub fn rewrite_config(&self, config_toml: &str) -> anyhow::Result<()> {
        let text = config_toml.replace("{dir}", &self.dir.display().to_string());
        std::fs::write(&self.config, text)
            .with_context(|| format!("writing {}", self.config.display()))
    }

    /// Sets the `count` of the config's one service to `count`; apply it with
    /// [`Supervisor::control`]`("reload", &[])`. An error when the config has not one service.
    pub fn set_count(&self, count: u32) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.config)
            .with_context(|| format!("reading {}", self.config.display()))?;
        let mut config: toml::Table =
            toml::from_str(&text).with_context(|| format!("parsing {}", self.config.display()))?;
        let services = config
            .get_mut("service")
            .and_then(toml::Value::as_table_mut)
            .context("the config has no service")?;
        let mut tables = services.iter_mut().map(|(_, table)| table);
        let (Some(toml::Value::Table(service)), None) = (tables.next(), tables.next()) else {
            bail!("set_count changes a config of one service");
        };
        service.insert("count".into(), toml::Value::Integer(count.into()));
        std::fs::write(&self.config, toml::to_string(&config)?)
            .with_context(|| format!("writing {}", self.config.display()))
    }

    /// `peregrine status` on this supervisor's config: the table it prints.
    pub fn status_table(&self) -> anyhow::Result<String> {
        status(&self.binary, &[self.config.as_os_str()])
    }

    /// SIGTERM, then waits for a clean exit (up to 10 s) before killing the group; returns the exit
    /// status, or an error if it had to kill.
    pub fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        self.process.stop(STOP_GRACE)
    }

    /// Logs of the supervisor (its workers write to the same files unless it redirects them).
    pub fn logs(&self) -> String {
        self.process.logs()
    }

    /// SIGKILLs the supervisor alone (its workers keep serving) and starts `peregrine run` again on the
    /// same config in the same directory, logging to `peregrine-N.*.log`. The old logs stay.
    pub fn kill_and_start_again(&mut self) -> anyhow::Result<()> {
        self.process.signal(rustix::process::Signal::KILL)?;
        crate::try_wait_until(
            Duration::from_secs(10),
            "the killed supervisor to exit",
            || self.process.try_wait(),
        )?;
        self.start_again()
    }

    /// SIGKILLs the supervisor (its process group) and every one of its workers: the host dies
    /// whole, as a machine that loses power; in a fleet its keys stay in etcd until its lease
    /// expires. [`Supervisor::start_again`] brings it back.
    pub fn kill_with_workers(&mut self) {
        let workers = self.worker_pids();
        self.process.kill();
        // A worker started between the two reads cannot register with a dead supervisor, but it
        // would wait for the next one: it goes too.
        for pid in workers.into_iter().chain(self.worker_pids()) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }

    /// Starts `peregrine run` again on the same config in the same directory (the one before must
    /// have exited), logging to `peregrine-N.*.log`. The old logs stay.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        self.restarts += 1;
        let name = format!("peregrine-{}", self.restarts + 1);
        let new = self.spawn_run(&name)?;
        let old = std::mem::replace(&mut self.process, new);
        self.previous.push(old);
        Ok(())
    }

    /// `peregrine run` on this config, from this directory, logging as `name`.
    fn spawn_run(&self, name: &str) -> anyhow::Result<ChildGuard> {
        let mut command = run_command(&self.wrapper, &self.binary, &self.run_arg, &self.dir);
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        ChildGuard::spawn(name, &mut command, &self.dir)
    }

    /// The logs of every supervisor process started here, oldest first.
    pub fn all_logs(&self) -> String {
        let mut logs: Vec<String> = self.previous.iter().map(ChildGuard::logs).collect();
        logs.push(self.process.logs());
        logs.join("\n")
    }

    /// The pids of the live workers whose control socket is in this supervisor's directory.
    pub fn worker_pids(&self) -> Vec<u32> {
        workers_in(&self.dir)
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.process.kill();
        // Workers outlive their supervisor: they go too, by their environment.
        for pid in workers_in(&self.dir) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

/// `wrapper... binary run CONFIG` from `dir` (no wrapper when `wrapper` is empty), with `RUST_LOG`
/// passed on, or `info` when unset.
fn run_command(wrapper: &[String], binary: &Path, config: &Path, dir: &Path) -> Command {
    let mut command = crate::process::wrapped(wrapper, binary);
    command.arg("run").arg(config).current_dir(dir);
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", "info");
    }
    // Metrics on a port of the kernel's choosing: tests run many supervisors at once, and the
    // default port (9464) would admit one. A test that scrapes sets its own.
    command.env("PEREGRINE_METRICS", "http://127.0.0.1:0");
    command
}

/// The live processes whose `PEREGRINE_CONTROL_SOCKET` is in `dir`: the workers of a supervisor
/// running there, and of earlier ones.
pub fn workers_in(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let wanted = format!("PEREGRINE_CONTROL_SOCKET={}/", dir.display());
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            // A zombie has an empty environment: it is no longer a worker.
            environ
                .split(|b| *b == 0)
                .any(|var| var.starts_with(wanted.as_bytes()))
                .then_some(pid)
        })
        .collect()
}

/// Runs `binary status ARGS` and returns its stdout; an error if it fails.
fn status(binary: &Path, args: &[&std::ffi::OsStr]) -> anyhow::Result<String> {
    run_peregrine(binary, "status", args)
}

/// Runs `binary envoy-bootstrap config` and returns its stdout.
pub(crate) fn envoy_bootstrap(binary: &Path, config: &Path) -> anyhow::Result<String> {
    run_peregrine(binary, "envoy-bootstrap", &[config.as_os_str()])
}

/// Runs `binary COMMAND ARGS` and returns its stdout; an error if it fails.
fn run_peregrine(
    binary: &Path,
    command: &str,
    args: &[&std::ffi::OsStr],
) -> anyhow::Result<String> {
    let output = Command::new(binary)
        .arg(command)
        .args(args)
        .output()
        .with_context(|| format!("running {} {command}", binary.display()))?;
    if !output.status.success() {
        bail!(
            "peregrine {command} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8(output.stdout)
        .with_context(|| format!("the output of peregrine {command} is not utf-8"))
}

/// A supervisor with one hello worker (service `web`) on a fixed free port of 127.0.0.1, serving once
/// this returns; no Envoy. For tests that talk to a worker directly.
///
/// # Panics
///
/// When the worker does not answer within 30 s.
#[track_caller]
pub fn one_worker() -> (Supervisor, std::net::SocketAddr) {
    let port = crate::free_port();
    let mut config = PeregrineToml::local(crate::free_port());
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{port}")));
    let supervisor = Supervisor::start(&config.toml());
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    crate::wait_until(Duration::from_secs(30), "the worker answering", || {
        crate::http_get(addr, "/").ok()
    });
    (supervisor, addr)
}
