//! `peregrine`: the supervisor's command line.

use std::{path::PathBuf, process::ExitCode};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use peregrine_supervisor::config::Config;

mod exit;
mod man;

use exit::Exit;

/// The configuration file a command reads when none is given: where the package installs it.
const DEFAULT_CONFIG: &str = "/etc/peregrine/peregrine.toml";

/// A worker supervisor that feeds Envoy: per-worker listeners, live endpoints over xDS.
///
/// Commands that read the configuration file take its path, `/etc/peregrine/peregrine.toml` when it
/// is left out.
#[derive(Debug, Parser)]
#[command(name = "peregrine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the supervisor: start the workers and serve xDS until SIGINT or SIGTERM.
    Run {
        /// The configuration file.
        #[arg(default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Check a configuration file and exit.
    Check {
        /// The configuration file.
        #[arg(default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Check as the package's unit will run it: with only the capabilities it leaves the
        /// supervisor, and refusing paths it hides (/home, /root: ProtectHome=yes).
        #[arg(long)]
        unit: bool,
    },
    /// Print an Envoy bootstrap (YAML) that routes to the configured services through this supervisor.
    EnvoyBootstrap {
        /// The configuration file.
        #[arg(default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Show the running supervisor's workers: pids, addresses, load and restarts.
    ///
    /// Asks the supervisor over its control socket (`supervisor.control` of CONFIG, overridden by
    /// PEREGRINE_CONTROL, or --socket); only the supervisor's own user may ask.
    Status {
        /// The configuration file the supervisor runs with.
        #[arg(default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// The supervisor's control socket (instead of reading CONFIG).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Print a JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Redraw the status every interval until Ctrl-C, like top (with --json: one JSON line per
        /// interval).
        #[arg(long)]
        watch: bool,
        /// The interval of --watch, in seconds (at least 0.1).
        #[arg(long, value_name = "SECS", default_value_t = 2.0, requires = "watch")]
        interval: f64,
        /// Print the JSON Schema of --json's object, each field described, and exit (no supervisor
        /// is asked).
        #[arg(long, conflicts_with_all = ["json", "watch", "socket"])]
        schema: bool,
    },
    /// Replace the running supervisor's workers without dropping a request.
    ///
    /// Re-reads CONFIG first and applies it as `reload` does (an invalid config changes nothing),
    /// then replaces the workers of SERVICE (every service without one), `restart_batch` at a time:
    /// each new worker registers before its predecessor is drained (DRAINING in EDS, ACKed by every
    /// Envoy) and stopped. SIGHUP to the supervisor does the same for every service.
    ///
    /// A single argument is CONFIG when it holds a `/` or ends in `.toml`, and SERVICE otherwise:
    /// `peregrine restart web` replaces the workers of `web` under the default config.
    Restart {
        /// The configuration file the supervisor runs with [default: /etc/peregrine/peregrine.toml].
        config: Option<PathBuf>,
        /// The service whose workers to replace (default: all).
        service: Option<String>,
        /// The supervisor's control socket (instead of `supervisor.control` of CONFIG).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// Make the running supervisor apply its config file again.
    ///
    /// Services scale up or down (the removed workers are drained first), workers whose command, url
    /// or environment changed are replaced one batch at a time, balancing changes reach Envoy. An
    /// invalid config is reported and changes nothing.
    Reload {
        /// The configuration file the supervisor runs with.
        #[arg(default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// The supervisor's control socket (instead of `supervisor.control` of CONFIG).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// Replace the running supervisor's program in place, keeping its workers serving.
    ///
    /// For a new `peregrine` binary installed over the one the supervisor was started from (the
    /// package does this on upgrade). The supervisor first checks the file at the path it was started
    /// from: `PROGRAM --version` must succeed and `PROGRAM check CONFIG` must pass, else it refuses
    /// and nothing changes. Then it tells systemd RELOADING=1 and execs that program with its
    /// original arguments, in the same process (systemd's main pid stays); the new image adopts the
    /// running workers and sends READY=1. This command waits until the supervisor answers again with
    /// every worker registered, then prints the old and new versions and the worker pids kept; it
    /// fails with the reason otherwise. SIGUSR2 to the supervisor starts the same upgrade.
    ///
    /// Exits 69 (EX_UNAVAILABLE) when no supervisor answers or it predates this command (restart it
    /// then), 1 when the upgrade was refused or did not complete. `systemctl restart` is not this:
    /// it stops the supervisor, which drains and stops every worker, and starts a new one with new
    /// workers.
    Upgrade {
        /// The configuration file the supervisor runs with.
        #[arg(default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// The supervisor's control socket (instead of `supervisor.control` of CONFIG).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// How long to wait for the new image to serve with its workers registered, in seconds.
        #[arg(long, value_name = "SECS", default_value_t = 60)]
        timeout: u64,
    },
    /// TLS material for the gRPC port and etcd.
    Tls {
        #[command(subcommand)]
        command: TlsCommand,
    },
    /// Run the built-in hello worker (started by `peregrine run`, which sets its environment).
    Worker,
    /// Start a server on the listener the supervisor passed as descriptor 3: sets `LISTEN_PID` to
    /// this process's pid (when `LISTEN_FDS` is set) and execs PROGRAM, which keeps it (started by
    /// `peregrine run` for `pass_socket` services; the name is `manager::EXEC_PASSED`).
    #[command(name = "exec-passed", hide = true)]
    ExecPassed {
        /// The server.
        program: PathBuf,
        /// Its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Wait for the supervisor SUPERVISOR to exit, then ORPHAN_TIMEOUT_MS; unless a supervisor
    /// answers on CONTROL by then, stop the workers of the lineage in `PEREGRINE_LINEAGE` (started
    /// by `peregrine run` for `pass_socket` services; the name is `manager::ORPHAN_WATCH`).
    #[command(name = "orphan-watch", hide = true)]
    OrphanWatch {
        /// The supervisor's pid (this process's parent).
        supervisor: u32,
        /// Its control socket.
        control: PathBuf,
        /// `orphan_timeout_ms`.
        orphan_timeout_ms: u64,
        /// `stop_timeout_ms`.
        stop_timeout_ms: u64,
    },
    /// Write the manual pages (`peregrine.1`, `peregrine-COMMAND.1` for each command, and
    /// `peregrine.toml.5` from the configuration reference) into DIR, from these very definitions
    /// (used to build the package).
    #[command(hide = true)]
    Man {
        /// Where to write them (made if missing).
        dir: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum TlsCommand {
    /// Write a test CA and certificates for a demo fleet into DIR: `ca.pem` with `server.pem` (the
    /// supervisors' gRPC port) and `envoy.pem` (Envoy's client certificate), `etcd-ca.pem` with
    /// `etcd-server.pem` and `etcd-client.pem`, each with its `.key` (owner-only). For trying TLS
    /// only: use certificates from your own CA in production.
    Init {
        /// Where to write them (made if missing; existing files are never overwritten).
        dir: PathBuf,
        /// Another DNS name or IP address the server certificates must name (a host the
        /// supervisors or etcd run on), besides `peregrine`, `localhost` and loopback; repeatable.
        #[arg(long, value_name = "NAME")]
        san: Vec<String>,
    },
}

/// `peregrine --version`: the version, the commit built from (see `build.rs`) and whether the eBPF
/// sampler is in this binary, e.g. `0.1.0 (1f00ca1, eBPF sampler built in)`.
fn version() -> &'static str {
    static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        version_line(
            env!("CARGO_PKG_VERSION"),
            env!("PEREGRINE_BUILD_COMMIT"),
            peregrine_ebpf::object().is_ok(),
        )
    });
    VERSION.as_str()
}

/// The text of [`version`] (after the command's name, which clap prints first).
fn version_line(version: &str, commit: &str, ebpf: bool) -> String {
    let sampler = if ebpf {
        "eBPF sampler built in"
    } else {
        "eBPF sampler not built in: procfs only"
    };
    format!("{version} ({commit}, {sampler})")
}

/// The command line's definition, with the version known at run time.
fn command() -> clap::Command {
    Cli::command().version(version())
}

fn main() -> ExitCode {
    // First: the program file and arguments an upgrade execs again.
    let image = peregrine_supervisor::upgrade::Image::capture(version());
    let cli = match command()
        .try_get_matches()
        .and_then(|matches| Cli::from_arg_matches(&matches))
    {
        Ok(cli) => cli,
        Err(error) => {
            // `--help` and `--version` end here too, on stdout.
            let _ = error.print();
            return if error.use_stderr() {
                Exit::Usage
            } else {
                Exit::Success
            }
            .into();
        }
    };
    if let Err(error) = init_tracing() {
        eprintln!("peregrine: {error}");
        return Exit::Usage.into();
    }
    match cli.command {
        Command::ExecPassed { program, args } => {
            let error = peregrine_supervisor::manager::exec_passed(&program, &args);
            eprintln!("peregrine: cannot run {}: {error}", program.display());
            ExitCode::from(127)
        }
        Command::OrphanWatch {
            supervisor,
            control,
            orphan_timeout_ms,
            stop_timeout_ms,
        } => {
            let orders = peregrine_supervisor::manager::WatchOrders {
                supervisor,
                control,
                orphan_timeout: std::time::Duration::from_millis(orphan_timeout_ms),
                stop_timeout: std::time::Duration::from_millis(stop_timeout_ms),
            };
            match peregrine_supervisor::manager::watch_orphans(&orders) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => fail(&anyhow::Error::new(error)),
            }
        }
        Command::Man { dir } => match man::write_pages(command(), &dir) {
            Ok(written) => {
                for path in &written {
                    println!("wrote {}", path.display());
                }
                ExitCode::SUCCESS
            }
            Err(error) => fail(&error),
        },
        Command::Tls {
            command: TlsCommand::Init { dir, san },
        } => match peregrine_supervisor::tls::init::init(&dir, &san) {
            Ok(written) => {
                for path in &written {
                    println!("wrote {}", path.display());
                }
                ExitCode::SUCCESS
            }
            Err(error) => fail(&anyhow::Error::new(error)),
        },
        Command::Check { config, unit } => {
            let sandbox = if unit {
                match peregrine_supervisor::config::UnitSandbox::packaged()
                    .and_then(|sandbox| sandbox.enter().map(|()| sandbox))
                {
                    Ok(sandbox) => Some(sandbox),
                    Err(error) => return fail(&anyhow::Error::new(error)),
                }
            } else {
                None
            };
            check(&config, sandbox.as_ref())
        }
        // Envoy's bootstrap depends on what the config says, not on who reads it: its users are
        // held to what a supervisor run as root may switch to.
        Command::EnvoyBootstrap { config } => {
            match Config::load_as(&config, peregrine_supervisor::config::Identity::root()) {
                Ok(c) => {
                    print!("{}", peregrine_supervisor::envoy_bootstrap_for(&c));
                    ExitCode::SUCCESS
                }
                Err(error) => config_error(&error),
            }
        }
        Command::Run { config: path } => {
            let config = match Config::load(&path) {
                Ok(c) => c,
                Err(error) => return config_error(&error),
            };
            // Reloads read the same file, whatever the working directory is by then.
            let path = std::fs::canonicalize(&path).unwrap_or(path);
            // Before any thread: one arena, whose freed memory goes back to the system whole.
            peregrine_supervisor::trim::one_arena();
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(error) => {
                    return fail(&anyhow::Error::new(error).context("cannot start the runtime"));
                }
            };
            match runtime.block_on(peregrine_supervisor::run::run(config, path, image)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => fail(&anyhow::Error::new(error)),
            }
        }
        Command::Status {
            config,
            socket,
            json,
            watch,
            interval,
            schema,
        } => {
            if schema {
                let text = serde_json::to_string_pretty(
                    &peregrine_supervisor::status::StatusView::schema(),
                )
                .unwrap_or_default();
                println!("{text}");
                return ExitCode::SUCCESS;
            }
            let socket = match socket {
                Some(socket) => socket,
                None => match peregrine_supervisor::config::control_socket(&config) {
                    Ok(socket) => socket,
                    Err(error) => return config_error(&error),
                },
            };
            if watch {
                let min = peregrine_supervisor::status::watch::MIN_INTERVAL;
                match std::time::Duration::try_from_secs_f64(interval) {
                    Ok(interval) if interval >= min => watch_status(&socket, json, interval),
                    _ => {
                        eprintln!(
                            "error: --interval must be at least {} seconds, got {interval}",
                            min.as_secs_f64()
                        );
                        Exit::Usage.into()
                    }
                }
            } else {
                status(&socket, json)
            }
        }
        Command::Restart {
            config,
            service,
            socket,
        } => {
            use peregrine_proto::v1;
            let (config, service) = restart_target(config, service);
            let request = v1::ControlRequest {
                action: Some(v1::control_request::Action::Restart(v1::Restart {
                    service: service.unwrap_or_default(),
                })),
            };
            control(&config, socket, request)
        }
        Command::Reload { config, socket } => {
            use peregrine_proto::v1;
            let request = v1::ControlRequest {
                action: Some(v1::control_request::Action::Reload(v1::Reload {})),
            };
            control(&config, socket, request)
        }
        Command::Upgrade {
            config,
            socket,
            timeout,
        } => {
            let socket = match socket {
                Some(socket) => socket,
                None => match peregrine_supervisor::config::control_socket(&config) {
                    Ok(socket) => socket,
                    Err(error) => return config_error(&error),
                },
            };
            let timeout = std::time::Duration::from_secs(timeout);
            match peregrine_supervisor::upgrade::client::upgrade(&socket, timeout) {
                Ok(outcome) => {
                    println!("{outcome}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    let exit = Exit::of_upgrade(&error);
                    report(&peregrine_contract::ErrorChain(&error).to_string());
                    exit.into()
                }
            }
        }
        Command::Worker => match peregrine_worker::run_hello() {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => fail(&anyhow::Error::new(error)),
        },
    }
}

/// `peregrine check`: the config, every file it names and, with the unit's `sandbox`, the paths
/// the unit hides; then what a start would warn of.
fn check(
    config: &std::path::Path,
    sandbox: Option<&peregrine_supervisor::config::UnitSandbox>,
) -> ExitCode {
    let c = match Config::load(config) {
        Ok(c) => c,
        Err(error) => return config_error(&error),
    };
    let mut problems = peregrine_supervisor::tls::check_files(&c);
    if let Some(sandbox) = sandbox {
        problems.extend(sandbox.hidden_paths(&c, config));
    }
    if !problems.is_empty() {
        for problem in problems {
            report(&format!("{}: {problem}", config.display()));
        }
        return Exit::Config.into();
    }
    // Workers this version would not adopt: while their supervisor runs, an upgrade in place
    // (which runs this check first) must not replace them without a drain.
    let foreign = peregrine_supervisor::adopt::foreign(&c);
    let supervised = peregrine_supervisor::instance::holder(&c.supervisor.control).is_some();
    if supervised && !foreign.is_empty() {
        report(&format!(
            "{}: {foreign}: {}",
            config.display(),
            peregrine_supervisor::adopt::RESTART_INSTEAD
        ));
        return Exit::Unavailable.into();
    }
    let workers: u32 = c.services.values().map(|s| s.count).sum();
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    println!(
        "{}: ok ({}, {})",
        config.display(),
        plural(c.services.len(), "service"),
        plural(workers as usize, "worker")
    );
    for service in c.services.values() {
        println!(
            "  {}: {}, {}",
            service.name,
            plural(service.count as usize, "worker"),
            service.balanced_on()
        );
    }
    // What `run` would warn of when it starts, here and now; and what the start would stop at on
    // this host now (a warning: it is this moment's, not the config's).
    for warning in peregrine_supervisor::run::warnings::at_start(&c, config) {
        warn(&format!("{}: {warning}", config.display()));
    }
    for problem in peregrine_supervisor::run::host_state::problems(&c) {
        warn(&format!("{}: {problem}", config.display()));
    }
    if !foreign.is_empty() {
        warn(&format!(
            "{}: {foreign}: {}",
            config.display(),
            peregrine_supervisor::adopt::STOPPED_AT_START
        ));
    }
    ExitCode::SUCCESS
}

/// The config file and service of `peregrine restart [CONFIG] [SERVICE]`: one argument is the file
/// when it looks like a path (a `/` in it, or a `.toml` name), else a service under the default
/// file. A service name has no `/`; one ending in `.toml` needs the file named before it.
fn restart_target(config: Option<PathBuf>, service: Option<String>) -> (PathBuf, Option<String>) {
    match (config, service) {
        (Some(first), None) => {
            let path_like = first.as_os_str().as_encoded_bytes().contains(&b'/')
                || first.extension().is_some_and(|e| e == "toml");
            match first.into_os_string().into_string() {
                Ok(name) if !path_like => (PathBuf::from(DEFAULT_CONFIG), Some(name)),
                Ok(path) => (PathBuf::from(path), None),
                Err(path) => (PathBuf::from(path), None),
            }
        }
        (config, service) => (
            config.unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG)),
            service,
        ),
    }
}

/// `peregrine restart` and `peregrine reload`: sends the command, waits for it to be carried out and
/// prints what it did; fails if anything failed.
fn control(
    config: &std::path::Path,
    socket: Option<PathBuf>,
    request: peregrine_proto::v1::ControlRequest,
) -> ExitCode {
    let socket = match socket {
        Some(socket) => socket,
        // An invalid config is still sent: the supervisor reports it (and changes nothing), but a
        // config that cannot name the socket cannot be helped.
        None => match peregrine_supervisor::config::control_socket(config) {
            Ok(socket) => socket,
            Err(error) => return config_error(&error),
        },
    };
    match peregrine_supervisor::status::control(&socket, request) {
        Ok(reply) => {
            println!("{}", reply.summary);
            for failure in &reply.failures {
                println!("  {failure}");
            }
            if reply.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => not_asked(&error),
    }
}

/// `peregrine status`: prints the supervisor's status as a table or JSON.
fn status(socket: &std::path::Path, json: bool) -> ExitCode {
    use std::io::Write;

    use peregrine_supervisor::status::{StatusView, query};
    let view = match query(socket) {
        Ok(status) => StatusView::from(status),
        Err(error) => return not_asked(&error),
    };
    let text = if json {
        match serde_json::to_string_pretty(&view) {
            Ok(text) => text + "\n",
            Err(error) => return fail(&anyhow::Error::new(error)),
        }
    } else {
        view.table()
    };
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        // A reader that stopped early (`| head`) is not an error.
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
            fail(&anyhow::Error::new(error).context("cannot write to stdout"))
        }
        _ => ExitCode::SUCCESS,
    }
}

/// `peregrine status --watch`: a frame every `interval` until Ctrl-C (or a reader that goes away).
fn watch_status(socket: &std::path::Path, json: bool, interval: std::time::Duration) -> ExitCode {
    use std::io::{IsTerminal, Write};

    use peregrine_supervisor::status::{StatusView, query, watch};
    let clear = std::io::stdout().is_terminal();
    loop {
        let started = std::time::Instant::now();
        let answer = query(socket)
            .map(StatusView::from)
            .map_err(|e| peregrine_contract::ErrorChain(&e).to_string());
        let status = answer.as_ref().map_err(String::as_str);
        let text = if json {
            watch::json_line(status)
        } else {
            watch::frame(
                clear,
                interval,
                socket,
                std::time::SystemTime::now(),
                status,
            )
        };
        let mut stdout = std::io::stdout().lock();
        match stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush())
        {
            Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {
                return ExitCode::SUCCESS;
            }
            Err(error) => {
                return fail(&anyhow::Error::new(error).context("cannot write to stdout"));
            }
            Ok(()) => {}
        }
        drop(stdout);
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}

/// A config that could not be loaded: one `error:` line per problem, each naming the file.
fn config_error(error: &peregrine_supervisor::config::ConfigError) -> ExitCode {
    for problem in peregrine_contract::ErrorChain(error).to_string().lines() {
        report(problem);
    }
    Exit::of_config(error).into()
}

/// A supervisor that could not be asked (not running, not ours to ask, silent).
fn not_asked(error: &peregrine_supervisor::status::StatusError) -> ExitCode {
    report(&peregrine_contract::ErrorChain(error).to_string());
    Exit::of_status(error).into()
}

fn fail(error: &anyhow::Error) -> ExitCode {
    report(&format!("{error:#}"));
    ExitCode::FAILURE
}

/// A warning the command gives and goes on, on stderr: `warning: ...`, or a JSON log line.
fn warn(warning: &str) {
    if LOG_FORMAT.get() == Some(&LogFormat::Json) {
        tracing::warn!("{warning}");
    } else {
        eprintln!("warning: {warning}");
    }
}

/// The error that ends the command, on stderr: `error: ...` for a person, or a JSON log line when
/// the logs are JSON, so that a log collector reads every line.
fn report(error: &str) {
    if LOG_FORMAT.get() == Some(&LogFormat::Json) {
        tracing::error!("{error}");
    } else {
        eprintln!("error: {error}");
    }
}

/// The format [`init_tracing`] set up.
static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// How log lines are written (`PEREGRINE_LOG_FORMAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    /// One human-readable line per event (the default).
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the event's fields,
    /// for log collectors.
    Json,
}

/// A `PEREGRINE_LOG_FORMAT` that names no format.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("PEREGRINE_LOG_FORMAT must be \"text\" or \"json\", got {0:?}")]
struct UnknownLogFormat(String);

impl LogFormat {
    /// The format `PEREGRINE_LOG_FORMAT` names (`None`: unset).
    fn parse(value: Option<&str>) -> Result<LogFormat, UnknownLogFormat> {
        match value {
            None | Some("" | "text") => Ok(LogFormat::Text),
            Some("json") => Ok(LogFormat::Json),
            Some(other) => Err(UnknownLogFormat(other.to_owned())),
        }
    }
}

/// Logs to stderr, as text or JSON lines (`PEREGRINE_LOG_FORMAT`), filtered by `PEREGRINE_LOG` (or
/// `RUST_LOG`). A format it does not know is a usage error: nothing runs.
fn init_tracing() -> Result<(), UnknownLogFormat> {
    use tracing_subscriber::EnvFilter;
    let format = LogFormat::parse(std::env::var("PEREGRINE_LOG_FORMAT").ok().as_deref())?;
    let _ = LOG_FORMAT.set(format);
    let filter = std::env::var("PEREGRINE_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| {
            // h2 warns once per frame about what any peer can send (a PING ACK it never asked
            // for, say): by default only its errors are logged. RUST_LOG=h2=warn shows them.
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,h2=error"))
        });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use std::path::PathBuf;

    use super::{
        Cli, Command, DEFAULT_CONFIG, LogFormat, UnknownLogFormat, restart_target, version_line,
    };

    #[test]
    fn the_launcher_of_passed_socket_servers_takes_the_servers_own_flags() {
        let cli = Cli::try_parse_from([
            "peregrine",
            peregrine_supervisor::manager::EXEC_PASSED,
            "--",
            "/usr/bin/gunicorn",
            "--bind",
            "fd://3",
            "-w",
            "1",
        ])
        .unwrap();
        let Command::ExecPassed { program, args } = cli.command else {
            panic!("not exec-passed: {:?}", cli.command);
        };
        assert_eq!(program.to_str(), Some("/usr/bin/gunicorn"));
        assert_eq!(args, ["--bind", "fd://3", "-w", "1"]);
    }

    #[test]
    fn the_orphan_watcher_reads_back_the_orders_it_is_started_with() {
        use peregrine_supervisor::manager::{ORPHAN_WATCH, WatchOrders};
        let orders = WatchOrders {
            supervisor: 4242,
            control: PathBuf::from("/run/peregrine/peregrine.sock"),
            orphan_timeout: std::time::Duration::from_millis(60_000),
            stop_timeout: std::time::Duration::from_millis(2_500),
        };
        let cli = Cli::try_parse_from(
            ["peregrine".to_owned(), ORPHAN_WATCH.to_owned()]
                .into_iter()
                .chain(orders.to_args()),
        )
        .unwrap();
        let Command::OrphanWatch {
            supervisor,
            control,
            orphan_timeout_ms,
            stop_timeout_ms,
        } = cli.command
        else {
            panic!("not orphan-watch: {:?}", cli.command);
        };
        assert_eq!(
            (supervisor, control, orphan_timeout_ms, stop_timeout_ms),
            (4242, orders.control, 60_000, 2_500)
        );
    }

    #[test]
    fn the_version_names_the_commit_and_the_sampler() {
        assert_eq!(
            version_line("0.1.0", "1f00ca1", true),
            "0.1.0 (1f00ca1, eBPF sampler built in)"
        );
        assert_eq!(
            version_line("0.1.0", "unknown", false),
            "0.1.0 (unknown, eBPF sampler not built in: procfs only)"
        );
    }

    #[test]
    fn every_command_that_reads_the_config_defaults_to_the_installed_one() {
        for name in [
            "run",
            "check",
            "envoy-bootstrap",
            "status",
            "reload",
            "upgrade",
        ] {
            let cli = Cli::try_parse_from(["peregrine", name]).unwrap();
            let config = match cli.command {
                Command::Run { config }
                | Command::Check { config, .. }
                | Command::EnvoyBootstrap { config }
                | Command::Status { config, .. }
                | Command::Reload { config, .. }
                | Command::Upgrade { config, .. } => config,
                other => panic!("{name} parsed as {other:?}"),
            };
            assert_eq!(config, PathBuf::from(DEFAULT_CONFIG), "{name}");
        }
        let cli = Cli::try_parse_from(["peregrine", "restart"]).unwrap();
        let Command::Restart {
            config, service, ..
        } = cli.command
        else {
            panic!("not restart: {:?}", cli.command);
        };
        assert_eq!(
            restart_target(config, service),
            (PathBuf::from(DEFAULT_CONFIG), None)
        );
    }

    #[test]
    fn a_single_restart_argument_is_the_config_when_it_looks_like_a_path() {
        let target = |args: &[&str]| {
            let cli = Cli::try_parse_from(["peregrine", "restart"].iter().chain(args)).unwrap();
            let Command::Restart {
                config, service, ..
            } = cli.command
            else {
                panic!("not restart: {:?}", cli.command);
            };
            let (config, service) = restart_target(config, service);
            (config.display().to_string(), service)
        };
        let named =
            |config: &str, service: Option<&str>| (config.to_owned(), service.map(str::to_owned));
        assert_eq!(target(&["web"]), named(DEFAULT_CONFIG, Some("web")));
        assert_eq!(target(&["api.v2"]), named(DEFAULT_CONFIG, Some("api.v2")));
        assert_eq!(target(&["peregrine.toml"]), named("peregrine.toml", None));
        assert_eq!(target(&["./conf"]), named("./conf", None));
        assert_eq!(
            target(&["/etc/p.toml", "web"]),
            named("/etc/p.toml", Some("web"))
        );
        assert_eq!(target(&["conf", "web"]), named("conf", Some("web")));
    }

    #[test]
    fn the_log_format_is_text_unless_json_and_anything_else_is_an_error() {
        assert_eq!(LogFormat::parse(None), Ok(LogFormat::Text));
        assert_eq!(LogFormat::parse(Some("text")), Ok(LogFormat::Text));
        assert_eq!(LogFormat::parse(Some("json")), Ok(LogFormat::Json));
        let unknown = LogFormat::parse(Some("JSON")).unwrap_err();
        assert_eq!(unknown, UnknownLogFormat("JSON".into()));
        assert_eq!(
            unknown.to_string(),
            "PEREGRINE_LOG_FORMAT must be \"text\" or \"json\", got \"JSON\""
        );
    }
}
