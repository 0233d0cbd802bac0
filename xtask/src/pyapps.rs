//! The unchanged third-party HTTP servers the tests run as workers: gunicorn (WSGI) and uvicorn
//! (ASGI), pinned, in a virtualenv under the target directory. Plain `uvicorn` (its pure-Python h11
//! parser, no extras): the servers bring nothing beyond their own dependencies.

use std::{path::PathBuf, process::Command};

use peregrine_e2e::target_dir;

use crate::pip_install;

/// The pinned packages.
const PACKAGES: [&str; 2] = ["gunicorn==27.0.1", "uvicorn==0.54.0"];

/// The servers' programs in the virtualenv's `bin`.
const SERVERS: [&str; 2] = ["gunicorn", "uvicorn"];

/// Returns the virtualenv's bin directory with `gunicorn` and `uvicorn` in it, installing them first
/// if they do not both run.
pub(crate) fn install() -> anyhow::Result<PathBuf> {
    let venv = target_dir().join("pyapps/venv");
    let bin = venv.join("bin");
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
    eprintln!("installing {} into {}", PACKAGES.join(" "), venv.display());
    pip_install(&venv, &PACKAGES)?;
    anyhow::ensure!(
        all_run(&bin),
        "gunicorn and uvicorn do not run after pip install"
    );
    Ok(bin)
}
