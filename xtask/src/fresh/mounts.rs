//! The mounts a fresh root holds, and the one way to delete a root: every process inside it killed,
//! every mount under it unmounted (and seen gone in `/proc/self/mountinfo`) first.
//!
//! A root has the host's `/dev`, `/sys` and Rust toolchain bound into it. Deleting it while one of
//! them is still mounted would delete the host's own files through the mount, so [`remove`] refuses
//! to delete anything while `/proc/self/mountinfo` lists a mount point under it. Before unmounting,
//! each mount under the root is made a slave (`MS_SLAVE`): an unmount then never propagates back to
//! the host's `/dev/pts` or `/dev/shm`, even when the host's mounts are shared (systemd's default).

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use rustix::{
    io::Errno,
    mount::{
        MountFlags, MountPropagationFlags, UnmountFlags, mount, mount_bind, mount_bind_recursive,
        mount_change, mount_remount, unmount,
    },
    process::{Pid, Signal, kill_process},
};

/// How many passes [`unmount_all`] makes over what is left before it detaches lazily.
const PASSES: u32 = 20;
/// The pause between passes: a process that just died may hold a mount for a moment.
const PAUSE: Duration = Duration::from_millis(100);
/// How long the processes left in a root may take to die once killed.
const KILL_DEADLINE: Duration = Duration::from_secs(10);

/// Mounts a new `proc` at `target`.
pub(super) fn mount_proc(target: &Path) -> anyhow::Result<()> {
    mount(
        "proc",
        target,
        "proc",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        None,
    )
    .with_context(|| format!("mounting proc at {}", target.display()))
}

/// Binds `source` and every mount under it at `target`, as a slave: mounts and unmounts under
/// `target` never propagate back to `source`.
pub(super) fn bind_tree(source: &Path, target: &Path) -> anyhow::Result<()> {
    mount_bind_recursive(source, target)
        .with_context(|| format!("binding {} at {}", source.display(), target.display()))?;
    mount_change(
        target,
        MountPropagationFlags::DOWNSTREAM | MountPropagationFlags::REC,
    )
    .with_context(|| format!("making {} a slave mount", target.display()))
}

/// Binds `source` at `target` read-only (a bind, then a read-only remount of the bind alone).
pub(super) fn bind_read_only(source: &Path, target: &Path) -> anyhow::Result<()> {
    mount_bind(source, target)
        .with_context(|| format!("binding {} at {}", source.display(), target.display()))?;
    mount_change(target, MountPropagationFlags::DOWNSTREAM)
        .with_context(|| format!("making {} a slave mount", target.display()))?;
    mount_remount(target, MountFlags::BIND | MountFlags::RDONLY, "")
        .with_context(|| format!("making {} read-only", target.display()))
}

/// Binds `source` at `target` read-write.
pub(super) fn bind(source: &Path, target: &Path) -> anyhow::Result<()> {
    mount_bind(source, target)
        .with_context(|| format!("binding {} at {}", source.display(), target.display()))?;
    mount_change(target, MountPropagationFlags::DOWNSTREAM)
        .with_context(|| format!("making {} a slave mount", target.display()))
}

/// Deletes `dir` (a root, or a folder holding one) after killing every process whose root is in
/// it and unmounting everything under it; refuses while anything is still mounted there.
pub(crate) fn remove(dir: &Path) -> anyhow::Result<()> {
    if fs::symlink_metadata(dir).is_err() {
        return Ok(());
    }
    let dir = dir
        .canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))?;
    ensure!(
        dir.components().count() >= 4,
        "refusing to delete {}: too close to /",
        dir.display()
    );
    kill_processes_in(&dir)?;
    unmount_all(&dir)?;
    let left = mounts_under(&dir)?;
    ensure!(
        left.is_empty(),
        "refusing to delete {}: still mounted under it: {}",
        dir.display(),
        display_paths(&left)
    );
    fs::remove_dir_all(&dir).with_context(|| format!("deleting {}", dir.display()))
}

/// Unmounts every mount at or under `dir`, last mounted first; detaches lazily what stays busy.
pub(super) fn unmount_all(dir: &Path) -> anyhow::Result<()> {
    for mount_point in mounts_under(dir)? {
        // Not for the host's sake alone: a slave's unmount stays in the root.
        let _ = mount_change(&mount_point, MountPropagationFlags::DOWNSTREAM);
    }
    for pass in 0..=PASSES {
        let mounts = mounts_under(dir)?;
        if mounts.is_empty() {
            return Ok(());
        }
        let lazily = pass == PASSES;
        for mount_point in mounts.iter().rev() {
            let flags = if lazily {
                UnmountFlags::NOFOLLOW | UnmountFlags::DETACH
            } else {
                UnmountFlags::NOFOLLOW
            };
            match unmount(mount_point, flags) {
                // Unmounted, busy (the next pass tries again) or already gone with its parent.
                Ok(()) | Err(Errno::BUSY | Errno::INVAL | Errno::NOENT) => {}
                Err(error) => {
                    return Err(error)
                        .with_context(|| format!("unmounting {}", mount_point.display()));
                }
            }
        }
        if !lazily {
            std::thread::sleep(PAUSE);
        }
    }
    let left = mounts_under(dir)?;
    if !left.is_empty() {
        bail!(
            "still mounted under {} after unmounting: {}",
            dir.display(),
            display_paths(&left)
        );
    }
    Ok(())
}

/// The mount points at or under `dir`, in the order `/proc/self/mountinfo` lists them (the order
/// they were mounted in).
pub(super) fn mounts_under(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mountinfo =
        fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    Ok(parse_mounts_under(&mountinfo, dir))
}

/// Kills (SIGKILL) every process whose root directory is `root` or under it, and waits until they
/// are gone.
pub(super) fn kill_processes_in(root: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + KILL_DEADLINE;
    loop {
        let inside = processes_in(root)?;
        if inside.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "processes {inside:?} still run in {} after SIGKILL",
                root.display()
            );
        }
        for pid in &inside {
            if let Some(pid) = Pid::from_raw(*pid) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
        std::thread::sleep(PAUSE);
    }
}

/// The processes whose root directory (`/proc/PID/root`) is `root` or under it.
fn processes_in(root: &Path) -> anyhow::Result<Vec<i32>> {
    let own = std::process::id() as i32;
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").context("listing /proc")? {
        let Some(pid) = entry?
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<i32>().ok())
        else {
            continue;
        };
        // A process that exits meanwhile, or a kernel thread, has no readable root.
        if let Ok(its_root) = fs::read_link(format!("/proc/{pid}/root"))
            && its_root.starts_with(root)
            && pid != own
        {
            found.push(pid);
        }
    }
    Ok(found)
}

/// The mount points of `mountinfo` (the text of `/proc/self/mountinfo`) at or under `dir`,
/// compared by whole path components.
fn parse_mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape(field)))
        .filter(|mount_point| mount_point.starts_with(dir))
        .collect()
}

/// A mountinfo path with its octal escapes (`\040` for a space, `\011`, `\012`, `\134`) decoded.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && let Some(code) = bytes
                .get(i + 1..i + 4)
                .and_then(|digits| std::str::from_utf8(digits).ok())
                .and_then(|digits| u8::from_str_radix(digits, 8).ok())
        {
            out.push(code);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn display_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|path| path.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,mode=755
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
50 27 0:6 / /work/target/fresh/demo/root/dev rw,relatime master:3 - devtmpfs devtmpfs rw
51 50 0:24 / /work/target/fresh/demo/root/dev/pts rw,relatime - devpts devpts rw
52 27 0:21 / /work/target/fresh/demo/root/proc rw - proc proc rw
53 27 254:0 /opt/my\\040rust /work/target/fresh/demo/root/opt/my\\040rust ro - ext4 /dev/vda rw
54 27 0:21 / /work/target/fresh/demo/rootless rw - proc proc rw
";

    #[test]
    fn finds_the_mounts_under_a_root_in_mount_order() {
        let root = Path::new("/work/target/fresh/demo/root");
        assert_eq!(
            parse_mounts_under(MOUNTINFO, root),
            [
                "/work/target/fresh/demo/root/dev",
                "/work/target/fresh/demo/root/dev/pts",
                "/work/target/fresh/demo/root/proc",
                "/work/target/fresh/demo/root/opt/my rust",
            ]
            .map(PathBuf::from)
        );
        // A sibling whose name merely starts the same is not under the root.
        assert!(parse_mounts_under(MOUNTINFO, Path::new("/work/target/fresh/demo/roo")).is_empty());
        assert_eq!(
            parse_mounts_under(MOUNTINFO, Path::new("/dev")),
            [PathBuf::from("/dev")]
        );
    }

    #[test]
    fn decodes_octal_escapes() {
        assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
        assert_eq!(unescape(r"/plain"), "/plain");
        // A backslash without three octal digits stays as it is.
        assert_eq!(unescape(r"/x\09"), r"/x\09");
    }

    #[test]
    fn removes_a_folder_without_mounts_and_refuses_near_the_root() {
        let dir =
            peregrine_testenv::target_dir().join(format!("fresh-test-{}", std::process::id()));
        fs::create_dir_all(dir.join("root/etc")).unwrap();
        fs::write(dir.join("root/etc/hostname"), "fresh\n").unwrap();
        remove(&dir).unwrap();
        assert!(!dir.exists());
        // Nothing there is nothing to do.
        remove(&dir).unwrap();
        let error = remove(Path::new("/usr")).unwrap_err();
        assert!(error.to_string().contains("too close to /"), "{error}");
    }

    #[test]
    fn removing_a_root_leaves_what_was_bound_into_it() {
        if !rustix::process::geteuid().is_root() {
            peregrine_testenv::skip(&peregrine_testenv::current_test(), "mounting needs root");
            return;
        }
        let dir =
            peregrine_testenv::target_dir().join(format!("fresh-bind-test-{}", std::process::id()));
        let (precious, root) = (dir.join("precious"), dir.join("box/root"));
        fs::create_dir_all(precious.join("sub")).unwrap();
        fs::write(precious.join("sub/file"), "keep me\n").unwrap();
        for target in ["ro", "rw", "tree"] {
            fs::create_dir_all(root.join(target)).unwrap();
        }
        bind_read_only(&precious, &root.join("ro")).unwrap();
        bind(&precious, &root.join("rw")).unwrap();
        bind_tree(&precious, &root.join("tree")).unwrap();
        // A mount on top of a mount inside the bound tree.
        mount_proc(&root.join("tree/sub")).unwrap();
        assert!(
            fs::write(root.join("ro/sub/file"), "changed").is_err(),
            "read-only"
        );
        assert_eq!(mounts_under(&root).unwrap().len(), 4);

        remove(&dir.join("box")).unwrap();
        assert!(!dir.join("box").exists());
        assert!(mounts_under(&dir).unwrap().is_empty());
        assert_eq!(
            fs::read_to_string(precious.join("sub/file")).unwrap(),
            "keep me\n"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
