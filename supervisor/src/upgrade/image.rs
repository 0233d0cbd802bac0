//! The program image a supervisor runs: the file it was started from, its arguments and its
//! version, remembered at start for an upgrade in place.

use std::{
    ffi::{OsStr, OsString},
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    time::SystemTime,
};

use peregrine_proto::v1;

/// What the running supervisor was started as.
#[derive(Clone, Debug)]
pub struct Image {
    /// The program file to exec on an upgrade; `None` when it could not be told at start.
    program: Option<PathBuf>,
    /// Every argument, the program's name first.
    args: Vec<OsString>,
    /// The `--version` line, without the command's name.
    version: String,
    /// When this image started.
    started: SystemTime,
}

impl Image {
    /// This process as started: call it first thing in `main`, before the working directory could
    /// change. `version` is what `--version` prints after the command's name.
    pub fn capture(version: impl Into<String>) -> Image {
        let args: Vec<OsString> = std::env::args_os().collect();
        let program = program_path(
            args.first().map(OsString::as_os_str),
            std::env::current_dir().ok().as_deref(),
            std::env::current_exe().ok(),
        );
        Image {
            program,
            args,
            version: version.into(),
            started: SystemTime::now(),
        }
    }

    /// The program file an upgrade execs.
    pub fn program(&self) -> Option<&Path> {
        self.program.as_deref()
    }

    /// Every argument, the program's name first.
    pub fn args(&self) -> &[OsString] {
        &self.args
    }

    /// The `--version` line, without the command's name.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// What `peregrine status` says of the supervisor.
    pub fn status(&self) -> v1::Supervisor {
        let started_unix_ms = self
            .started
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        v1::Supervisor {
            pid: std::process::id(),
            version: self.version.clone(),
            started_unix_ms,
        }
    }
}

impl Default for Image {
    /// An image that cannot be upgraded (a supervisor started by a test, say).
    fn default() -> Self {
        Image {
            program: None,
            args: Vec::new(),
            version: String::new(),
            started: SystemTime::now(),
        }
    }
}

/// The program file a process was started from, as a path to look up again at upgrade time: its
/// `argv[0]` when that names a file (holds a `/`), made absolute against the working directory at
/// start; otherwise (found through `PATH`) `current_exe` as read at start. Symbolic links are not
/// resolved: a link that a package points elsewhere is followed to the new file.
fn program_path(
    argv0: Option<&OsStr>,
    cwd: Option<&Path>,
    current_exe: Option<PathBuf>,
) -> Option<PathBuf> {
    match argv0 {
        Some(name) if name.as_bytes().contains(&b'/') => {
            let name = Path::new(name);
            if name.is_absolute() {
                Some(name.to_owned())
            } else {
                cwd.map(|cwd| cwd.join(name))
            }
        }
        _ => current_exe,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_is_the_path_it_was_started_by_else_the_executable_read_at_start() {
        let exe = Some(PathBuf::from("/opt/peregrine-0.1/bin/peregrine"));
        let cwd = Some(Path::new("/srv"));
        let path = |argv0: &str| program_path(Some(OsStr::new(argv0)), cwd, exe.clone());
        assert_eq!(
            path("/usr/bin/peregrine"),
            Some(PathBuf::from("/usr/bin/peregrine")),
            "an absolute path, not resolved (a symlink a package moves is followed)"
        );
        assert_eq!(
            path("./target/debug/peregrine"),
            Some(PathBuf::from("/srv/./target/debug/peregrine")),
            "relative to the directory at start"
        );
        assert_eq!(path("peregrine"), exe, "found through PATH");
        assert_eq!(program_path(None, cwd, None), None);
        assert_eq!(
            program_path(Some(OsStr::new("bin/peregrine")), None, exe.clone()),
            None,
            "a relative path without a directory to resolve it against"
        );
    }

    #[test]
    fn the_status_names_this_process_and_the_images_start() {
        let image = Image {
            version: "0.1.0 (abc1234, eBPF sampler built in)".into(),
            started: SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_234),
            ..Image::default()
        };
        assert_eq!(
            image.status(),
            v1::Supervisor {
                pid: std::process::id(),
                version: "0.1.0 (abc1234, eBPF sampler built in)".into(),
                started_unix_ms: 1_234,
            }
        );
    }
}
