//! The previous release's `peregrine`, built from its commit, for the test that a supervisor of this
//! version adopts its workers or refuses them with a drain (tests/tests/previous_release.rs).
//!
//! Built from the git history of this checkout (`git archive` of the release's commit, so no
//! network and no tag needed) into `target/previous/<version>/`, with its own target directory,
//! once: the binary stays until the release named here changes. Its own target directory, because
//! a build of another tree into this one's would put its binaries where the tests take this
//! version's.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};
use peregrine_testenv::{target_dir, workspace_root};

use crate::run_checked;

/// A release: its version and the commit it was made from (tagged `v<version>`).
#[derive(Clone, Copy, Debug)]
pub struct Release {
    /// Its version.
    pub version: &'static str,
    /// Its commit.
    pub commit: &'static str,
}

/// The release before this tree's version (CHANGELOG.md has its section).
pub const PREVIOUS: Release = Release {
    version: "0.1.0",
    commit: "fc1a977108bb13aab46c02afac3e128983aa851f",
};

/// The previous release's `peregrine` binary, built first if it is not there yet.
pub fn install() -> anyhow::Result<PathBuf> {
    let home = target_dir().join("previous").join(PREVIOUS.version);
    let binary = home.join("peregrine");
    if runs(&binary) {
        return Ok(binary);
    }
    eprintln!(
        "Building Peregrine {} (commit {}), the previous release, into {}",
        PREVIOUS.version,
        &PREVIOUS.commit[..12],
        home.display()
    );
    let source = home.join("src");
    if source.exists() {
        std::fs::remove_dir_all(&source)
            .with_context(|| format!("removing {}", source.display()))?;
    }
    std::fs::create_dir_all(&source).with_context(|| format!("creating {}", source.display()))?;
    extract(PREVIOUS.commit, &source)?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run_checked(
        Command::new(cargo)
            .current_dir(&source)
            .args(["build", "--locked", "--bin", "peregrine"])
            .arg("--target-dir")
            .arg(home.join("target"))
            // The version line names the commit, as a release's binary does.
            .env("PEREGRINE_COMMIT", &PREVIOUS.commit[..7]),
    )?;
    let built = home.join("target/debug/peregrine");
    std::fs::copy(&built, &binary)
        .with_context(|| format!("copying {} to {}", built.display(), binary.display()))?;
    // The binary is all the tests run: the source and the build (1.5 GB) go.
    for dir in [source, home.join("target")] {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    if !runs(&binary) {
        bail!("{} was built but does not run", binary.display());
    }
    Ok(binary)
}

/// Writes the tree of `commit` into `into`, from this checkout's git history.
fn extract(commit: &str, into: &Path) -> anyhow::Result<()> {
    let root = workspace_root();
    let mut archive = Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["archive", "--format=tar", commit])
        .stdout(Stdio::piped())
        .spawn()
        .context("running git archive (git is needed to build the previous release)")?;
    let stdout = archive.stdout.take().context("git archive's output")?;
    let untar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(into)
        .stdin(stdout)
        .status()
        .context("running tar")?;
    let archived = archive.wait()?;
    if !archived.success() {
        bail!(
            "git archive {commit} failed ({archived}): the previous release's commit is not in \
             this checkout's history (a shallow clone? fetch it with `git fetch --unshallow`)"
        );
    }
    if !untar.success() {
        bail!(
            "unpacking git archive {commit} into {} failed",
            into.display()
        );
    }
    Ok(())
}

/// Whether `binary --version` runs.
fn runs(binary: &Path) -> bool {
    Command::new(binary)
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_previous_release_has_its_changelog_section_and_a_full_commit() {
        let changelog = std::fs::read_to_string(workspace_root().join("CHANGELOG.md")).unwrap();
        let heading = format!("## [{}] - ", PREVIOUS.version);
        assert!(
            changelog.contains(&heading),
            "no `{heading}` in CHANGELOG.md"
        );
        assert_eq!(PREVIOUS.commit.len(), 40);
        assert!(PREVIOUS.commit.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
