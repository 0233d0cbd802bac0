//! The package's unit as a config's check sees it (`peregrine check --unit`): the capabilities the
//! unit leaves the supervisor (`CapabilityBoundingSet=`), and the folders it hides from the
//! supervisor and its workers (`ProtectHome=yes`: `/home`, `/root`, `/run/user`). An operator's
//! `sudo peregrine check` runs with every capability and sees every folder; the unit's start does
//! not, so a config that passes the one can fail the other.
//!
//! Invariant: what is read here is the unit the package installs, compiled in: the check and the
//! unit cannot drift apart.

use std::path::{Path, PathBuf};

use rustix::thread::CapabilitySet;

use super::{Config, Problem, Program};

/// The unit the package installs.
const UNIT: &str = include_str!("../../../packaging/systemd/peregrine.service");

/// What the unit grants and hides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitSandbox {
    /// `CapabilityBoundingSet=`: every capability the supervisor may hold.
    pub capabilities: CapabilitySet,
    /// The folders `ProtectHome=` hides.
    pub hidden: Vec<PathBuf>,
}

/// Why the unit's sandbox could not be entered.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The unit names a capability this build does not know.
    #[error("the unit's CapabilityBoundingSet= names {0}, which this build does not know")]
    Unknown(String),
    /// The capabilities could not be read or set.
    #[error("cannot drop this process's capabilities to the unit's")]
    Capabilities(#[source] std::io::Error),
}

impl UnitSandbox {
    /// The package's unit.
    pub fn packaged() -> Result<UnitSandbox, SandboxError> {
        UnitSandbox::of(UNIT)
    }

    /// The sandbox of the unit file `text`.
    fn of(text: &str) -> Result<UnitSandbox, SandboxError> {
        let mut capabilities = CapabilitySet::empty();
        let mut hidden = Vec::new();
        for line in text.lines() {
            if let Some(names) = line.strip_prefix("CapabilityBoundingSet=") {
                for name in names.split_whitespace() {
                    let bare = name.trim_start_matches("CAP_");
                    let capability = CapabilitySet::from_name(bare)
                        .ok_or_else(|| SandboxError::Unknown(name.to_owned()))?;
                    capabilities |= capability;
                }
            }
            if let Some(value) = line.strip_prefix("ProtectHome=")
                && matches!(value.trim(), "yes" | "true" | "read-only" | "tmpfs")
            {
                // read-only and tmpfs hide less, but a worker's program or a key there still
                // differs from what the operator sees: counted as hidden.
                hidden = ["/home", "/root", "/run/user"]
                    .iter()
                    .map(PathBuf::from)
                    .collect();
            }
        }
        Ok(UnitSandbox {
            capabilities,
            hidden,
        })
    }

    /// Drops this process's capabilities to those the unit leaves (effective, permitted and
    /// inheritable alike), as the unit's pre-start check runs.
    pub fn enter(&self) -> Result<(), SandboxError> {
        let mut sets =
            rustix::thread::capabilities(None).map_err(|e| SandboxError::Capabilities(e.into()))?;
        sets.effective &= self.capabilities;
        sets.permitted &= self.capabilities;
        sets.inheritable &= self.capabilities;
        rustix::thread::set_capabilities(None, sets)
            .map_err(|e| SandboxError::Capabilities(e.into()))
    }

    /// A problem for each path `config` (read from `config_path`) names that the unit hides: the
    /// config itself, a worker's program, a file it names, the control socket.
    pub fn hidden_paths(&self, config: &Config, config_path: &Path) -> Vec<Problem> {
        let hidden = |path: &Path| self.hidden.iter().find(|dir| path.starts_with(dir));
        let problem = |line, key: String, path: &Path, dir: &Path| Problem {
            line,
            key,
            message: format!(
                "{} is under {}, which the package's unit hides from the supervisor and its \
                 workers (ProtectHome=yes): move it, e.g. under /srv or /etc/peregrine",
                path.display(),
                dir.display()
            ),
        };
        let mut problems = Vec::new();
        let config_path = std::path::absolute(config_path).unwrap_or(config_path.to_owned());
        if let Some(dir) = hidden(&config_path) {
            problems.push(problem(None, "(the config file)".into(), &config_path, dir));
        }
        if let Some(dir) = hidden(&config.supervisor.control) {
            problems.push(problem(
                None,
                "supervisor.control".into(),
                &config.supervisor.control,
                dir,
            ));
        }
        for service in config.services.values() {
            if let Program::Path(program) = &service.command.program
                && let Some(dir) = hidden(program)
            {
                problems.push(problem(
                    None,
                    format!("service.{}.command", service.name),
                    program,
                    dir,
                ));
            }
        }
        for file in &config.files {
            if let Some(dir) = hidden(&file.path) {
                problems.push(problem(
                    Some(file.line.0),
                    file.key.clone(),
                    &file.path,
                    dir,
                ));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn the_packaged_unit_grants_what_the_supervisor_needs_and_hides_the_homes() {
        let unit = UnitSandbox::packaged().unwrap();
        for needed in [
            CapabilitySet::BPF,
            CapabilitySet::PERFMON,
            CapabilitySet::SETUID,
            CapabilitySet::SETGID,
            CapabilitySet::DAC_READ_SEARCH,
            CapabilitySet::KILL,
        ] {
            assert!(unit.capabilities.contains(needed), "{needed:?}");
        }
        assert!(!unit.capabilities.contains(CapabilitySet::DAC_OVERRIDE));
        assert!(!unit.capabilities.contains(CapabilitySet::SYS_ADMIN));
        assert_eq!(unit.hidden[..2], [PathBuf::from("/home"), "/root".into()]);
        assert!(matches!(
            UnitSandbox::of("CapabilityBoundingSet=CAP_NOT_ONE"),
            Err(SandboxError::Unknown(_))
        ));
    }

    #[test]
    fn paths_the_unit_hides_are_named_at_their_keys() {
        let config = Config::parse(
            "[supervisor]\ncontrol = \"/run/peregrine/p.sock\"\n[supervisor.tls]\n\
             cert = \"/root/tls/server.pem\"\nkey = \"/etc/peregrine/tls/server.key\"\n\
             [envoy.tls]\nca = \"/etc/peregrine/tls/ca.pem\"\n[service.a]\n",
            Path::new("/etc/peregrine"),
            &HashMap::new(),
        )
        .unwrap();
        let unit = UnitSandbox::packaged().unwrap();
        let found: Vec<String> = unit
            .hidden_paths(&config, Path::new("/home/me/peregrine.toml"))
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].starts_with("(the config file): /home/me/peregrine.toml is under /home"));
        assert!(
            found[1]
                .starts_with("line 4: supervisor.tls.cert: /root/tls/server.pem is under /root")
        );
    }
}
