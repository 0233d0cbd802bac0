//! The worker sockets: one per service that runs as a `user` of its own, beside the control socket
//! (`<control>.<service>.workers`, [`crate::config::worker_socket`]), where that service's workers
//! register. The control socket is owner-only; a worker of another user could not open it.
//!
//! A worker socket belongs to the supervisor's user and the service's group, mode 0660: the service's
//! workers (which run with that group) may connect, other users may not. What it admits is decided
//! per connection all the same ([`super::admission`]): a live worker of this service, as the user it
//! was started as; registrations only.
//!
//! Invariant: a worker socket is open for every service with a `user` in the config last applied,
//! before any of its workers starts, with that service's group; a socket is closed and its file
//! removed once its service no longer has a `user` (connections it accepted keep going: a worker
//! registered there stays registered until it exits).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use super::{BindError, Server, Socket, bind_replacing, serve_on};
use crate::config::{Config, worker_socket};

/// The open worker sockets, by service.
#[derive(Debug)]
pub struct WorkerSockets {
    control: PathBuf,
    server: Server,
    open: HashMap<String, Open>,
    /// Whether connections are accepted yet ([`serve`](WorkerSockets::serve)).
    serving: bool,
}

/// One open worker socket: bound, then served until dropped; then its file is removed.
#[derive(Debug)]
struct Open {
    path: PathBuf,
    gid: u32,
    /// Until it is served: the listener (connections wait in its backlog) and what it is.
    bound: Option<(tokio::net::UnixListener, Socket)>,
    /// Once it is served: the accept loop.
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Open {
    fn serve(&mut self, server: &Server) {
        if let Some((listener, socket)) = self.bound.take() {
            self.task = Some(tokio::spawn(serve_on(listener, server.clone(), socket)));
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl WorkerSockets {
    /// None open yet, for the control socket at `control` (whose instance lock the caller holds:
    /// a socket file at a worker socket's path is then a stale one).
    pub fn new(control: &Path, server: Server) -> Self {
        WorkerSockets {
            control: control.to_owned(),
            server,
            open: HashMap::new(),
            serving: false,
        }
    }

    /// Accepts connections on the sockets open now and on those opened later. The supervisor calls
    /// it once the workers it adopted are in the process table: a registration read earlier would
    /// be refused, and a refused worker stops.
    pub fn serve(&mut self) {
        self.serving = true;
        for open in self.open.values_mut() {
            open.serve(&self.server);
        }
    }

    /// Opens a worker socket for each service of `config` with a `user` that has none, and gives an
    /// open one its service's group if that changed. Call before the config's workers start.
    pub fn open(&mut self, config: &Config) -> Result<(), BindError> {
        for service in config.services.values() {
            let Some(account) = &service.account else {
                continue;
            };
            let path = worker_socket(&self.control, &service.name);
            if let Some(open) = self.open.get_mut(&service.name) {
                if open.gid != account.gid {
                    give_group(&open.path, account.gid)?;
                    open.gid = account.gid;
                }
            } else {
                let listener = bind_replacing(&path, 0o660)?;
                give_group(&path, account.gid)?;
                let socket = Socket::Workers {
                    service: service.name.clone(),
                };
                let mut open = Open {
                    path: path.clone(),
                    gid: account.gid,
                    bound: Some((listener, socket)),
                    task: None,
                };
                if self.serving {
                    open.serve(&self.server);
                }
                tracing::info!(service = %service.name, path = %path.display(), user = %account.user, gid = account.gid, "Worker socket open");
                self.open.insert(service.name.clone(), open);
            }
            // The rule `peregrine check` judges the same socket by.
            if let Some((dir, mode)) = account.unsearchable_folder(&path) {
                return Err(BindError::Unreachable {
                    service: service.name.clone(),
                    user: account.user.clone(),
                    path: path.clone(),
                    dir,
                    mode,
                });
            }
        }
        Ok(())
    }

    /// Closes the sockets of services that no longer have a `user` in `config`. Call once the
    /// config's workers have replaced the old ones.
    pub fn retain(&mut self, config: &Config) {
        self.open.retain(|service, open| {
            let keep = config
                .services
                .get(service)
                .is_some_and(|s| s.account.is_some());
            if !keep {
                tracing::info!(%service, path = %open.path.display(), "Worker socket closed");
            }
            keep
        });
    }
}

/// Gives the socket at `path` the group `gid` (the supervisor's user keeps it).
fn give_group(path: &Path, gid: u32) -> Result<(), BindError> {
    std::os::unix::fs::chown(path, None, Some(gid)).map_err(|source| BindError::Io {
        path: path.to_owned(),
        source,
    })
}
