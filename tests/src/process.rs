//! Child processes that cannot outlive the test (or the demo) that started them.

use std::{
    fs::File,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::Duration,
};

use anyhow::Context;
use rustix::process::{Pid, Signal, kill_process, kill_process_group};

use crate::wait::try_wait_until;

/// A child process started in a process group of its own, with stdout and stderr written to
/// `<dir>/<name>.stdout.log` and `<dir>/<name>.stderr.log`.
///
/// `Drop` sends SIGKILL to the whole group (the child and anything it started that did not leave the
/// group, such as the supervisor's workers) and reaps the child. When the thread is panicking, `Drop`
/// prints the logs first, so a failing test shows what its processes said.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
    status: Option<ExitStatus>,
}

// === impl ChildGuard ===

impl ChildGuard {
    /// Spawns `command` as `name`, logging into `log_dir`.
    pub fn spawn(name: &str, command: &mut Command, log_dir: &Path) -> anyhow::Result<Self> {
        let stdout = log_dir.join(format!("{name}.stdout.log"));
        let stderr = log_dir.join(format!("{name}.stderr.log"));
        let child = command
            .stdin(Stdio::null())
            .stdout(
                File::create(&stdout).with_context(|| format!("creating {}", stdout.display()))?,
            )
            .stderr(
                File::create(&stderr).with_context(|| format!("creating {}", stderr.display()))?,
            )
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", command.get_program()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            stdout,
            stderr,
            status: None,
        })
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's pid (also its process group id).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the child has exited, without blocking.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// An error (with the logs) if the child has exited: for checks inside a wait loop.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        match self.try_wait() {
            None => Ok(()),
            Some(status) => anyhow::bail!("{} exited early ({status})\n{}", self.name, self.logs()),
        }
    }

    /// Sends `signal` to the child alone (not its group).
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        kill_process(self.pid(), signal).with_context(|| format!("signalling {}", self.name))
    }

    /// Sends SIGTERM and waits up to `grace` for the child to exit; then kills the group as `Drop` does.
    /// Returns the child's exit status, or an error if it had to be killed.
    pub fn stop(&mut self, grace: Duration) -> anyhow::Result<ExitStatus> {
        self.signal(Signal::TERM)?;
        let waited = try_wait_until(
            grace,
            &format!("{} to exit after SIGTERM", self.name),
            || self.try_wait(),
        );
        self.kill();
        waited
    }

    /// SIGKILLs the process group and reaps the child.
    pub fn kill(&mut self) {
        // The group may outlive its leader, so it is signalled even when the child has exited; ESRCH
        // just means nobody is left.
        let _ = kill_process_group(self.pid(), Signal::KILL);
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
    }

    /// Paths of the stdout and stderr logs.
    pub fn log_paths(&self) -> (&Path, &Path) {
        (&self.stdout, &self.stderr)
    }

    /// Both logs, labelled.
    pub fn logs(&self) -> String {
        let read = |path: &Path| std::fs::read_to_string(path).unwrap_or_else(|e| format!("<{e}>"));
        format!(
            "--- {name} stdout ({stdout}) ---\n{}\n--- {name} stderr ({stderr}) ---\n{}",
            read(&self.stdout),
            read(&self.stderr),
            name = self.name,
            stdout = self.stdout.display(),
            stderr = self.stderr.display(),
        )
    }

    /// Prints both logs to stderr (captured by the test runner and shown when the test fails).
    pub fn dump_logs(&self) {
        eprintln!("{}", self.logs());
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32).expect("a child pid is positive")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            self.dump_logs();
        }
    }
}

/// `binary` as a command, run through `wrapper` when there is one (e.g. `ip netns exec NAME`, to run
/// it in a host's namespace): the wrapper's program with its arguments, then `binary`.
pub(crate) fn wrapped<S: AsRef<std::ffi::OsStr>>(
    wrapper: &[S],
    binary: impl AsRef<std::ffi::OsStr>,
) -> Command {
    match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(binary);
            command
        }
        None => Command::new(binary),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_kills_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        // The shell starts a grandchild in the same group and reports its pid.
        let mut guard = ChildGuard::spawn(
            "sh",
            Command::new("sh").args(["-c", "sleep 600 & echo $!; wait"]),
            dir.path(),
        )
        .unwrap();
        let grandchild: u32 =
            crate::wait_until(Duration::from_secs(5), "the grandchild pid", || {
                std::fs::read_to_string(&guard.stdout)
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            });
        guard.ensure_running().unwrap();
        drop(guard);
        // The grandchild is reaped by init once killed; until then it may still be a zombie.
        crate::wait_until(Duration::from_secs(5), "the grandchild to die", || {
            crate::gone(grandchild).then_some(())
        });
    }

    #[test]
    fn stop_reports_the_exit_status_and_logs() {
        let dir = tempfile::tempdir().unwrap();
        let mut guard = ChildGuard::spawn(
            "trap",
            Command::new("sh").args([
                "-c",
                "trap 'echo bye; exit 3' TERM; echo hi; while :; do sleep 0.01; done",
            ]),
            dir.path(),
        )
        .unwrap();
        crate::wait_until(Duration::from_secs(5), "the shell to start", || {
            guard.logs().contains("hi").then_some(())
        });
        let status = guard.stop(Duration::from_secs(5)).unwrap();
        assert_eq!(status.code(), Some(3));
        assert!(guard.logs().contains("bye"), "{}", guard.logs());
    }
}
