//! Plots of the benchmarks: a Python script of the benchmark's own, run with matplotlib (pinned,
//! pip-installed once into `<out>/venv`, where `out` is `target/bench`).

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context;
use xtask::{pip_install, run_checked};

/// The pinned plotting library.
const MATPLOTLIB: &str = "matplotlib==3.10.9";

/// A python that can import matplotlib: `<out>/venv`'s, installed there first if it cannot yet.
pub(crate) fn python(out: &Path) -> anyhow::Result<PathBuf> {
    let venv = out.join("venv");
    let python = venv.join("bin/python");
    let importable = Command::new(&python)
        .args(["-c", "import matplotlib"])
        .output()
        .is_ok_and(|o| o.status.success());
    if importable {
        return Ok(python);
    }
    eprintln!("installing {MATPLOTLIB} into {}", venv.display());
    pip_install(&venv, &[MATPLOTLIB])
}

/// Writes `script` to `<out>/<name>` and runs it with matplotlib's python and `args`.
pub(crate) fn run(
    out: &Path,
    name: &str,
    script: &str,
    args: impl IntoIterator<Item = impl AsRef<OsStr>>,
) -> anyhow::Result<()> {
    let python = python(out)?;
    let path = out.join(name);
    std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
    run_checked(Command::new(python).arg(&path).args(args))
}
