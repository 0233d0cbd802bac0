//! What the kernel says about a process's privileges, read from outside it: its ids, groups,
//! capability sets and `no_new_privs` (`/proc/PID/status`), its environment, and the processes it
//! forked; and the accounts tests run workers as, looked up in the user database as `id` does.
//!
//! Read as root, these files show any process, whatever user it runs as.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    process::Command,
};

use anyhow::{Context, bail};
use peregrine_contract::procfs::StatusText;

/// A user of this machine: its name, uid, primary gid and every group `initgroups(3)` would give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    /// The user's name.
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary group.
    pub gid: u32,
    /// Every group it is in (the primary one included), as `id -G NAME` lists them.
    pub groups: BTreeSet<u32>,
}

impl Account {
    /// The user `name`, from the user database (`id`).
    ///
    /// # Panics
    ///
    /// When there is no such user.
    #[track_caller]
    pub fn lookup(name: &str) -> Account {
        Account::try_lookup(name).unwrap_or_else(|error| panic!("the user {name:?}: {error:#}"))
    }

    /// The user `name`, or why it cannot be found.
    pub fn try_lookup(name: &str) -> anyhow::Result<Account> {
        let id = |flag: &str| -> anyhow::Result<String> {
            let output = Command::new("id")
                .arg(flag)
                .arg(name)
                .output()
                .context("running id")?;
            if !output.status.success() {
                bail!(
                    "id {flag} {name}: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                );
            }
            Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
        };
        let number = |text: &str| -> anyhow::Result<u32> {
            text.parse()
                .with_context(|| format!("id printed {text:?}, not a number"))
        };
        Ok(Account {
            name: name.to_owned(),
            uid: number(&id("-u")?)?,
            gid: number(&id("-g")?)?,
            groups: id("-G")?
                .split_whitespace()
                .map(number)
                .collect::<anyhow::Result<_>>()?,
        })
    }

    /// Whether a process of this account holding no capability (as every worker) is granted
    /// `access` (an `rwx` triplet: 4 read, 2 write, 1 search or execute) on a file of owner `uid`,
    /// group `gid` and permission bits `mode`, as the kernel judges it from the mode bits alone: the
    /// owner's bits for the owner, the group's for a member of the group, the others' for anyone
    /// else; no ACLs. The supervisor judges a mode the same way (its `Account::may`).
    pub fn may(&self, access: u32, (uid, gid, mode): (u32, u32, u32)) -> bool {
        let shift = if self.uid == uid {
            6
        } else if self.gid == gid || self.groups.contains(&gid) {
            3
        } else {
            0
        };
        (mode >> shift) & access & 0o7 == access & 0o7
    }
}

/// A process's credentials as `/proc/PID/status` shows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Privileges {
    /// Real, effective, saved and filesystem uid.
    pub uids: [u32; 4],
    /// Real, effective, saved and filesystem gid.
    pub gids: [u32; 4],
    /// Supplementary groups.
    pub groups: BTreeSet<u32>,
    /// `CapInh`, `CapPrm`, `CapEff`, `CapBnd` and `CapAmb`, by name.
    pub capabilities: BTreeMap<&'static str, u64>,
    /// `NoNewPrivs`.
    pub no_new_privs: u32,
}

/// The capability sets `/proc/PID/status` lists, by their names there.
pub const CAPABILITY_SETS: [&str; 5] = ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"];

impl Privileges {
    /// The credentials of process `pid`.
    pub fn of(pid: u32) -> anyhow::Result<Privileges> {
        let path = format!("/proc/{pid}/status");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        Privileges::parse(&text).with_context(|| format!("{path} is not as expected:\n{text}"))
    }

    /// Parses the text of a `/proc/PID/status` file.
    pub fn parse(text: &str) -> anyhow::Result<Privileges> {
        let status = StatusText::new(text);
        let field = |key: &str| status.field(key).with_context(|| format!("no {key}: line"));
        let ids = |key: &str| -> anyhow::Result<[u32; 4]> {
            let ids: Vec<u32> = field(key)?
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .with_context(|| format!("{key}: not numbers"))?;
            ids.try_into()
                .map_err(|ids| anyhow::anyhow!("{key}: {ids:?} is not four ids"))
        };
        let mut capabilities = BTreeMap::new();
        for set in CAPABILITY_SETS {
            let mask = status
                .hex(set)
                .with_context(|| format!("{set}: no line, or not hexadecimal"))?;
            capabilities.insert(set, mask);
        }
        Ok(Privileges {
            uids: ids("Uid")?,
            gids: ids("Gid")?,
            groups: field("Groups")?
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .context("Groups: not numbers")?,
            capabilities,
            no_new_privs: field("NoNewPrivs")?
                .parse()
                .context("NoNewPrivs: not a number")?,
        })
    }

    /// What keeps these from being those of a process of `account` without any privilege (every uid
    /// and gid the account's, its groups, every capability set empty, `no_new_privs` set); empty
    /// when nothing does.
    pub fn excess_over(&self, account: &Account) -> Vec<String> {
        let mut problems = Vec::new();
        if self.uids != [account.uid; 4] {
            problems.push(format!(
                "Uid {:?}, not {}'s {}",
                self.uids, account.name, account.uid
            ));
        }
        if self.gids != [account.gid; 4] {
            problems.push(format!(
                "Gid {:?}, not {}'s {}",
                self.gids, account.name, account.gid
            ));
        }
        if self.groups != account.groups {
            problems.push(format!(
                "Groups {:?}, not {}'s {:?}",
                self.groups, account.name, account.groups
            ));
        }
        for (set, mask) in &self.capabilities {
            if *mask != 0 {
                problems.push(format!("{set} {mask:016x}, not empty"));
            }
        }
        if self.no_new_privs != 1 {
            problems.push(format!("NoNewPrivs {}, not 1", self.no_new_privs));
        }
        problems
    }
}

impl fmt::Display for Privileges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Uid {:?} Gid {:?} Groups {:?}",
            self.uids, self.gids, self.groups
        )?;
        for (set, mask) in &self.capabilities {
            write!(f, " {set} {mask:016x}")?;
        }
        write!(f, " NoNewPrivs {}", self.no_new_privs)
    }
}

/// Panics unless process `pid` and every process it forked (its descendants) run as `account` with
/// no privilege at all ([`Privileges::excess_over`]); returns how many processes were checked. A
/// process that exits while it is read is passed over.
#[track_caller]
pub fn assert_unprivileged(pid: u32, account: &Account) -> usize {
    let mut checked = 0;
    let mut problems = Vec::new();
    for process in std::iter::once(pid).chain(descendants(pid)) {
        let Ok(privileges) = Privileges::of(process) else {
            assert_ne!(process, pid, "process {pid} is gone");
            continue;
        };
        checked += 1;
        for problem in privileges.excess_over(account) {
            problems.push(format!(
                "process {process} ({}): {problem}",
                command_name(process)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "worker {pid} or a process it forked holds more than {}'s rights:\n{}",
        account.name,
        problems.join("\n")
    );
    checked
}

/// The processes `pid` forked, and those they forked, and so on (the live ones).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (process, parent) in parents() {
        children.entry(parent).or_default().push(process);
    }
    let mut found = Vec::new();
    let mut next = vec![pid];
    while let Some(parent) = next.pop() {
        for child in children.get(&parent).into_iter().flatten() {
            found.push(*child);
            next.push(*child);
        }
    }
    found.sort_unstable();
    found
}

/// Every live process with its parent's pid.
fn parents() -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            Some((pid, parent_in_stat(&stat)?))
        })
        .collect()
}

/// The parent's pid in the text of `/proc/PID/stat` (the field after the state, after the command
/// name, which may hold spaces and parentheses).
fn parent_in_stat(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The command name of process `pid` (`/proc/PID/comm`), for messages.
pub fn command_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|name| name.trim().to_owned())
        .unwrap_or_else(|_| "gone".to_owned())
}

/// The environment of process `pid` (`/proc/PID/environ`), as it was when it started.
pub fn environment(pid: u32) -> anyhow::Result<BTreeMap<String, String>> {
    let path = format!("/proc/{pid}/environ");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {path}"))?;
    Ok(bytes
        .split(|b| *b == 0)
        .filter_map(|var| {
            let var = String::from_utf8_lossy(var);
            let (name, value) = var.split_once('=')?;
            Some((name.to_owned(), value.to_owned()))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tsleep\nUmask:\t0022\nState:\tS (sleeping)\nPid:\t7\nPPid:\t1\n\
        Uid:\t65534\t65534\t65534\t65534\nGid:\t65534\t65534\t65534\t65534\nGroups:\t65534 \n\
        NoNewPrivs:\t1\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
        CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\n";

    fn nobody() -> Account {
        Account {
            name: "nobody".into(),
            uid: 65534,
            gid: 65534,
            groups: [65534].into(),
        }
    }

    #[test]
    fn parses_a_status_file_without_privileges() {
        let privileges = Privileges::parse(STATUS).unwrap();
        assert_eq!(privileges.uids, [65534; 4]);
        assert_eq!(privileges.groups, [65534].into());
        assert_eq!(privileges.no_new_privs, 1);
        assert_eq!(privileges.excess_over(&nobody()), Vec::<String>::new());
    }

    #[test]
    fn names_every_excess() {
        let text = STATUS
            .replace("Uid:\t65534\t65534\t65534", "Uid:\t65534\t0\t65534")
            .replace("CapBnd:\t0000000000000000", "CapBnd:\t000001ffffffffff")
            .replace("NoNewPrivs:\t1", "NoNewPrivs:\t0");
        let problems = Privileges::parse(&text).unwrap().excess_over(&nobody());
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("Uid [65534, 0, 65534, 65534]"));
        assert!(problems[1].starts_with("CapBnd 000001ffffffffff"));
        assert!(problems[2].starts_with("NoNewPrivs 0"));
    }

    #[test]
    fn reads_this_process_and_its_children() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let me = std::process::id();
        crate::wait_until(std::time::Duration::from_secs(5), "the child", || {
            descendants(me).contains(&child.id()).then_some(())
        });
        let ours = Privileges::of(me).unwrap();
        assert_eq!(ours.uids[1], rustix::process::geteuid().as_raw());
        assert!(environment(me).unwrap().contains_key("PATH"));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn the_parent_is_found_past_a_command_name_with_parentheses() {
        assert_eq!(parent_in_stat("12 (a) b (c)) S 34 12 12 0"), Some(34));
    }

    #[test]
    fn a_mode_is_judged_by_the_owner_group_or_other_bits() {
        let nobody = nobody();
        // Only the first triplet that applies counts: the owner denied is not saved by others.
        assert!(!nobody.may(4, (65534, 0, 0o044)));
        assert!(nobody.may(5, (0, 65534, 0o750)));
        assert!(!nobody.may(1, (0, 0, 0o750)));
        assert!(nobody.may(1, (0, 0, 0o711)));
        assert!(!nobody.may(5, (0, 0, 0o701)));
    }

    #[test]
    fn looks_up_root() {
        let root = Account::lookup("root");
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0));
        assert!(Account::try_lookup("no-such-user-of-peregrine").is_err());
    }
}
