//! Records the commit the binary is built from, for `peregrine --version`.
//!
//! The commit is `git rev-parse --short HEAD` of the tree being built; outside a git tree (a source
//! tarball) it is `PEREGRINE_COMMIT` when set, else `unknown`. Cargo runs this script again when HEAD
//! moves (a commit, a checkout), so the binary never names a commit it was not built from. Only this
//! thin crate is rebuilt then: the supervisor library and the worker do not see the commit.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

fn main() {
    println!("cargo::rerun-if-env-changed=PEREGRINE_COMMIT");
    let dir = std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo");
    let commit = match git_commit(Path::new(&dir)) {
        Some((commit, watched)) => {
            for path in watched {
                println!("cargo::rerun-if-changed={path}");
            }
            commit
        }
        None => {
            // Not a git tree: nothing to watch but this script and the variable.
            println!("cargo::rerun-if-changed=build.rs");
            std::env::var("PEREGRINE_COMMIT")
                .ok()
                .filter(|commit| !commit.trim().is_empty())
                .map_or_else(|| "unknown".to_owned(), |commit| commit.trim().to_owned())
        }
    };
    println!("cargo::rustc-env=PEREGRINE_BUILD_COMMIT={commit}");
}

/// HEAD's short hash in `dir`'s git tree, and the paths that change when HEAD moves: `HEAD` itself
/// (a checkout), the branch it points to (a commit) and `packed-refs` (where git may keep the
/// branch); `None` when `dir` is in no git tree or git is missing.
///
/// Only existing paths are watched: cargo reruns a script that watches a missing file every time.
/// A branch kept in `packed-refs` alone is watched through its folder, where a commit writes it.
fn git_commit(dir: &Path) -> Option<(String, Vec<String>)> {
    let commit = git(dir, &["rev-parse", "--short", "HEAD"])?;
    let path = |name: &str| {
        git(
            dir,
            &["rev-parse", "--path-format=absolute", "--git-path", name],
        )
        .map(PathBuf::from)
    };
    let mut watched: Vec<PathBuf> = ["HEAD", "packed-refs"]
        .into_iter()
        .filter_map(path)
        .collect();
    // A detached HEAD names no branch: HEAD alone moves.
    if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"]).and_then(|b| path(&b)) {
        match branch.parent() {
            Some(folder) if !branch.exists() => watched.push(folder.to_path_buf()),
            _ => watched.push(branch),
        }
    }
    let watched = watched
        .into_iter()
        .filter(|path| path.exists())
        .map(|path| path.display().to_string())
        .collect();
    Some((commit, watched))
}

/// `git ARGS` in `dir`, its trimmed output when it succeeds with some.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let text = text.trim();
    (output.status.success() && !text.is_empty()).then(|| text.to_owned())
}
