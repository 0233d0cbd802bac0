//! The files a configuration touches: the config file itself (read within [`MAX_CONFIG_BYTES`]), the
//! directory its relative paths are taken from, and the paths and worker programs it names.
//!
//! Invariant: a relative path in the file is always taken from the canonical directory of the file
//! (never from the current directory), and one file gets one name, so that two supervisors started
//! from different directories never share a socket by accident.

use std::path::{Path, PathBuf};

use super::{Program, limits::MAX_CONFIG_BYTES};

/// Reads `path` as UTF-8 text of at most [`MAX_CONFIG_BYTES`].
pub(super) fn read_capped(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("longer than {MAX_CONFIG_BYTES} bytes: not a config file"),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// The canonical directory of the file `path` (symlinks resolved); for a file without a canonical
/// path (a pipe, `/dev/fd/N`), the absolute form of its directory.
pub(super) fn canonical_dir(path: &Path) -> std::io::Result<PathBuf> {
    let file = std::fs::canonicalize(path).or_else(|_| std::path::absolute(path))?;
    Ok(file.parent().unwrap_or(Path::new("/")).to_owned())
}

/// `path` taken from the absolute directory `base`, `.` and `..` resolved, and the symlinks of its
/// directory resolved where that directory exists already: one file has one name.
pub(super) fn absolute_in(base: &Path, path: &Path) -> PathBuf {
    use std::path::Component;
    let mut lexical = PathBuf::new();
    for part in base.join(path).components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                lexical.pop();
            }
            other => lexical.push(other),
        }
    }
    match (lexical.parent(), lexical.file_name()) {
        (Some(dir), Some(name)) => match std::fs::canonicalize(dir) {
            Ok(dir) => dir.join(name),
            Err(_) => lexical,
        },
        _ => lexical,
    }
}

/// Why a worker's program was not found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum ProgramError {
    /// A path that is not an executable file.
    #[error("{} is not an executable file", .0.display())]
    NotExecutable(PathBuf),
    /// A name no directory of `PATH` holds as an executable file.
    #[error("program {0:?} not found in PATH")]
    NotInPath(String),
}

/// Finds a worker's program: `peregrine` is this binary; a name with a `/` is a path (relative to the
/// config file's directory); any other name is looked up in `PATH`. It must be an executable file.
pub(super) fn resolve_program(
    program: &str,
    base: &Path,
    search_path: Option<&str>,
) -> Result<Program, ProgramError> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program == "peregrine" {
        return Ok(Program::Peregrine);
    }
    if program.contains('/') {
        let path = base.join(program);
        return if executable(&path) {
            Ok(Program::Path(path))
        } else {
            Err(ProgramError::NotExecutable(path))
        };
    }
    search_path
        .unwrap_or_default()
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(program))
        .find(|path| executable(path))
        .map(Program::Path)
        .ok_or_else(|| ProgramError::NotInPath(program.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_config_file_is_read_only_up_to_its_cap() {
        let err = Config::load(Path::new("/dev/zero")).expect_err("not a config");
        let text = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(text.contains("longer than 1048576 bytes"), "{text}");
    }

    #[test]
    fn relative_paths_become_one_canonical_path() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        std::fs::write(
            real.join("p.toml"),
            "[supervisor]\ncontrol = \"./sub/../p.sock\"\n[service.a]\n",
        )
        .unwrap();
        let canonical = std::fs::canonicalize(&real).unwrap().join("p.sock");
        for path in [real.join("p.toml"), dir.path().join("link/p.toml")] {
            let config = Config::load(&path).unwrap();
            assert_eq!(config.supervisor.control, canonical, "{}", path.display());
        }
        assert_eq!(
            absolute_in(Path::new("/nonexistent/dir"), Path::new("../x/./y.sock")),
            Path::new("/nonexistent/x/y.sock")
        );
    }
}
