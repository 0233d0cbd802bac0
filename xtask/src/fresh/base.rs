//! The base of every fresh root: `debootstrap --variant=minbase bookworm` from the host's mirror,
//! kept as a tarball outside the checkout so that only the first run pays for debootstrap.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context;
use xtask::run_checked;

use super::{mirror::SUITE, mounts};

/// The variable naming the tarball, instead of [`DEFAULT_TARBALL`].
pub(crate) const CACHE_VAR: &str = "PEREGRINE_FRESH_CACHE";
/// Where the tarball is kept by default.
const DEFAULT_TARBALL: &str = "/var/cache/peregrine/fresh/bookworm-minbase.tar";

/// The tarball's path: `PEREGRINE_FRESH_CACHE`, else [`DEFAULT_TARBALL`].
pub(super) fn tarball() -> PathBuf {
    env::var_os(CACHE_VAR)
        .filter(|path| !path.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_TARBALL), PathBuf::from)
}

/// The folder beside the tarball for apt's downloaded packages, one per root name, so a second run
/// installs the same packages without downloading them again.
pub(super) fn apt_archives(name: &str) -> PathBuf {
    let tarball = tarball();
    tarball
        .parent()
        .unwrap_or(Path::new("/"))
        .join("apt-archives")
        .join(name)
}

/// Makes the tarball with debootstrap from `mirror` unless it is there; true when it was made now.
pub(super) fn ensure(mirror: &str) -> anyhow::Result<bool> {
    let tarball = tarball();
    if tarball.is_file() {
        return Ok(false);
    }
    let folder = tarball
        .parent()
        .context("the cache tarball has no folder")?;
    std::fs::create_dir_all(folder).with_context(|| format!("creating {}", folder.display()))?;
    // Made beside the tarball and renamed into place: a run that stops halfway leaves no tarball.
    let staging = folder.join(format!("{SUITE}-minbase.staging"));
    let partial = tarball.with_extension("tar.partial");
    mounts::remove(&staging)?;
    println!(
        "making the base root: debootstrap --variant=minbase {SUITE} from {mirror} (cached in {})",
        tarball.display()
    );
    let made = run_checked(
        Command::new("debootstrap")
            .args(["--variant=minbase", SUITE])
            .arg(&staging)
            .arg(mirror),
    )
    .and_then(|()| {
        run_checked(
            Command::new("tar")
                .args(["--numeric-owner", "-C"])
                .arg(&staging)
                .arg("-cf")
                .arg(&partial)
                .arg("."),
        )
    })
    .and_then(|()| {
        std::fs::rename(&partial, &tarball)
            .with_context(|| format!("renaming {} to {}", partial.display(), tarball.display()))
    });
    // debootstrap mounts /proc and /sys in the root it makes, and may leave them on failure.
    let removed = mounts::remove(&staging);
    let _ = std::fs::remove_file(&partial);
    made.and(removed).map(|()| true)
}

/// Unpacks the tarball into `root` (an empty folder).
pub(super) fn extract(root: &Path) -> anyhow::Result<()> {
    run_checked(
        Command::new("tar")
            .args(["--numeric-owner", "-xpf"])
            .arg(tarball())
            .arg("-C")
            .arg(root),
    )
}
