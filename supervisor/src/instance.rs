//! One supervisor per control socket, and the lineage that tells its workers from everyone else's.
//!
//! Beside the control socket lives its lock file, `<control>.lock` (owner-only). A running supervisor
//! holds an exclusive `flock(2)` on it for its whole life; the kernel drops the lock when the process
//! dies, however it dies, so a supervisor started right after a SIGKILL gets it at once, and two
//! supervisors can never serve one socket. (Probing the socket by connecting to it could not tell a
//! dying supervisor from a live one.)
//!
//! The file also holds the socket's *lineage*: 128 random bits, made when the file is first created and
//! kept by every supervisor that takes the lock after it. Each worker is started with the lineage in
//! its environment ([`ENV_LINEAGE`](peregrine_contract::settings::ENV_LINEAGE)); a later supervisor adopts,
//! or stops, only processes that carry the lineage read from the lock file. A process of another
//! supervisor (another socket, or the same socket name in another directory) carries another lineage,
//! and a process that merely names this socket in its environment does not know the lineage: the file
//! is readable by its owner only.
//!
//! Invariant: the lock is taken before the socket is touched, and held until the supervisor exits; the
//! lineage never changes while the lock file exists.

use std::{
    fmt,
    fs::File,
    io::{self, Read, Seek, Write},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use rustix::fs::FlockOperation;

/// The random identity of a control socket's supervisors and their workers: 32 lowercase hex digits.
#[derive(Clone, PartialEq, Eq)]
pub struct Lineage(String);

/// The lock a running supervisor holds on its control socket; released when dropped (or when the
/// process dies).
#[derive(Debug)]
pub struct InstanceLock {
    /// Holds the `flock`.
    _file: File,
    path: PathBuf,
    lineage: Lineage,
}

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another supervisor holds it.
    #[error(
        "{socket} is in use by another running supervisor{}: it holds the lock {lock}",
        .pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    InUse {
        /// The control socket.
        socket: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The holder's pid, as it wrote it into the file.
        pid: Option<u32>,
    },
    /// The lock file belongs to someone else or others may read it: its lineage cannot be trusted.
    #[error(
        "{path} must be a regular file owned by this user (uid {uid}) with mode 0600; it is not, so \
         its lineage cannot be trusted: remove it if no supervisor of yours runs on this socket"
    )]
    Untrusted {
        /// The lock file.
        path: PathBuf,
        /// This process's effective user id.
        uid: u32,
    },
    /// Any other failure.
    #[error("cannot lock {path}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// The lock file of the control socket `control`.
pub fn lock_path(control: &Path) -> PathBuf {
    let mut name = control.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

impl InstanceLock {
    /// Takes the lock of control socket `control` (creating its directory and lock file as needed),
    /// without waiting: another running supervisor is an error.
    pub fn acquire(control: &Path) -> Result<InstanceLock, LockError> {
        let path = lock_path(control);
        let io_err = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_err)?;
        }
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // A symlink planted in the lock's place is refused rather than followed.
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&path)
            .map_err(io_err)?;
        let meta = file.metadata().map_err(io_err)?;
        let uid = rustix::process::geteuid().as_raw();
        if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
            return Err(LockError::Untrusted { path, uid });
        }
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(LockError::InUse {
                    socket: control.to_owned(),
                    lock: path,
                    pid: parse(&text).1,
                });
            }
            Err(error) => return Err(io_err(error.into())),
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(io_err)?;
        let lineage = match parse(&text).0 {
            Some(lineage) => lineage,
            None => Lineage::random().map_err(io_err)?,
        };
        // The lineage stays; the pid line says who holds the lock now.
        file.set_len(0).map_err(io_err)?;
        file.rewind().map_err(io_err)?;
        write!(file, "{}\n{}\n", lineage.0, std::process::id()).map_err(io_err)?;
        Ok(InstanceLock {
            _file: file,
            path,
            lineage,
        })
    }

    /// [`InstanceLock::acquire`], but when the holder the lock file names is this very process (an
    /// earlier image of it, before an upgrade's exec), tries again for up to `grace`: a child forked
    /// just before the exec holds the lock's descriptor until its own exec closes it.
    pub fn acquire_after_exec(control: &Path, grace: Duration) -> Result<InstanceLock, LockError> {
        let deadline = Instant::now() + grace;
        loop {
            match InstanceLock::acquire(control) {
                Err(LockError::InUse { pid: Some(pid), .. })
                    if pid == std::process::id() && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    /// The socket's lineage.
    pub fn lineage(&self) -> &Lineage {
        &self.lineage
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The lineage of control socket `control`, read without taking its lock, when its lock file is
/// there, this user's, owner-only and readable: what `check` and `peregrine upgrade` look for
/// workers by. `None` otherwise (the same trust rule as [`InstanceLock::acquire`]'s).
pub fn peek_lineage(control: &Path) -> Option<Lineage> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(lock_path(control))
        .ok()?;
    let meta = file.metadata().ok()?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return None;
    }
    let mut text = String::new();
    (&file).read_to_string(&mut text).ok()?;
    parse(&text).0
}

/// The pid of the process that holds the lock of control socket `control` (a running supervisor),
/// found in `/proc/locks` without touching the lock: `None` when nobody holds it, or the file is
/// not there.
pub fn holder(control: &Path) -> Option<u32> {
    let meta = std::fs::symlink_metadata(lock_path(control)).ok()?;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    holder_in(&locks, meta.dev(), meta.ino())
}

/// The pid of the `flock` holder of the file `dev`:`ino` in `/proc/locks`' text `locks`.
fn holder_in(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    // `1: FLOCK  ADVISORY  WRITE 8278 fe:00:10141778 0 EOF`: major and minor in hex, the inode in
    // decimal. A waiter's line begins `1: -> FLOCK`, and is not the holder.
    let file = format!(
        "{:02x}:{:02x}:{ino}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    );
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, "FLOCK", _, _, pid, at, ..] if *at == file => pid.parse().ok(),
            _ => None,
        }
    })
}

/// The lineage and the holder's pid in a lock file's text (either may be missing or invalid).
fn parse(text: &str) -> (Option<Lineage>, Option<u32>) {
    let mut lines = text.lines();
    let lineage = lines.next().and_then(|line| Lineage::parse(line.trim()));
    let pid = lines.next().and_then(|line| line.trim().parse().ok());
    (lineage, pid)
}

// === impl Lineage ===

impl Lineage {
    /// A new lineage from the kernel's random source.
    pub fn random() -> io::Result<Lineage> {
        let mut bytes = [0u8; 16];
        let filled = rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())?;
        if filled != bytes.len() {
            return Err(io::Error::other("short read from getrandom"));
        }
        Ok(Lineage(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// A lineage as written (32 lowercase hex digits), else `None`.
    pub fn parse(text: &str) -> Option<Lineage> {
        (text.len() == 32 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| Lineage(text.to_owned()))
    }

    /// The text form, as workers carry it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `other` is this lineage, compared in constant time (it is a secret of sorts).
    pub fn matches(&self, other: &[u8]) -> bool {
        let mine = self.0.as_bytes();
        mine.len() == other.len()
            && mine
                .iter()
                .zip(other)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl fmt::Debug for Lineage {
    /// Only a prefix: logs need not carry the whole value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lineage({}…)", &self.0[..8.min(self.0.len())])
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_second_lock_is_refused_and_the_lineage_survives_its_holder() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("sub/p.sock");
        let first = InstanceLock::acquire(&socket).unwrap();
        assert_eq!(first.path(), dir.path().join("sub/p.sock.lock"));
        let mode = std::fs::metadata(first.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        match InstanceLock::acquire(&socket) {
            Err(LockError::InUse { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("expected InUse, got {other:?}"),
        }
        let lineage = first.lineage().clone();
        assert_eq!(
            peek_lineage(&socket).as_ref(),
            Some(&lineage),
            "read while held"
        );
        assert_eq!(holder(&socket), Some(std::process::id()));
        drop(first);
        assert_eq!(holder(&socket), None, "released");
        let second = InstanceLock::acquire(&socket).unwrap();
        assert_eq!(
            second.lineage(),
            &lineage,
            "the lineage is kept across holders"
        );
        // Another socket in another directory has another lineage.
        let other = InstanceLock::acquire(&dir.path().join("p.sock")).unwrap();
        assert_ne!(other.lineage(), &lineage);
        // A lock file others may read is not trusted for its lineage.
        std::fs::set_permissions(other.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(peek_lineage(&dir.path().join("p.sock")), None);
        assert_eq!(peek_lineage(&dir.path().join("none.sock")), None);
    }

    #[test]
    fn a_lock_held_by_this_very_process_is_waited_for_after_an_exec() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        let first = InstanceLock::acquire(&socket).unwrap();
        // What a child forked just before an exec does: holds the lock a moment longer.
        let released = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(first);
        });
        let second = InstanceLock::acquire_after_exec(&socket, Duration::from_secs(5)).unwrap();
        released.join().unwrap();
        // Another holder is not waited for.
        let begun = Instant::now();
        std::fs::write(
            lock_path(&socket),
            format!("{}\n1\n", second.lineage().as_str()),
        )
        .unwrap();
        assert!(matches!(
            InstanceLock::acquire_after_exec(&socket, Duration::from_secs(5)),
            Err(LockError::InUse { pid: Some(1), .. })
        ));
        assert!(begun.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_lock_file_others_can_read_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        std::fs::write(lock_path(&socket), "00112233445566778899aabbccddeeff\n").unwrap();
        std::fs::set_permissions(lock_path(&socket), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        assert!(matches!(
            InstanceLock::acquire(&socket),
            Err(LockError::Untrusted { .. })
        ));
    }

    #[test]
    fn a_symlink_in_the_locks_place_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("p.sock");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), lock_path(&socket)).unwrap();
        assert!(InstanceLock::acquire(&socket).is_err());
        assert!(!dir.path().join("elsewhere").exists());
    }

    #[test]
    fn the_holder_is_the_flock_on_that_very_file() {
        let locks = "1: FLOCK  ADVISORY  WRITE 8278 fe:00:10141778 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 9000 fe:00:10141778 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 77 08:01:42 0 EOF\n";
        let dev = rustix::fs::makedev(0xfe, 0);
        assert_eq!(holder_in(locks, dev, 10141778), Some(8278));
        assert_eq!(holder_in(locks, dev, 1014177), None, "another inode");
        assert_eq!(
            holder_in(locks, rustix::fs::makedev(8, 1), 42),
            None,
            "a POSIX lock is not a supervisor's"
        );
    }

    #[test]
    fn lineages_parse_and_match_exactly() {
        let lineage = Lineage::random().unwrap();
        assert_eq!(Lineage::parse(lineage.as_str()), Some(lineage.clone()));
        assert!(lineage.matches(lineage.as_str().as_bytes()));
        assert!(!lineage.matches(&lineage.as_str().as_bytes()[1..]));
        assert!(!lineage.matches(b"00000000000000000000000000000000"));
        assert_eq!(Lineage::parse("xyz"), None);
        assert_eq!(Lineage::parse("00112233445566778899AABBCCDDEEFF"), None);
        assert_eq!(
            parse("00112233445566778899aabbccddeeff\n42\n"),
            (Lineage::parse("00112233445566778899aabbccddeeff"), Some(42))
        );
    }
}
