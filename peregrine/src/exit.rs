//! How a command ends: its exit code, those of sysexits.h where one fits. docs/operating.md lists
//! them in one table, which a test holds to [`Exit::ALL`].

use std::process::ExitCode;

use peregrine_supervisor::{
    config::ConfigError, status::StatusError, upgrade::client::UpgradeError,
};

/// An exit code of `peregrine`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The command did what it was asked.
    Success,
    /// The command ran and failed: `run` stopped on an error after its checks, a `restart` or
    /// `reload` with a failure, an upgrade the supervisor refused.
    Failure,
    /// The command line is wrong: an unknown option, a missing argument, a value out of range.
    Usage,
    /// The config file does not exist or cannot be read.
    NoInput,
    /// No supervisor answers on the control socket; for `upgrade`, also one that cannot upgrade
    /// in place.
    Unavailable,
    /// The supervisor did not answer in time.
    TempFail,
    /// This user may not read the config file or talk to the supervisor.
    NoPermission,
    /// The config file has a problem.
    Config,
}

impl Exit {
    /// Every exit code, in the order of the docs' table.
    pub const ALL: [Exit; 8] = [
        Exit::Success,
        Exit::Failure,
        Exit::Usage,
        Exit::NoInput,
        Exit::Unavailable,
        Exit::TempFail,
        Exit::NoPermission,
        Exit::Config,
    ];

    /// The number the process exits with.
    pub fn code(self) -> u8 {
        match self {
            Exit::Success => 0,
            Exit::Failure => 1,
            Exit::Usage => 64,
            Exit::NoInput => 66,
            Exit::Unavailable => 69,
            Exit::TempFail => 75,
            Exit::NoPermission => 77,
            Exit::Config => 78,
        }
    }

    /// Its name in sysexits.h (`None` for 0 and 1, which it leaves to programs).
    pub fn sysexits_name(self) -> Option<&'static str> {
        match self {
            Exit::Success | Exit::Failure => None,
            Exit::Usage => Some("EX_USAGE"),
            Exit::NoInput => Some("EX_NOINPUT"),
            Exit::Unavailable => Some("EX_UNAVAILABLE"),
            Exit::TempFail => Some("EX_TEMPFAIL"),
            Exit::NoPermission => Some("EX_NOPERM"),
            Exit::Config => Some("EX_CONFIG"),
        }
    }

    /// What it means, in a sentence (the manual's EXIT STATUS).
    pub fn meaning(self) -> &'static str {
        match self {
            Exit::Success => "The command did what it was asked.",
            Exit::Failure => {
                "The command ran and failed: run stopped on an error after its checks, a restart \
                 or reload with a failure, an upgrade the supervisor refused."
            }
            Exit::Usage => "The command line is wrong, or PEREGRINE_LOG_FORMAT names no format.",
            Exit::NoInput => "The config file does not exist or cannot be read.",
            Exit::Unavailable => {
                "No supervisor answers on the control socket; for upgrade, also one that cannot \
                 upgrade in place (and for check, one whose workers this version cannot adopt)."
            }
            Exit::TempFail => "The supervisor did not answer in time.",
            Exit::NoPermission => {
                "This user may not read the config file or talk to the supervisor: run the \
                 command with sudo."
            }
            Exit::Config => "The config has a problem, or a TLS file it names cannot be used.",
        }
    }

    /// How a config that could not be loaded ends the command.
    pub fn of_config(error: &ConfigError) -> Exit {
        match error {
            ConfigError::Read { source, .. }
                if source.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                Exit::NoPermission
            }
            ConfigError::Read { .. } => Exit::NoInput,
            ConfigError::Invalid { .. } => Exit::Config,
        }
    }

    /// How a supervisor that could not be asked ends the command.
    pub fn of_status(error: &StatusError) -> Exit {
        match error {
            StatusError::NotRunning { .. } => Exit::Unavailable,
            StatusError::NotAllowed { .. } | StatusError::Refused { .. } => Exit::NoPermission,
            StatusError::Timeout { .. } => Exit::TempFail,
            StatusError::Io { .. } | StatusError::Malformed { .. } => Exit::Failure,
        }
    }

    /// How a failed `peregrine upgrade` ends: [`Exit::Unavailable`] tells the package's postinst
    /// to restart the supervisor instead.
    pub fn of_upgrade(error: &UpgradeError) -> Exit {
        match error {
            _ if error.cannot_upgrade_in_place() => Exit::Unavailable,
            UpgradeError::Ask(ask) => Exit::of_status(ask),
            _ => Exit::Failure,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> ExitCode {
        ExitCode::from(exit.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows of the table under `## Exit codes` in docs/operating.md: code, then the
    /// sysexits.h name (or `-`).
    fn documented() -> Vec<(u8, Option<String>)> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operating.md");
        let text = std::fs::read_to_string(path).expect("docs/operating.md");
        let section = text
            .split("\n## Exit codes\n")
            .nth(1)
            .expect("a section `## Exit codes`");
        section
            .lines()
            .take_while(|line| !line.starts_with("## "))
            .filter(|line| line.starts_with("| ") && !line.starts_with("| code"))
            .map(|line| {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                let code = cells[1].trim_matches('`').parse().expect("a code");
                let name = cells[2].trim_matches('`');
                (code, (name != "-").then(|| name.to_owned()))
            })
            .collect()
    }

    #[test]
    fn the_docs_list_every_exit_code_and_no_other() {
        let ours: Vec<(u8, Option<String>)> = Exit::ALL
            .iter()
            .map(|exit| (exit.code(), exit.sysexits_name().map(str::to_owned)))
            .collect();
        assert_eq!(documented(), ours);
    }

    #[test]
    fn codes_are_distinct_and_kept_apart_from_signals_and_the_shell() {
        let mut codes: Vec<u8> = Exit::ALL.iter().map(|e| e.code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), Exit::ALL.len());
        // 126 and 127 are the shell's (cannot execute, not found), 128+N a death by signal N.
        assert!(codes.iter().all(|&c| c < 126));
    }

    #[test]
    fn a_config_error_says_what_kind_it_is() {
        let read = |kind| ConfigError::Read {
            path: "/etc/p.toml".into(),
            source: std::io::Error::from(kind),
        };
        assert_eq!(
            Exit::of_config(&read(std::io::ErrorKind::NotFound)),
            Exit::NoInput
        );
        assert_eq!(
            Exit::of_config(&read(std::io::ErrorKind::PermissionDenied)),
            Exit::NoPermission
        );
        let invalid = ConfigError::Invalid {
            path: "/etc/p.toml".into(),
            problems: Vec::new(),
        };
        assert_eq!(Exit::of_config(&invalid), Exit::Config);
    }
}
