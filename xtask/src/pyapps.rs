//! The unchanged third-party HTTP servers the tests run as workers: gunicorn (WSGI) and uvicorn
//! (ASGI), pinned, in a virtualenv under the target directory. Plain `uvicorn` (its pure-Python h11
//! parser, no extras): the servers bring nothing beyond their own dependencies.
//!
//! The virtualenv is made from Debian's `/usr/bin/python3` when there is one (else the `python3` in
//! `PATH`): these servers also run as other users (`user = "nobody"` in the privilege tests), and a
//! virtualenv's `bin/python` is a symbolic link to its base python, which they must be able to
//! run. The `python3` first in `PATH` may be a pyenv under `/root` (0700), which no other user can.
//! A virtualenv made from another python than that (`home` and `executable` in its `pyvenv.cfg`),
//! such as one an older xtask made, is removed and made again.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context;
use peregrine_testenv::target_dir;

use crate::pip_install_with;

/// The pinned packages.
const PACKAGES: [&str; 2] = ["gunicorn==27.0.1", "uvicorn==0.54.0"];

/// The servers' programs in the virtualenv's `bin`.
const SERVERS: [&str; 2] = ["gunicorn", "uvicorn"];

/// Debian's python, which every user may run.
const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// Returns the virtualenv's bin directory with `gunicorn` and `uvicorn` in it, installing them first
/// if they do not both run; a virtualenv made from another python than `base_python` is made
/// again first.
pub fn install() -> anyhow::Result<PathBuf> {
    let venv = target_dir().join("pyapps/venv");
    let bin = venv.join("bin");
    let base = base_python();
    remove_if_made_from_another(&venv, &base)?;
    let all_run = |bin: &PathBuf| {
        SERVERS.iter().all(|server| {
            Command::new(bin.join(server))
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
    };
    if all_run(&bin) {
        return Ok(bin);
    }
    eprintln!(
        "installing {} into {} (from {})",
        PACKAGES.join(" "),
        venv.display(),
        base.display()
    );
    pip_install_with(&base, &venv, &PACKAGES)?;
    anyhow::ensure!(
        all_run(&bin),
        "gunicorn and uvicorn do not run after pip install"
    );
    Ok(bin)
}

/// The python to make the virtualenv from: [`SYSTEM_PYTHON`] when it exists, else `python3` from
/// `PATH`.
fn base_python() -> PathBuf {
    if Path::new(SYSTEM_PYTHON).is_file() {
        PathBuf::from(SYSTEM_PYTHON)
    } else {
        PathBuf::from("python3")
    }
}

/// Removes the virtualenv `venv` when its `pyvenv.cfg` says it was made from another python than
/// `base`; leaves it (or its absence) alone otherwise.
fn remove_if_made_from_another(venv: &Path, base: &Path) -> anyhow::Result<()> {
    let cfg = venv.join("pyvenv.cfg");
    let Ok(text) = std::fs::read_to_string(&cfg) else {
        return Ok(());
    };
    let wanted = real_executable(base)?;
    let made_from = Recorded::parse(&text);
    if made_from.is(&wanted) {
        return Ok(());
    }
    eprintln!(
        "{} was made from {}, not {} ({}): making it again",
        venv.display(),
        made_from.describe(),
        base.display(),
        wanted.display()
    );
    std::fs::remove_dir_all(venv).with_context(|| format!("removing {}", venv.display()))
}

/// The file `base` runs as, symbolic links resolved, as it says itself (so a pyenv shim answers
/// with the python it picks).
fn real_executable(base: &Path) -> anyhow::Result<PathBuf> {
    let output = Command::new(base)
        .args([
            "-c",
            "import os, sys; print(os.path.realpath(sys.executable))",
        ])
        .output()
        .with_context(|| format!("running {}", base.display()))?;
    anyhow::ensure!(
        output.status.success(),
        "{} failed ({}): {}",
        base.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(PathBuf::from(String::from_utf8(output.stdout)?.trim()))
}

/// The base python a virtualenv's `pyvenv.cfg` records: the directory it was in (`home`) and, from
/// Python 3.11 on, the file itself (`executable`).
#[derive(Debug, Default, PartialEq, Eq)]
struct Recorded {
    home: Option<PathBuf>,
    executable: Option<PathBuf>,
}

impl Recorded {
    /// The `home` and `executable` lines of `pyvenv.cfg`'s text (`key = value`).
    fn parse(text: &str) -> Recorded {
        let mut recorded = Recorded::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let value = Some(PathBuf::from(value.trim()));
            match key.trim() {
                "home" => recorded.home = value,
                "executable" => recorded.executable = value,
                _ => {}
            }
        }
        recorded
    }

    /// Whether the recorded python is `real` (a path with its links resolved): its `executable`,
    /// resolved, when there is one, else its `home`, resolved, is the directory `real` is in.
    fn is(&self, real: &Path) -> bool {
        let resolved = |path: &Path| std::fs::canonicalize(path).ok();
        match (&self.executable, &self.home) {
            (Some(executable), _) => resolved(executable).as_deref() == Some(real),
            (None, Some(home)) => resolved(home).is_some_and(|home| real.parent() == Some(&*home)),
            (None, None) => false,
        }
    }

    /// The recorded python, for messages.
    fn describe(&self) -> String {
        match (&self.executable, &self.home) {
            (Some(executable), _) => executable.display().to_string(),
            (None, Some(home)) => format!("a python in {}", home.display()),
            (None, None) => "an unrecorded python".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PYENV: &str = "home = /root/.pyenv/versions/3.11.7/bin\n\
        include-system-site-packages = false\nversion = 3.11.7\n\
        executable = /root/.pyenv/versions/3.11.7/bin/python3.11\n\
        command = /root/.pyenv/versions/3.11.7/bin/python3 -m venv /x/target/pyapps/venv\n";

    #[test]
    fn reads_home_and_executable() {
        assert_eq!(
            Recorded::parse(PYENV),
            Recorded {
                home: Some("/root/.pyenv/versions/3.11.7/bin".into()),
                executable: Some("/root/.pyenv/versions/3.11.7/bin/python3.11".into()),
            }
        );
        assert_eq!(Recorded::parse("version = 3.9\n"), Recorded::default());
    }

    #[test]
    fn a_venv_of_another_python_is_not_the_system_ones() {
        let dir = tempfile::TempDir::new().unwrap();
        let real = dir.path().join("python3.11");
        std::fs::write(&real, "").unwrap();
        let link = dir.path().join("python3");
        std::os::unix::fs::symlink("python3.11", &link).unwrap();
        let real = std::fs::canonicalize(&real).unwrap();
        let ours = |text: String| Recorded::parse(&text).is(&real);
        // Through the link or not, with or without `executable`.
        assert!(ours(format!("executable = {}\n", link.display())));
        assert!(ours(format!("home = {}\n", dir.path().display())));
        assert!(!ours(PYENV.to_owned()));
        assert!(!ours("home = /nonexistent\n".to_owned()));
        assert!(!ours(String::new()));
    }
}
