//! A root's file listing, to compare before an install and after a purge: each path with its kind
//! (`d` folder, `f` file, `l` symbolic link), without contents or times.
//!
//! Left out are the mounts (`/proc`, `/sys`, `/dev`), the temporary folders, and what every package
//! operation changes whatever the package: dpkg's and apt's state (`/var/lib/dpkg`,
//! `/var/lib/apt`; the test asks dpkg itself whether it still knows the package), caches and logs.

use std::{collections::BTreeSet, fs, path::Path};

use anyhow::Context;

/// A root's entries, as `KIND /path`.
pub(super) type Listing = BTreeSet<String>;

/// Folders not listed (nor anything in them).
const SKIPPED: &[&str] = &[
    "/proc",
    "/sys",
    "/dev",
    "/tmp",
    "/var/tmp",
    "/var/cache",
    "/var/log",
    "/var/lib/apt",
    "/var/lib/dpkg",
];

/// Entries a purge may leave that the install made: adduser's backups of the user files it changed
/// (the system user stays, as Debian keeps users), and what the tools the maintainer scripts and
/// the test run leave in `/run` (a tmpfs, emptied at boot): adduser's lock file, and the stamp
/// systemd's manager leaves once it has loaded units (`systemd-analyze verify` runs one).
pub(super) const KEPT: &[&str] = &[
    "f /etc/passwd-",
    "f /etc/group-",
    "f /etc/shadow-",
    "f /etc/gshadow-",
    "f /run/adduser",
    "f /run/systemd/systemd-units-load",
];

/// The listing of the root at `root` (a host path).
pub(super) fn take(root: &Path) -> anyhow::Result<Listing> {
    let mut listing = Listing::new();
    walk(root, root, &mut listing)?;
    Ok(listing)
}

fn walk(root: &Path, dir: &Path, listing: &mut Listing) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let inside = format!(
            "/{}",
            path.strip_prefix(root)?
                .to_str()
                .with_context(|| format!("a path that is not UTF-8: {}", path.display()))?
        );
        if SKIPPED.contains(&inside.as_str()) {
            continue;
        }
        let kind = entry.file_type()?;
        if kind.is_dir() {
            listing.insert(format!("d {inside}"));
            walk(root, &path, listing)?;
        } else if kind.is_symlink() {
            listing.insert(format!("l {inside}"));
        } else {
            listing.insert(format!("f {inside}"));
        }
    }
    Ok(())
}

/// What appeared in `after` and what vanished from `before`.
pub(super) fn compare(before: &Listing, after: &Listing) -> (Vec<String>, Vec<String>) {
    (
        after.difference(before).cloned().collect(),
        before.difference(after).cloned().collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_names_kinds_and_leaves_out_the_volatile_folders() {
        let dir = tempfile::TempDir::new().unwrap();
        let root = dir.path();
        for folder in ["etc/peregrine", "var/lib/dpkg/info", "proc/1", "usr/bin"] {
            fs::create_dir_all(root.join(folder)).unwrap();
        }
        fs::write(root.join("etc/peregrine/peregrine.toml"), "").unwrap();
        fs::write(root.join("var/lib/dpkg/info/peregrine.list"), "").unwrap();
        std::os::unix::fs::symlink("/usr/bin/peregrine", root.join("usr/bin/p")).unwrap();
        let before = take(root).unwrap();
        assert_eq!(
            before.iter().map(String::as_str).collect::<Vec<_>>(),
            [
                "d /etc",
                "d /etc/peregrine",
                "d /usr",
                "d /usr/bin",
                "d /var",
                "d /var/lib",
                "f /etc/peregrine/peregrine.toml",
                "l /usr/bin/p",
            ]
        );
        fs::remove_dir_all(root.join("etc/peregrine")).unwrap();
        fs::write(root.join("etc/passwd-"), "").unwrap();
        let after = take(root).unwrap();
        let (appeared, vanished) = compare(&before, &after);
        assert_eq!(appeared, ["f /etc/passwd-"]);
        assert_eq!(
            vanished,
            ["d /etc/peregrine", "f /etc/peregrine/peregrine.toml"]
        );
        assert!(KEPT.contains(&appeared[0].as_str()));
    }
}
