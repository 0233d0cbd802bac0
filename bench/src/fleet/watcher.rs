//! etcd's side of a change, seen from outside the supervisors: `etcdctl watch --prefix` on the fleet's
//! worker keys, each line it prints timestamped as it arrives (its log file is read every
//! [`EVERY`]), so that a change's time splits into the write reaching etcd's watchers and the rest.
//!
//! etcdctl prints every event as lines of its type, key and value; a key's first line after a
//! moment is its event (a worker key is put once and deleted once: it holds the pid).

use std::{
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, SystemTime},
};

use anyhow::Context;
use peregrine_e2e::{ChildGuard, TempDir, etcd_path};
use xtask::logs::Tail;

/// How often the watcher's output is read: the resolution of its times.
pub(super) const EVERY: Duration = Duration::from_millis(1);

/// A running `etcdctl watch`; stopped and killed when dropped.
#[derive(Debug)]
pub(super) struct KeyWatch {
    lines: Arc<Mutex<Vec<(SystemTime, String)>>>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
    // Dropped after the reader stops: the process, then its directory.
    _process: ChildGuard,
    _dir: TempDir,
}

/// `etcdctl` beside `etcd`, else in `PATH`.
fn etcdctl() -> Option<PathBuf> {
    let beside = etcd_path()?.with_file_name("etcdctl");
    if beside.is_file() {
        return Some(beside);
    }
    xtask::packages::program_path("etcdctl").ok()
}

impl KeyWatch {
    /// Watches every key under `prefix` on `endpoint`; `None` (and a warning) without `etcdctl`.
    pub(super) fn start(endpoint: &str, prefix: &str) -> anyhow::Result<Option<KeyWatch>> {
        let Some(etcdctl) = etcdctl() else {
            eprintln!(
                "warning: no etcdctl (apt install etcd-client): changes are not timed at etcd's watch"
            );
            return Ok(None);
        };
        let dir =
            TempDir::with_prefix("peregrine-fleet-watch-").context("a temporary directory")?;
        let process = ChildGuard::spawn(
            "etcdctl",
            Command::new(etcdctl)
                .args(["--endpoints", endpoint, "watch", "--prefix", prefix])
                .env("ETCDCTL_API", "3"),
            dir.path(),
        )?;
        let mut tail = Tail::new(process.log_paths().0.to_path_buf());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (lines, stop) = (Arc::clone(&lines), Arc::clone(&stop));
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(text) = tail.read()
                        && !text.is_empty()
                    {
                        let at = SystemTime::now();
                        let mut lines = lines.lock().unwrap_or_else(|e| e.into_inner());
                        lines.extend(text.lines().map(|l| (at, l.to_owned())));
                    }
                    thread::sleep(EVERY);
                }
            })
        };
        // etcdctl says nothing once it watches: give it the time to connect and start.
        xtask::interrupt::sleep(Duration::from_millis(300))?;
        Ok(Some(KeyWatch {
            lines,
            stop,
            reader: Some(reader),
            _process: process,
            _dir: dir,
        }))
    }

    /// When a line that is `key` first arrived at or after `after`.
    pub(super) fn first_after(&self, after: SystemTime, key: &str) -> Option<SystemTime> {
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(at, line)| *at >= after && line == key)
            .map(|(at, _)| *at)
    }
}

impl Drop for KeyWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}
