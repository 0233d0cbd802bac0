//! What a start would meet on this host at this moment, foreseen by `peregrine check`: a port
//! another program holds (the gRPC port, the metrics, an ORCA listener beside the gRPC port), the
//! control socket's lock held by a process that does not answer on the socket, an eBPF sampler that
//! cannot load. Each stops `run` with an error; `check` warns of it first (a warning: it is the
//! host's state now, not the config's).
//!
//! Invariant: nothing is tried while a supervisor answers on the config's control socket: the ports,
//! the lock and the sampler are then its own, and a check of a running host's config must not call
//! them taken. Only the sampler is loaded to be known, and unloaded at once.

use std::{
    collections::BTreeSet,
    net::{SocketAddr, TcpListener},
    os::unix::fs::FileTypeExt,
    time::Duration,
};

use crate::config::{Config, Problem, SamplerSetting};

/// How long a supervisor may take to answer before it is taken for none.
const ANSWER: Duration = Duration::from_secs(2);

/// A problem for each thing a start of `config` would stop at on this host now.
pub fn problems(config: &Config) -> Vec<Problem> {
    let control = &config.supervisor.control;
    if crate::status::client::query_within(control, ANSWER).is_ok() {
        return Vec::new();
    }
    let mut problems = Vec::new();
    if let Some(pid) = crate::instance::holder(control)
        // The supervisor whose upgrade runs this check holds the lock, and is busy with it.
        .filter(|pid| *pid != rustix::process::getppid().map_or(0, |p| p.as_raw_pid() as u32))
    {
        problems.push(Problem {
            line: None,
            key: "supervisor.control".into(),
            message: format!(
                "process {pid} holds the control socket's lock ({}) and does not answer on {}: the \
                 start would stop there (\"in use by another running supervisor\"); stop that \
                 supervisor first",
                crate::instance::lock_path(control).display(),
                control.display()
            ),
        });
    }
    problems.extend(registration_sockets(config));
    problems.extend(unbindable(config));
    problems.extend(sampler(config));
    problems
}

/// The control socket's path taken by a file that is not a socket, and worker sockets that a
/// service's user could not reach: the start would not bind them.
fn registration_sockets(config: &Config) -> Vec<Problem> {
    let control = &config.supervisor.control;
    let mut problems = Vec::new();
    if std::fs::symlink_metadata(control).is_ok_and(|meta| !meta.file_type().is_socket()) {
        problems.push(Problem {
            line: None,
            key: "supervisor.control".into(),
            message: format!(
                "{} exists and is not a socket: the start would stop there (it removes only a \
                 socket a stopped supervisor left)",
                control.display()
            ),
        });
    }
    for service in config.services.values() {
        let Some(account) = &service.account else {
            continue;
        };
        let socket = crate::config::worker_socket(control, &service.name);
        if let Some((dir, mode)) = account.unsearchable_folder(&socket) {
            problems.push(Problem {
                line: None,
                key: format!("service.{}.user", service.name),
                message: format!(
                    "{} cannot reach its workers' registration socket {}: {} (mode {mode:04o}) is \
                     not searchable by that user: the start would stop there; put the control \
                     socket in a directory every service's user may search",
                    account.user,
                    socket.display(),
                    dir.display()
                ),
            });
        }
    }
    problems
}

/// A problem for each port of `config` that this host would not let a start bind now.
fn unbindable(config: &Config) -> Vec<Problem> {
    let bind = config.supervisor.bind;
    let mut ports = vec![("supervisor.bind".to_owned(), bind, None)];
    if let Some(metrics) = config.supervisor.metrics {
        ports.push(("supervisor.metrics".to_owned(), metrics, None));
    }
    if config.supervisor.sampler != SamplerSetting::Off {
        // Envoy opens the ORCA streams of a service's workers to their IP with the gRPC port: where
        // the gRPC port does not cover that IP, the start listens there too.
        let orca: BTreeSet<String> = config
            .services
            .values()
            .filter(|s| s.orca())
            .map(|s| s.name.clone())
            .collect();
        for addr in super::envoy_facing::orca_listen_addresses(config, &orca, bind) {
            let services = orca.iter().cloned().collect::<Vec<_>>().join(", ");
            ports.push(("supervisor.bind".to_owned(), addr, Some(services)));
        }
    }
    ports
        .into_iter()
        .filter(|(_, addr, _)| addr.port() != 0)
        .filter_map(|(key, addr, orca)| {
            let error = TcpListener::bind(addr).err()?;
            let mut message = why(addr, &error);
            if let Some(services) = orca {
                message = format!(
                    "ORCA of {services}: their workers listen on {}, and Envoy opens their ORCA \
                     streams to that IP with the gRPC port, so the start listens on {addr} too: \
                     {message}",
                    addr.ip()
                );
            }
            Some(Problem {
                line: None,
                key,
                message,
            })
        })
        .collect()
}

/// `sampler = "ebpf"` where the eBPF sampler cannot load: loaded, and unloaded at once, to know.
fn sampler(config: &Config) -> Option<Problem> {
    if config.supervisor.sampler != SamplerSetting::Ebpf {
        return None;
    }
    let error = crate::sampler::ebpf::EbpfSource::load(1).err()?;
    Some(Problem {
        line: None,
        key: "supervisor.sampler".into(),
        message: format!(
            "the eBPF sampler cannot load on this host as this user: {}: the start would stop \
             there (run the check as the start runs, or use \"auto\" or \"procfs\")",
            crate::sampler::ErrorChain(&error)
        ),
    })
}

/// Why `addr` cannot be bound, and what to do.
fn why(addr: SocketAddr, error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "{addr} is taken by another program (`ss -ltnp 'sport = :{}'` names it): the start \
             would stop there",
            addr.port()
        ),
        std::io::ErrorKind::AddrNotAvailable => format!(
            "{addr}: no interface of this host has that address: the start would stop there"
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "{addr}: this user may not bind a port below 1024 (run the check as root, as the \
             start runs): {error}"
        ),
        _ => format!("cannot bind {addr}: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::run::RunError;

    /// Where `peregrine check` foresees each way `run` refuses to start. The match has no wildcard:
    /// a new refusal does not compile until its counterpart is named here (and tested, where a test
    /// can make the host refuse).
    fn foreseen_by(error: &RunError) -> &'static str {
        match error {
            RunError::Lock(_) => "problems: a lock held by a process that does not answer",
            RunError::Registration(_) => {
                "problems: a control path that is not a socket, a worker socket out of reach"
            }
            RunError::Grpc { .. } | RunError::Metrics { .. } | RunError::OrcaBind { .. } => {
                "problems: a port another program holds"
            }
            RunError::Sampler { .. } => "problems: an eBPF sampler that cannot load",
            RunError::Tls(_) => "tls::check_files: every TLS file read",
            RunError::Workers(_) => "Config::load: every service's program, user and files",
            RunError::Fleet(_) => "fleet::preflight, at the start: etcd is not asked by check",
            RunError::Serve(_) | RunError::Signals(_) | RunError::Counters(_) => {
                "none: the running process's own resources, known only once it runs"
            }
        }
    }

    #[test]
    fn every_refusal_of_run_is_named_with_its_counterpart() {
        let refusal = RunError::Signals(std::io::Error::other("x"));
        assert!(foreseen_by(&refusal).starts_with("none"));
    }

    #[test]
    fn a_lock_held_by_a_process_that_does_not_answer_and_a_file_in_the_sockets_place() {
        let dir = tempfile::tempdir().unwrap();
        let control = dir.path().join("p.sock");
        let config = Config::parse(
            &format!(
                "[supervisor]\nbind = \"http://127.0.0.1:0\"\nmetrics = \"\"\ncontrol = \"{}\"\n\
                 [service.a]\n",
                control.display()
            ),
            dir.path(),
            &HashMap::new(),
        )
        .unwrap();
        let none: Vec<String> = problems(&config).iter().map(ToString::to_string).collect();
        assert!(none.is_empty(), "{none:?}");
        let lock = crate::instance::InstanceLock::acquire(&control).unwrap();
        std::fs::write(&control, "").unwrap();
        let found: Vec<String> = problems(&config).iter().map(ToString::to_string).collect();
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].starts_with(&format!(
                "supervisor.control: process {} holds the control socket's lock",
                std::process::id()
            )),
            "{found:?}"
        );
        assert!(found[1].contains("exists and is not a socket"), "{found:?}");
        drop(lock);
    }

    #[test]
    fn an_orca_listener_beside_the_grpc_port_that_is_taken() {
        // Workers on 127.0.0.2 with the gRPC port on 127.0.0.1: Envoy dials 127.0.0.2 at the
        // gRPC port for their ORCA streams, so the start listens there too.
        let taken = TcpListener::bind("127.0.0.2:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let dir = tempfile::tempdir().unwrap();
        let config = Config::parse(
            &format!(
                "[supervisor]\nbind = \"http://127.0.0.1:{port}\"\ncontrol = \"{}/p.sock\"\n\
                 [service.a]\nurl = \"http://127.0.0.2:0\"\n",
                dir.path().display()
            ),
            dir.path(),
            &HashMap::new(),
        )
        .unwrap();
        let found: Vec<String> = problems(&config).iter().map(ToString::to_string).collect();
        assert!(
            found.iter().any(|f| f
                .starts_with("supervisor.bind: ORCA of a: their workers listen on 127.0.0.2")
                && f.contains(&format!("127.0.0.2:{port} is taken"))),
            "{found:?}"
        );
    }

    #[test]
    fn a_port_another_program_holds_is_named_and_a_free_one_is_not() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let dir = tempfile::tempdir().unwrap();
        let config = Config::parse(
            &format!(
                "[supervisor]\nbind = \"http://127.0.0.1:{port}\"\nmetrics = \"http://127.0.0.1:0\"\n\
                 control = \"{}/p.sock\"\n[service.a]\n",
                dir.path().display()
            ),
            dir.path(),
            &HashMap::new(),
        )
        .unwrap();
        let found: Vec<String> = problems(&config).iter().map(ToString::to_string).collect();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with(&format!("supervisor.bind: 127.0.0.1:{port} is taken")),
            "{found:?}"
        );
        drop(taken);
        assert!(problems(&config).is_empty());
    }
}
