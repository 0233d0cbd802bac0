//! The ports a start binds first (the gRPC port, the metrics), tried before the start by `peregrine
//! check`: a port another program holds stops `run` with `cannot bind`, and `check` warns of it
//! first (a warning: it is the host's state at this moment, not the config's).
//!
//! Invariant: nothing is tried while a supervisor answers on the config's control socket: the ports
//! are then its own, and a check of a running host's config must not call them taken.

use std::net::{SocketAddr, TcpListener};

use crate::config::{Config, Problem};

/// A problem for each port of `config` that this host would not let a start bind now.
pub fn unbindable(config: &Config) -> Vec<Problem> {
    if crate::status::client::query_within(
        &config.supervisor.control,
        std::time::Duration::from_secs(2),
    )
    .is_ok()
    {
        return Vec::new();
    }
    let mut ports = vec![("supervisor.bind", config.supervisor.bind)];
    if let Some(metrics) = config.supervisor.metrics {
        ports.push(("supervisor.metrics", metrics));
    }
    ports
        .into_iter()
        .filter(|(_, addr)| addr.port() != 0)
        .filter_map(|(key, addr)| {
            let error = TcpListener::bind(addr).err()?;
            Some(Problem {
                line: None,
                key: key.to_owned(),
                message: why(addr, &error),
            })
        })
        .collect()
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
        let found: Vec<String> = unbindable(&config)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with(&format!("supervisor.bind: 127.0.0.1:{port} is taken")),
            "{found:?}"
        );
        drop(taken);
        assert!(unbindable(&config).is_empty());
    }
}
