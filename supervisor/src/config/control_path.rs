//! The control socket's path, read from a config file alone: what `status`, `restart`, `reload` and
//! `upgrade` need to reach a running supervisor.
//!
//! Invariant: the path is the one [`Config::load`] would give (`PEREGRINE_CONTROL`, else
//! `supervisor.control` taken from the file's directory, else [`DEFAULT_CONTROL`] there), and it is
//! found without the checks that only starting needs (users, programs, privileges, limits): those
//! depend on who asks and on the rest of the file, which may be half edited while the supervisor
//! runs on what it read before. Only when the path itself cannot be told does the whole file's
//! check speak, with its lines.

use std::path::{Path, PathBuf};

use super::{
    Config, ConfigError, DEFAULT_CONTROL,
    files::{absolute_in, canonical_dir, read_capped},
};

/// The control socket of the supervisor that runs on the config file at `path`.
pub fn control_socket(path: &Path) -> Result<PathBuf, ConfigError> {
    let read_error = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    if let Some(control) = std::env::var_os("PEREGRINE_CONTROL") {
        let base = canonical_dir(path).map_err(read_error)?;
        return Ok(absolute_in(&base, Path::new(&control)));
    }
    let source = read_capped(path).map_err(read_error)?;
    let base = canonical_dir(path).map_err(read_error)?;
    match control_in(&source) {
        Some(control) => Ok(absolute_in(
            &base,
            Path::new(control.as_deref().unwrap_or(DEFAULT_CONTROL)),
        )),
        // Only the whole check can say what is wrong, and where.
        None => Config::load(path).map(|config| config.supervisor.control),
    }
}

/// `supervisor.control` in the TOML text `source`: `Some(None)` when the file does not set it,
/// `None` when it cannot be told. A file that is not valid TOML as a whole is read for its
/// `[supervisor]` table alone (a half-edited service does not hide the socket).
fn control_in(source: &str) -> Option<Option<String>> {
    let table = match source.parse::<toml::Table>() {
        Ok(document) => document.get("supervisor").cloned(),
        Err(_) => supervisor_table(source)?.map(toml::Value::Table),
    };
    match table {
        None => Some(None),
        Some(toml::Value::Table(supervisor)) => match supervisor.get("control") {
            None => Some(None),
            Some(toml::Value::String(control)) => Some(Some(control.clone())),
            Some(_) => None,
        },
        Some(_) => None,
    }
}

/// The `[supervisor]` table of `source`, parsed from its own lines (its header to the next table's
/// header): `Some(None)` when no line opens it, `None` when its lines are not valid TOML.
fn supervisor_table(source: &str) -> Option<Option<toml::Table>> {
    let is_header = |line: &str| line.trim_start().starts_with('[');
    let mut lines = source.lines();
    if !lines.any(|line| header_name(line) == Some("supervisor")) {
        return Some(None);
    }
    let body: Vec<&str> = lines.take_while(|line| !is_header(line)).collect();
    body.join("\n").parse::<toml::Table>().ok().map(Some)
}

/// The name of the table a `[name]` line opens (comments and spaces aside).
fn header_name(line: &str) -> Option<&str> {
    let line = line.split('#').next()?.trim();
    let name = line.strip_prefix('[')?.strip_suffix(']')?.trim();
    (!name.starts_with('[')).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_is_read_from_the_supervisor_table() {
        assert_eq!(
            control_in("[supervisor]\ncontrol = \"/run/p.sock\"\n[service.a]\ncount = 2\n"),
            Some(Some("/run/p.sock".into()))
        );
        assert_eq!(control_in("[service.a]\ncount = 2\n"), Some(None));
        assert_eq!(control_in(""), Some(None));
    }

    #[test]
    fn a_half_edited_service_does_not_hide_the_socket() {
        let half_edited = "# the host's config\n[supervisor] # ours\ncontrol = \"/run/p.sock\"\n\n\
                           [service.a]\ncount = \ncommand = [\"x\"\n";
        assert_eq!(control_in(half_edited), Some(Some("/run/p.sock".into())));
        assert_eq!(
            control_in("[service.a]\ncount = \n"),
            Some(None),
            "no [supervisor] table: the default"
        );
    }

    #[test]
    fn a_socket_that_cannot_be_told_is_left_to_the_whole_check() {
        assert_eq!(control_in("[supervisor]\ncontrol = 5\n"), None);
        assert_eq!(control_in("supervisor = 5\n"), None);
        assert_eq!(control_in("[supervisor]\ncontrol = \"/run/p.sock\n"), None);
    }

    #[test]
    fn a_path_is_taken_from_the_files_directory_as_load_takes_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.toml");
        std::fs::write(
            &file,
            "[supervisor]\ncontrol = \"sub/../c.sock\"\n[service.a]\ncommand = [\"/no/such/program\"]\n",
        )
        .unwrap();
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        assert_eq!(control_socket(&file).unwrap(), canonical.join("c.sock"));
        let error = Config::load(&file).expect_err("the program is missing");
        assert!(error.to_string().contains("/no/such/program"), "{error}");

        std::fs::write(&file, "[supervisor]\ncontrol = 5\n").unwrap();
        let error = control_socket(&file).expect_err("not a path");
        assert!(error.to_string().contains("line 2"), "{error}");
    }
}
