//! What the supervisor warns of at start about its workers' privileges: a service whose workers run
//! as root, a private key that a service's user may read, and workers that would bind a privileged
//! port without the capability to.
//!
//! Each is the operator's to fix, and none stops a start (a demo runs as root, a key's mode is the
//! file's owner's business, the unprivileged port range a sysctl that may change), so they are
//! warnings, once per start and per reload.

use std::{os::unix::fs::MetadataExt, path::Path};

use peregrine_contract::url::BindUrl;

use crate::config::{Account, Config};

/// Logs a warning for each service whose workers run as root, for each private key in `config` that
/// the workers of a service with a `user` could read, and for each service whose workers would bind a
/// privileged port themselves.
pub(super) fn warn(config: &Config) {
    let root = rustix::process::geteuid().is_root();
    let unprivileged_from = unprivileged_port_start();
    for service in config.services.values() {
        if let BindUrl::Tcp { port, .. } = service.url_for(0)
            && !service.pass_socket
            && port != 0
            && port < unprivileged_from
        {
            tracing::warn!(service = %service.name, port, "These workers bind a privileged port themselves, and hold no capability to: set pass_socket = true (the supervisor binds it and passes it), or use a port from {unprivileged_from}");
        }
        match &service.account {
            None if root => {
                tracing::warn!(service = %service.name, "These workers run as root (without capabilities): they can read and write every file root owns, including this supervisor's keys; set `user` in [service.{}]", service.name);
            }
            None => {}
            Some(account) => {
                for (what, key) in private_keys(config) {
                    if let Some(mode) = readable_by(key, account) {
                        tracing::warn!(service = %service.name, user = %account.user, key = %key.display(), mode = format!("{mode:04o}"), "The workers of this service can read the {what}: make it owner-only (chmod 600), owned by the supervisor's user");
                    }
                }
            }
        }
    }
}

/// The lowest port a process without CAP_NET_BIND_SERVICE may bind in this network namespace
/// (`net.ipv4.ip_unprivileged_port_start`, 1024 unless lowered).
fn unprivileged_port_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(1024)
}

/// The private keys a config names, each with what it is.
fn private_keys(config: &Config) -> Vec<(&'static str, &Path)> {
    let mut keys = Vec::new();
    if let Some(tls) = &config.supervisor.tls {
        keys.push(("gRPC port's TLS key", tls.identity.key.as_path()));
    }
    if let Some(identity) = config.envoy.tls.as_ref().and_then(|t| t.identity.as_ref()) {
        keys.push(("Envoy's client key", identity.key.as_path()));
    }
    let etcd = config.cluster.as_ref().and_then(|c| c.tls.as_ref());
    if let Some(identity) = etcd.and_then(|t| t.identity.as_ref()) {
        keys.push(("etcd client key", identity.key.as_path()));
    }
    keys
}

/// The mode of `file` if `account` may read it (and search every directory on the way to it).
fn readable_by(file: &Path, account: &Account) -> Option<u32> {
    let ids = |meta: &std::fs::Metadata| (meta.uid(), meta.gid(), meta.mode());
    for dir in file.ancestors().skip(1) {
        let meta = std::fs::metadata(dir).ok()?;
        if !account.may(0o1, ids(&meta)) {
            return None;
        }
    }
    let meta = std::fs::metadata(file).ok()?;
    account.may(0o4, ids(&meta)).then_some(meta.mode() & 0o7777)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn stranger() -> Account {
        let ours = rustix::process::geteuid().as_raw();
        let uid = if ours == 4242 { 4243 } else { 4242 };
        Account {
            user: uid.to_string(),
            uid,
            gid: uid,
            groups: vec![uid],
            login: None,
        }
    }

    #[test]
    fn a_key_others_may_read_is_found_and_an_owner_only_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let key = dir.path().join("server.key");
        std::fs::write(&key, "secret").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(readable_by(&key, &stranger()), Some(0o644));
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(readable_by(&key, &stranger()), None);
        // Readable, but in a directory the user cannot search.
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(readable_by(&key, &stranger()), None);
    }
}
