//! The new program's checks before an upgrade execs it: it must run (`--version`) and accept the
//! config the supervisor runs with (`check`).

use std::{
    path::{Path, PathBuf},
    process::{Output, Stdio},
    time::Duration,
};

use crate::children::Children;

/// How long each check may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// How much of a check's output an error quotes.
const QUOTED: usize = 2000;

/// Why the new program is not run.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// It could not be started at all.
    #[error("cannot run {program} (is a program installed there, executable by this user?)")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A check ran and failed.
    #[error("`{program} {args}` failed ({status}){}", quoted(.output))]
    Failed {
        /// The program.
        program: PathBuf,
        /// Its arguments.
        args: String,
        /// How it ended.
        status: std::process::ExitStatus,
        /// What it printed.
        output: String,
    },
    /// A check did not finish in time (it was killed).
    #[error("`{program} {args}` did not finish within {} s", CHECK_TIMEOUT.as_secs())]
    Timeout {
        /// The program.
        program: PathBuf,
        /// Its arguments.
        args: String,
    },
}

fn quoted(output: &str) -> String {
    if output.is_empty() {
        String::new()
    } else {
        format!(": {output}")
    }
}

/// Runs `program --version` and `program check config`, as children the orphan reaper of
/// `children` leaves to their waiter; returns the version it prints (without the command's name).
pub(super) async fn new_program(
    program: &Path,
    config: &Path,
    children: &Children,
) -> Result<String, CheckError> {
    let version = run(program, &["--version".as_ref()], children).await?;
    run(program, &["check".as_ref(), config.as_os_str()], children).await?;
    let line = version.lines().next().unwrap_or_default().trim();
    Ok(version_of(line).to_owned())
}

/// `0.1.0 (abc)` of `peregrine 0.1.0 (abc)`.
fn version_of(line: &str) -> &str {
    line.split_once(' ').map_or(line, |(_, version)| version)
}

/// Runs `program args`; its standard output if it succeeds in time.
async fn run(
    program: &Path,
    args: &[&std::ffi::OsStr],
    children: &Children,
) -> Result<String, CheckError> {
    let shown = args
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // A check speaks for nobody to the service manager.
    for name in crate::service_manager::INHERITED {
        command.env_remove(name);
    }
    let spawned = children.spawn_waited(|| {
        let child = command.spawn()?;
        Ok((child.id().unwrap_or_default(), child))
    });
    let (pid, child) = spawned.map_err(|source| CheckError::Spawn {
        program: program.to_owned(),
        source,
    })?;
    let waited = tokio::time::timeout(CHECK_TIMEOUT, child.wait_with_output()).await;
    // Reaped by now, or killed on drop (tokio reaps what it kills).
    children.done_waiting(pid);
    let output: Output = match waited {
        Ok(Ok(output)) => output,
        Ok(Err(source)) => {
            return Err(CheckError::Spawn {
                program: program.to_owned(),
                source,
            });
        }
        Err(_) => {
            return Err(CheckError::Timeout {
                program: program.to_owned(),
                args: shown,
            });
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        return Ok(stdout);
    }
    let mut printed = stdout;
    printed.push_str(&String::from_utf8_lossy(&output.stderr));
    let printed = printed.trim();
    let cut = printed
        .char_indices()
        .nth(QUOTED)
        .map_or(printed.len(), |(i, _)| i);
    Err(CheckError::Failed {
        program: program.to_owned(),
        args: shown,
        status: output.status,
        output: printed[..cut].replace('\n', "; "),
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// A shell script at `dir/peregrine`. Written by `cp`, not by this process: a descriptor this
    /// process opened to write it could be inherited by a child another test forks meanwhile, and
    /// executing the script while that child holds it fails with "Text file busy".
    fn script(dir: &Path, body: &str) -> PathBuf {
        let source = dir.join("peregrine.txt");
        std::fs::write(&source, format!("#!/bin/sh\n{body}\n")).unwrap();
        let path = dir.join("peregrine");
        let copied = std::process::Command::new("cp")
            .arg(&source)
            .arg(&path)
            .status()
            .unwrap();
        assert!(copied.success());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn a_program_that_runs_and_accepts_the_config_gives_its_version() {
        let dir = tempfile::tempdir().unwrap();
        let program = script(
            dir.path(),
            r#"case "$1" in --version) echo "peregrine 9.9.9 (abc1234, eBPF sampler built in)";; check) test -f "$2";; *) exit 2;; esac"#,
        );
        let config = dir.path().join("peregrine.toml");
        std::fs::write(&config, "").unwrap();
        assert_eq!(
            new_program(&program, &config, &Children::default())
                .await
                .unwrap(),
            "9.9.9 (abc1234, eBPF sampler built in)"
        );
        let error = new_program(
            &program,
            &dir.path().join("missing.toml"),
            &Children::default(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&error, CheckError::Failed { args, .. } if args.starts_with("check ")),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn a_program_that_fails_or_is_missing_is_named_with_what_it_printed() {
        let dir = tempfile::tempdir().unwrap();
        let program = script(dir.path(), "echo broken >&2; exit 1");
        let error = new_program(&program, Path::new("/dev/null"), &Children::default())
            .await
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "`{} --version` failed (exit status: 1): broken",
                program.display()
            )
        );
        let missing = dir.path().join("nothing");
        let error = new_program(&missing, Path::new("/dev/null"), &Children::default())
            .await
            .unwrap_err();
        assert!(matches!(error, CheckError::Spawn { .. }), "{error:?}");
    }
}
