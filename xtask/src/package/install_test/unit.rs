//! The installed unit's `[Service]` settings that say how systemd runs its commands, and those
//! commands wrapped to run the same way by hand: `prlimit` for its `Limit*=`, `setpriv` for its
//! `CapabilityBoundingSet=` and `NoNewPrivileges=` (both util-linux, essential in Debian).
//!
//! Only the forms the unit uses are read; anything else this module cannot reproduce (a command
//! with quotes or a prefix such as `-`, a limit prlimit has no name for) is an error rather than a
//! command run differently from systemd.

use std::time::Duration;

use anyhow::{Context, bail, ensure};

/// A `Limit*=` setting: soft and hard limit alike, as systemd sets one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limit {
    /// prlimit's name for it (`nofile`).
    pub(super) option: &'static str,
    pub(super) resource: rustix::process::Resource,
    /// `None`: infinity.
    pub(super) value: Option<u64>,
}

/// What systemd would run and how.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Service {
    pub(super) exec_start_pre: Vec<Vec<String>>,
    pub(super) exec_start: Vec<String>,
    /// `CapabilityBoundingSet=`, as setpriv names them (`bpf`), empty when not set.
    pub(super) capabilities: Vec<String>,
    pub(super) no_new_privileges: bool,
    /// `Limit*=`.
    pub(super) limits: Vec<Limit>,
    /// `RuntimeDirectory=`: a folder of `/run`.
    pub(super) runtime_directory: String,
    pub(super) runtime_directory_mode: u32,
    /// `TimeoutStopSec=` (systemd's default: 90 s).
    pub(super) timeout_stop: Duration,
}

impl Service {
    /// Reads the `[Service]` section of a unit file.
    pub(super) fn parse(unit: &str) -> anyhow::Result<Service> {
        let mut service = Service {
            exec_start_pre: Vec::new(),
            exec_start: Vec::new(),
            capabilities: Vec::new(),
            no_new_privileges: false,
            limits: Vec::new(),
            runtime_directory: String::new(),
            runtime_directory_mode: 0o755,
            timeout_stop: Duration::from_secs(90),
        };
        let mut section = "";
        for line in unit.lines().map(str::trim) {
            if line.is_empty() || line.starts_with(['#', ';']) {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name;
                continue;
            }
            if section != "Service" {
                continue;
            }
            let (key, value) = line
                .split_once('=')
                .with_context(|| format!("not KEY=VALUE: {line:?}"))?;
            match key {
                "ExecStartPre" => service.exec_start_pre.push(command(value)?),
                "ExecStart" => {
                    ensure!(service.exec_start.is_empty(), "ExecStart= twice");
                    service.exec_start = command(value)?;
                }
                "CapabilityBoundingSet" => {
                    service.capabilities = value
                        .split_whitespace()
                        .map(|cap| {
                            cap.strip_prefix("CAP_")
                                .map(str::to_lowercase)
                                .with_context(|| format!("not a capability: {cap:?}"))
                        })
                        .collect::<anyhow::Result<_>>()?;
                }
                "NoNewPrivileges" => service.no_new_privileges = value == "yes" || value == "true",
                "RuntimeDirectory" => service.runtime_directory = value.to_owned(),
                "RuntimeDirectoryMode" => {
                    service.runtime_directory_mode = u32::from_str_radix(value, 8)
                        .with_context(|| format!("not an octal mode: {value:?}"))?;
                }
                "TimeoutStopSec" => service.timeout_stop = seconds(value)?,
                _ => {
                    if let Some(resource) = key.strip_prefix("Limit") {
                        service.limits.push(limit(resource, value)?);
                    }
                }
            }
        }
        ensure!(!service.exec_start.is_empty(), "the unit has no ExecStart=");
        ensure!(
            !service.runtime_directory.is_empty() && !service.runtime_directory.contains('/'),
            "the unit has no RuntimeDirectory= of one folder"
        );
        Ok(service)
    }

    /// `command` as systemd runs it: `limits` set (the unit's, or what this machine allows of
    /// them), its capabilities bounded, no new privileges.
    pub(super) fn wrap(&self, command: &[String], limits: &[Limit]) -> Vec<String> {
        let mut args = Vec::new();
        if !limits.is_empty() {
            args.push("prlimit".to_owned());
            for limit in limits {
                let value = limit
                    .value
                    .map_or_else(|| "unlimited".to_owned(), |v| v.to_string());
                args.push(format!("--{}={value}:{value}", limit.option));
            }
        }
        if !self.capabilities.is_empty() || self.no_new_privileges {
            args.push("setpriv".to_owned());
            if self.no_new_privileges {
                args.push("--no-new-privs".to_owned());
            }
            if !self.capabilities.is_empty() {
                let kept: Vec<String> = self.capabilities.iter().map(|c| format!("+{c}")).collect();
                args.push(format!("--bounding-set=-all,{}", kept.join(",")));
                // systemd gives a service no inheritable capabilities unless asked.
                args.push("--inh-caps=-all".to_owned());
            }
            args.push("--".to_owned());
        }
        args.extend(command.iter().cloned());
        args
    }
}

/// An `Exec*=` value: an absolute program and its arguments, without quotes or prefixes.
fn command(value: &str) -> anyhow::Result<Vec<String>> {
    ensure!(
        !value.contains(['"', '\'', '\\', '$', '%']),
        "a command this test cannot run as systemd would (quotes, escapes, variables or \
         specifiers): {value:?}"
    );
    let words: Vec<String> = value.split_whitespace().map(str::to_owned).collect();
    match words.first() {
        Some(program) if program.starts_with('/') => Ok(words),
        Some(program) => bail!("not an absolute program (a prefix such as `-`?): {program:?}"),
        None => bail!("an empty command"),
    }
}

/// A `Limit*=` setting.
fn limit(name: &str, value: &str) -> anyhow::Result<Limit> {
    use rustix::process::Resource;
    let (option, resource) = match name {
        "NOFILE" => ("nofile", Resource::Nofile),
        "MEMLOCK" => ("memlock", Resource::Memlock),
        "NPROC" => ("nproc", Resource::Nproc),
        "CORE" => ("core", Resource::Core),
        "STACK" => ("stack", Resource::Stack),
        "AS" => ("as", Resource::As),
        other => bail!("Limit{other}= is not reproduced here"),
    };
    let value = if value == "infinity" {
        None
    } else {
        Some(value.parse().with_context(|| {
            format!("Limit{name}={value}: only a number or infinity is reproduced here")
        })?)
    };
    Ok(Limit {
        option,
        resource,
        value,
    })
}

/// `40s`, `40` or `2min` as a duration.
fn seconds(value: &str) -> anyhow::Result<Duration> {
    let (number, unit) = value
        .find(|c: char| !c.is_ascii_digit())
        .map_or((value, ""), |at| value.split_at(at));
    let number: u64 = number
        .parse()
        .with_context(|| format!("not a time span: {value:?}"))?;
    Ok(Duration::from_secs(match unit {
        "" | "s" | "sec" => number,
        "min" => number * 60,
        _ => bail!("a time span this test does not read: {value:?}"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use xtask::workspace_root;

    #[test]
    fn the_units_commands_run_with_its_limits_and_capabilities() {
        let unit =
            std::fs::read_to_string(workspace_root().join("packaging/systemd/peregrine.service"))
                .unwrap();
        let service = Service::parse(&unit).unwrap();
        assert_eq!(
            service.exec_start,
            ["/usr/bin/peregrine", "run", "/etc/peregrine/peregrine.toml"]
        );
        assert_eq!(
            service.exec_start_pre,
            [[
                "/usr/bin/peregrine",
                "check",
                "/etc/peregrine/peregrine.toml"
            ]]
        );
        assert_eq!(service.runtime_directory, "peregrine");
        assert_eq!(service.runtime_directory_mode, 0o755);
        assert_eq!(service.timeout_stop, Duration::from_secs(40));
        let wrapped = service.wrap(&service.exec_start, &service.limits).join(" ");
        assert_eq!(
            wrapped,
            "prlimit --nofile=1048576:1048576 --memlock=unlimited:unlimited setpriv \
             --no-new-privs --bounding-set=-all,+bpf,+perfmon,+sys_resource,+sys_ptrace,+kill,\
             +net_bind_service,+setuid,+setgid,+setpcap,+chown,+dac_read_search --inh-caps=-all -- \
             /usr/bin/peregrine run /etc/peregrine/peregrine.toml"
        );
    }

    #[test]
    fn what_cannot_be_run_as_systemd_runs_it_is_an_error() {
        let unit = |line: &str| {
            format!("[Service]\nExecStart=/usr/bin/p run\nRuntimeDirectory=p\n{line}\n")
        };
        assert!(Service::parse(&unit("")).is_ok());
        for bad in [
            "ExecStartPre=-/usr/bin/p check",
            "ExecStartPre=/usr/bin/p \"a b\"",
            "ExecStartPre=/usr/bin/p $MAINPID",
            "LimitRTPRIO=5",
            "LimitNOFILE=1024:2048",
            "TimeoutStopSec=1h",
            "CapabilityBoundingSet=~CAP_SYS_ADMIN",
        ] {
            assert!(Service::parse(&unit(bad)).is_err(), "{bad}");
        }
        assert!(Service::parse("[Service]\nRuntimeDirectory=p\n").is_err());
        assert!(Service::parse("[Service]\nExecStart=/usr/bin/p\n").is_err());
        // Keys of other sections are not the service's.
        let other =
            "[Install]\nExecStart=nonsense\n[Service]\nExecStart=/usr/bin/p\nRuntimeDirectory=p\n";
        assert_eq!(Service::parse(other).unwrap().exec_start, ["/usr/bin/p"]);
    }
}
