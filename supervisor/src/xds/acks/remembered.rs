//! The proven Envoys, remembered across supervisors in `<control>.envoys` beside the control socket,
//! so that a supervisor that starts again waits for them (see the parent module).
//!
//! One line per Envoy: the kind of its last endpoint stream (`eds`, `ads`, `delta-eds`, ...), a
//! space, its node id. Node ids are untrusted client input: only [`MAX_NODES`] are kept, the oldest
//! first, and an id longer than [`MAX_NODE_ID`] bytes, empty, or holding a control character is
//! neither written nor read. The file is owner-only (0600), written whole (a temporary file, then a
//! rename) and only when the set changes; one that is not a regular file of this user with mode 0600
//! is not trusted, as the lock file beside it (`instance`).
//!
//! Invariant: a file that cannot be read or trusted means no Envoy is remembered, never an error
//! that stops the supervisor; at worst the first drains after a start count only the Envoys that
//! are connected, as they did before this file existed.

use std::{
    collections::BTreeMap,
    fs::File,
    io::{self, Read, Write},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use tokio::time::Instant;

use super::Acks;
use crate::xds::stream_kind::StreamKind;

/// The most Envoys remembered: a host's Envoys are a handful; anyone who reaches the gRPC port may
/// open streams under any node id.
pub const MAX_NODES: usize = 64;

/// The longest node id remembered, in bytes.
pub const MAX_NODE_ID: usize = 256;

/// The longest file read: every line at its longest.
const MAX_BYTES: u64 = (MAX_NODES * (MAX_NODE_ID + 16)) as u64;

/// The remembered Envoys: node id -> the kind of its last endpoint stream.
pub type Nodes = BTreeMap<String, StreamKind>;

/// The file of the control socket `control`.
pub fn path(control: &Path) -> PathBuf {
    let mut name = control.as_os_str().to_owned();
    name.push(".envoys");
    PathBuf::from(name)
}

/// Whether `node` may be remembered.
fn rememberable(node: &str) -> bool {
    !node.is_empty() && node.len() <= MAX_NODE_ID && !node.chars().any(char::is_control)
}

/// Reads the remembered Envoys from `path`: none if it does not exist; an error if it cannot be read
/// or trusted. Lines that do not parse are skipped.
pub fn load(path: &Path) -> io::Result<Nodes> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        // A symlink planted in the file's place is refused rather than followed.
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
    {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Nodes::new()),
        Err(error) => return Err(error),
    };
    let meta = file.metadata()?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(io::Error::other(format!(
            "not a regular file owned by uid {uid} with mode 0600"
        )));
    }
    let mut text = String::new();
    file.take(MAX_BYTES).read_to_string(&mut text)?;
    Ok(parse(&text))
}

/// The Envoys in a file's text.
fn parse(text: &str) -> Nodes {
    text.lines()
        .filter_map(|line| {
            let (kind, node) = line.split_once(' ')?;
            let kind = StreamKind::ALL
                .into_iter()
                .find(|k| k.to_string() == kind)?;
            rememberable(node).then(|| (node.to_owned(), kind))
        })
        .take(MAX_NODES)
        .collect()
}

/// Writes `nodes` to `path` whole: a temporary file beside it (owner-only), then a rename.
pub fn store(path: &Path, nodes: &Nodes) -> io::Result<()> {
    let mut text = String::new();
    for (node, kind) in nodes.iter().filter(|(n, _)| rememberable(n)) {
        text.push_str(&format!("{kind} {node}\n"));
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
        _ => {}
    }
    let mut file: File = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Keeps `path` holding the proven Envoys of `acks` (starting from `last`, what it holds now):
/// looks whenever a stream changes or a grace ends, and writes only when the set changed. Runs until
/// aborted; stop it before the xDS streams end, so that a supervisor that stops leaves the set its
/// successor must wait for.
pub async fn keep(acks: Arc<Acks>, path: PathBuf, mut last: Nodes) {
    loop {
        // Registered before looking, so a change between the look and the wait is not missed.
        let changed = acks.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let (proven, next) = acks.proven(MAX_NODES);
        let now: Nodes = proven
            .into_iter()
            .filter(|(node, _)| rememberable(node))
            .collect();
        if now != last {
            match store(&path, &now) {
                Ok(()) => {
                    tracing::debug!(envoys = ?now.keys().collect::<Vec<_>>(), path = %path.display(), "Remembered the proven Envoys")
                }
                Err(error) => {
                    tracing::warn!(%error, path = %path.display(), "Cannot remember the proven Envoys: a supervisor started after this one will not wait for them")
                }
            }
            // Tried again at the next change, not in a loop.
            last = now;
        }
        match next {
            Some(at) => {
                let _ = tokio::time::timeout_at(at.max(Instant::now()), changed).await;
            }
            None => changed.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn the_file_is_owner_only_and_keeps_only_what_may_be_remembered() {
        let dir = tempfile::tempdir().unwrap();
        let path = path(&dir.path().join("p.sock"));
        assert_eq!(path, dir.path().join("p.sock.envoys"));
        assert!(load(&path).unwrap().is_empty(), "no file, no Envoy");
        let long = "x".repeat(MAX_NODE_ID + 1);
        let nodes: Nodes = [
            ("envoy-a".to_owned(), StreamKind::Eds),
            ("envoy b".to_owned(), StreamKind::DeltaAds),
            ("bad\nid".to_owned(), StreamKind::Eds),
            (long, StreamKind::Eds),
        ]
        .into();
        store(&path, &nodes).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let loaded = load(&path).unwrap();
        assert_eq!(
            loaded,
            [
                ("envoy b".to_owned(), StreamKind::DeltaAds),
                ("envoy-a".to_owned(), StreamKind::Eds),
            ]
            .into()
        );
        // A file others may read is not trusted.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load(&path).is_err());
    }

    #[test]
    fn a_file_of_many_nodes_is_read_up_to_the_cap() {
        let text: String = (0..MAX_NODES * 2)
            .map(|i| format!("eds envoy-{i:04}\n"))
            .chain(["bogus line\n".into(), "cds\n".into()])
            .collect();
        assert_eq!(parse(&text).len(), MAX_NODES);
    }

    #[tokio::test]
    async fn proven_envoys_are_written_when_the_set_changes_and_kept_while_they_reconnect() {
        let dir = tempfile::tempdir().unwrap();
        let path = path(&dir.path().join("p.sock"));
        let acks = Arc::new(Acks::default());
        let keeper = tokio::spawn(keep(acks.clone(), path.clone(), Nodes::new()));
        let written = |want: &[(&str, StreamKind)]| {
            let want: Nodes = want.iter().map(|(n, k)| (n.to_string(), *k)).collect();
            let path = path.clone();
            async move {
                tokio::time::timeout(std::time::Duration::from_secs(5), async {
                    while load(&path).unwrap_or_default() != want {
                        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    }
                })
                .await
                .unwrap_or_else(|_| panic!("{path:?} never held {want:?}"));
            }
        };
        // A stream that never ACKed is not proven; once it ACKs, it is.
        let envoy = acks.register(1, "envoy".into(), StreamKind::Eds);
        envoy.publish(true, None, None);
        let script = acks.register(2, "script".into(), StreamKind::Eds);
        script.publish(true, None, Some(Instant::now()));
        envoy.publish(true, Some(1), None);
        written(&[("envoy", StreamKind::Eds)]).await;
        // Its stream replaced by another: still remembered, never written without it.
        drop(envoy);
        let again = acks.register(3, "envoy".into(), StreamKind::Eds);
        again.publish(true, Some(2), None);
        assert_eq!(load(&path).unwrap().len(), 1);
        keeper.abort();
    }
}
