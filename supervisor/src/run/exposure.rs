//! What the supervisor warns of at start about its workers' privileges: a service whose workers run
//! as root (no `user`, or `user = "root"`), a private key that a service's user may read, a file the
//! supervisor trusts (the config, a certificate, a CA, a key) that a service's user may replace, and
//! workers that would bind a privileged port without the capability to.
//!
//! Each is the operator's to fix, and none stops a start (a demo runs as root, a key's mode is the
//! file's owner's business, the unprivileged port range a sysctl that may change), so they are
//! warnings, once per start and per reload.

use std::{os::unix::fs::MetadataExt, path::Path};

use peregrine_contract::url::BindUrl;

use crate::config::{Account, Config, Program, Warning};

/// A warning for each service whose workers run as root, for each private key in `config` that the
/// workers of a service with a `user` could read, for each file the supervisor trusts (the config at
/// `config_path`, and every TLS file) that they could replace, and for each service whose workers
/// would bind a privileged port themselves.
pub(super) fn warnings(config: &Config, config_path: &Path) -> Vec<Warning> {
    let mut warnings = Vec::new();
    let root = rustix::process::geteuid().is_root();
    let unprivileged_from = unprivileged_port_start();
    for service in config.services.values() {
        let mut warn = |message: String| {
            warnings.push(Warning {
                service: Some(service.name.clone()),
                message,
            })
        };
        if let BindUrl::Tcp { port, .. } = service.url_for(0)
            && !service.pass_socket
            && port != 0
            && port < unprivileged_from
        {
            let instead = if service.command.program == Program::Peregrine {
                // The built-in worker binds its own listener: pass_socket is not for it.
                format!("use a port from {unprivileged_from}, and put Envoy on port {port}")
            } else {
                format!(
                    "set pass_socket = true (the supervisor binds it and passes it), or use a port \
                     from {unprivileged_from}"
                )
            };
            warn(format!(
                "These workers bind a privileged port ({port}) themselves, and hold no capability to: they will fail to start; {instead}"
            ));
        }
        match &service.account {
            None if root => {
                warn(format!(
                    "These workers run as root (without capabilities): they can read and write every file root owns, including this supervisor's keys; set `user` in [service.{}]",
                    service.name
                ));
            }
            None => {}
            Some(account) if account.uid == 0 => {
                warn(format!(
                    "These workers run as root ({}, without capabilities): they can read and write every file root owns, including this supervisor's keys and config; set `user` in [service.{}] to an unprivileged user",
                    account.user, service.name
                ));
            }
            Some(account) => {
                for (what, key) in private_keys(config) {
                    if let Some(mode) = readable_by(key, account) {
                        warn(format!(
                            "The workers of this service (user {}) can read the {what}, {} (mode {mode:04o}): make it owner-only (chmod 600), owned by the supervisor's user",
                            account.user,
                            key.display()
                        ));
                    }
                }
                for (what, file) in trusted_files(config, config_path) {
                    if let Some(through) = replaceable_by(file, account) {
                        warn(format!(
                            "The workers of this service (user {}) can replace the {what}, {} (through {}, which they may write): make it, and every folder on its way, writable by the supervisor's user alone",
                            account.user,
                            file.display(),
                            through.display()
                        ));
                    }
                }
            }
        }
    }
    warnings
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

/// The files the supervisor trusts, each with what it is: the config, and every certificate, CA and
/// key it names. A worker that could replace one could make the supervisor trust its own CA, or lock
/// Envoy out.
fn trusted_files<'a>(config: &'a Config, config_path: &'a Path) -> Vec<(&'static str, &'a Path)> {
    let mut files = vec![("config", config_path)];
    if let Some(tls) = &config.supervisor.tls {
        files.push(("gRPC port's TLS certificate", tls.identity.cert.as_path()));
        if let Some(ca) = &tls.client_ca {
            files.push(("gRPC port's client CA", ca.as_path()));
        }
    }
    if let Some(tls) = &config.envoy.tls {
        files.push(("CA Envoy checks the supervisor with", tls.ca.as_path()));
        if let Some(identity) = &tls.identity {
            files.push(("Envoy's client certificate", identity.cert.as_path()));
        }
    }
    if let Some(tls) = config.cluster.as_ref().and_then(|c| c.tls.as_ref()) {
        files.push(("etcd CA", tls.ca.as_path()));
        if let Some(identity) = &tls.identity {
            files.push(("etcd client certificate", identity.cert.as_path()));
        }
    }
    files.extend(private_keys(config));
    files
}

/// What lets `account` replace `file`, if anything does: the file itself if it may write it, else a
/// folder on the way that it may write and search (it could rename what is in it and put its own
/// there), unless that folder is sticky and neither it nor what is in it is the account's.
fn replaceable_by(file: &Path, account: &Account) -> Option<std::path::PathBuf> {
    let ids = |meta: &std::fs::Metadata| (meta.uid(), meta.gid(), meta.mode());
    let file = std::path::absolute(file).ok()?;
    let meta = std::fs::metadata(&file).ok()?;
    if account.may(0o2, ids(&meta)) {
        return Some(file);
    }
    let mut entry = file.as_path();
    for dir in file.ancestors().skip(1) {
        let dir_meta = std::fs::metadata(dir).ok()?;
        let entry_owner = std::fs::symlink_metadata(entry).ok()?.uid();
        let sticky = dir_meta.mode() & 0o1000 != 0;
        if account.may(0o3, ids(&dir_meta))
            && (!sticky || dir_meta.uid() == account.uid || entry_owner == account.uid)
        {
            return Some(dir.to_path_buf());
        }
        entry = dir;
    }
    None
}

/// The mode of `file` if `account` may read it (and search every directory on the way to it).
fn readable_by(file: &Path, account: &Account) -> Option<u32> {
    let ids = |meta: &std::fs::Metadata| (meta.uid(), meta.gid(), meta.mode());
    if account.unsearchable_folder(file).is_some() {
        return None;
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
    fn a_file_or_folder_others_may_write_is_found_and_a_sticky_folder_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let mode = |path: &Path, mode| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        mode(dir.path(), 0o755);
        let tls = dir.path().join("tls");
        std::fs::create_dir(&tls).unwrap();
        mode(&tls, 0o755);
        let ca = tls.join("client-ca.pem");
        std::fs::write(&ca, "ca").unwrap();
        mode(&ca, 0o644);
        // The temporary folder's parents are root's and not writable by others (/tmp is sticky).
        assert_eq!(replaceable_by(&ca, &stranger()), None);
        mode(&ca, 0o666);
        assert_eq!(replaceable_by(&ca, &stranger()), Some(ca.clone()));
        mode(&ca, 0o644);
        mode(&tls, 0o777);
        assert_eq!(replaceable_by(&ca, &stranger()), Some(tls.clone()));
        // Sticky, and neither the folder nor the file is the stranger's.
        mode(&tls, 0o1777);
        assert_eq!(replaceable_by(&ca, &stranger()), None);
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
