//! What the installed supervisor gives its workers, read from the kernel: each worker of the
//! packaged config runs as the package's system user (uid, gid and the groups the group database
//! gives it, as `initgroups(3)` sets them) with no capabilities at all and `no_new_privs`, on every
//! thread; and the runtime directory holds the control socket and its lock owner-only, and the
//! service's registration socket for its group alone.

use std::{
    collections::BTreeSet,
    fs,
    os::unix::fs::{FileTypeExt as _, MetadataExt as _},
    path::Path,
};

use anyhow::{Context, ensure};

/// The capability lines of `/proc/PID/status`, each of which must be zero in a worker.
const CAPABILITY_SETS: [&str; 5] = ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"];

/// A user as the root's databases give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Account {
    pub(super) name: String,
    pub(super) uid: u32,
    /// The primary group.
    pub(super) gid: u32,
    /// Every group, the primary one included (`id -G`, as `getgrouplist(3)` gives them).
    pub(super) groups: BTreeSet<u32>,
}

impl Account {
    /// Reads `getent passwd NAME` and `id -G NAME` output.
    pub(super) fn parse(name: &str, passwd: &str, groups: &str) -> anyhow::Result<Account> {
        let fields: Vec<&str> = passwd.trim().split(':').collect();
        ensure!(
            fields.len() == 7 && fields[0] == name,
            "not the passwd line of {name}: {passwd:?}"
        );
        let number = |field: &str, what: &str| -> anyhow::Result<u32> {
            field
                .parse()
                .with_context(|| format!("{name}'s {what} is not a number: {passwd:?}"))
        };
        let groups = groups
            .split_whitespace()
            .map(|gid| {
                gid.parse()
                    .with_context(|| format!("not a group id: {gid:?} in {groups:?}"))
            })
            .collect::<anyhow::Result<BTreeSet<u32>>>()?;
        let account = Account {
            name: name.to_owned(),
            uid: number(fields[2], "uid")?,
            gid: number(fields[3], "gid")?,
            groups,
        };
        ensure!(
            account.groups.contains(&account.gid),
            "`id -G {name}` does not name its primary group {}: {:?}",
            account.gid,
            account.groups
        );
        Ok(account)
    }
}

/// The credentials one `/proc/PID/status` (or `/proc/PID/task/TID/status`) shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Credentials {
    /// Real, effective, saved and filesystem uid.
    pub(super) uids: [u32; 4],
    pub(super) gids: [u32; 4],
    pub(super) groups: BTreeSet<u32>,
    /// `CapInh`, `CapPrm`, `CapEff`, `CapBnd`, `CapAmb`, in that order.
    pub(super) capabilities: [u64; 5],
    pub(super) no_new_privs: bool,
}

impl Credentials {
    /// Reads the lines of a `status` file that say who the task is and what it may do.
    pub(super) fn parse(status: &str) -> anyhow::Result<Credentials> {
        let text = peregrine_contract::procfs::StatusText::new(status);
        let field = |key: &str| -> anyhow::Result<&str> {
            text.field(key)
                .with_context(|| format!("no {key}: line in {status:?}"))
        };
        let ids = |key: &str| -> anyhow::Result<[u32; 4]> {
            let ids: Vec<u32> = field(key)?
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .with_context(|| format!("{key}: is not four ids"))?;
            ids.try_into()
                .map_err(|ids| anyhow::anyhow!("{key}: has {ids:?}, not four ids"))
        };
        let mut capabilities = [0; 5];
        for (set, value) in CAPABILITY_SETS.iter().zip(&mut capabilities) {
            *value = u64::from_str_radix(field(set)?, 16)
                .with_context(|| format!("{set}: is not hexadecimal"))?;
        }
        Ok(Credentials {
            uids: ids("Uid")?,
            gids: ids("Gid")?,
            groups: field("Groups")?
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .context("Groups: is not a list of ids")?,
            capabilities,
            no_new_privs: match field("NoNewPrivs")? {
                "1" => true,
                "0" => false,
                other => anyhow::bail!("NoNewPrivs: {other:?}"),
            },
        })
    }

    /// What differs from a task of `account` with no capabilities and `no_new_privs`: nothing
    /// when it is one.
    pub(super) fn differences(&self, account: &Account) -> Vec<String> {
        let mut wrong = Vec::new();
        if self.uids != [account.uid; 4] {
            wrong.push(format!(
                "Uid {:?}, not {} ({})",
                self.uids, account.uid, account.name
            ));
        }
        if self.gids != [account.gid; 4] {
            wrong.push(format!("Gid {:?}, not {}", self.gids, account.gid));
        }
        if self.groups != account.groups {
            wrong.push(format!(
                "Groups {:?}, not {:?}",
                self.groups, account.groups
            ));
        }
        for (set, value) in CAPABILITY_SETS.iter().zip(self.capabilities) {
            if value != 0 {
                wrong.push(format!("{set} {value:016x}, not 0"));
            }
        }
        if !self.no_new_privs {
            wrong.push("NoNewPrivs 0, not 1".to_owned());
        }
        wrong
    }
}

/// Fails unless every thread of process `pid` runs as `account` with no capabilities and
/// `no_new_privs`; the line that says so.
pub(super) fn check_worker(pid: u32, account: &Account) -> anyhow::Result<String> {
    let tasks = Path::new("/proc").join(pid.to_string()).join("task");
    let mut threads = 0;
    for entry in fs::read_dir(&tasks).with_context(|| format!("reading {}", tasks.display()))? {
        let status = entry?.path().join("status");
        let text = match fs::read_to_string(&status) {
            Ok(text) => text,
            // A thread that ended meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", status.display())),
        };
        let wrong = Credentials::parse(&text)?.differences(account);
        ensure!(
            wrong.is_empty(),
            "worker {pid} ({}) does not run as {} with no privileges: {}",
            status.display(),
            account.name,
            wrong.join("; ")
        );
        threads += 1;
    }
    ensure!(threads > 0, "worker {pid} has no threads: it has exited");
    Ok(format!(
        "worker {pid}: uid {uid} and gid {gid} ({name}), CapInh CapPrm CapEff CapBnd CapAmb 0 and \
         NoNewPrivs 1, on each of its threads ({threads})",
        uid = account.uid,
        gid = account.gid,
        name = account.name,
    ))
}

/// A file's kind, permission bits and owner, as `ls -ln` would put them: `socket 0660 0:105`.
pub(super) fn describe(path: &Path) -> anyhow::Result<String> {
    let meta = fs::symlink_metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let kind = meta.file_type();
    let kind = if kind.is_socket() {
        "socket"
    } else if kind.is_dir() {
        "folder"
    } else if kind.is_file() {
        "file"
    } else {
        "other"
    };
    Ok(file_line(kind, meta.mode(), meta.uid(), meta.gid()))
}

/// `kind`, the permission bits (setuid, setgid and sticky included) in octal, and `uid:gid`.
pub(super) fn file_line(kind: &str, mode: u32, uid: u32, gid: u32) -> String {
    format!("{kind} {:04o} {uid}:{gid}", mode & 0o7777)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORKER: &str = "\
Name:\tperegrine
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Uid:\t101\t101\t101\t101
Gid:\t102\t102\t102\t102
FDSize:\t64
Groups:\t102 
NStgid:\t4242
CapInh:\t0000000000000000
CapPrm:\t0000000000000000
CapEff:\t0000000000000000
CapBnd:\t0000000000000000
CapAmb:\t0000000000000000
NoNewPrivs:\t1
Seccomp:\t0
";

    fn peregrine() -> Account {
        Account::parse(
            "peregrine",
            "peregrine:x:101:102::/nonexistent:/usr/sbin/nologin\n",
            "102\n",
        )
        .unwrap()
    }

    #[test]
    fn a_worker_of_the_user_without_privileges_passes() {
        let account = peregrine();
        assert_eq!((account.uid, account.gid), (101, 102));
        let worker = Credentials::parse(WORKER).unwrap();
        assert_eq!(worker.differences(&account), Vec::<String>::new());
    }

    #[test]
    fn root_a_capability_or_privileges_to_gain_are_each_named() {
        let account = peregrine();
        let as_root = WORKER
            .replace("Uid:\t101\t101\t101\t101", "Uid:\t0\t0\t0\t0")
            .replace("Groups:\t102 ", "Groups:\t0 102");
        let wrong = Credentials::parse(&as_root).unwrap().differences(&account);
        assert_eq!(
            wrong,
            [
                "Uid [0, 0, 0, 0], not 101 (peregrine)",
                "Groups {0, 102}, not {102}"
            ]
        );
        // setuid(2) back to root is possible while the saved uid is 0.
        let saved = WORKER.replace("Uid:\t101\t101\t101\t101", "Uid:\t101\t101\t0\t101");
        assert_eq!(
            Credentials::parse(&saved)
                .unwrap()
                .differences(&account)
                .len(),
            1
        );
        // CAP_NET_BIND_SERVICE kept in the bounding set, and no no_new_privs.
        let kept = WORKER
            .replace("CapBnd:\t0000000000000000", "CapBnd:\t0000000000000400")
            .replace("NoNewPrivs:\t1", "NoNewPrivs:\t0");
        assert_eq!(
            Credentials::parse(&kept).unwrap().differences(&account),
            ["CapBnd 0000000000000400, not 0", "NoNewPrivs 0, not 1"]
        );
    }

    #[test]
    fn a_status_without_the_lines_or_an_odd_account_is_an_error() {
        assert!(Credentials::parse("Name:\tx\nUid:\t1\t1\t1\t1\n").is_err());
        assert!(
            Credentials::parse(&WORKER.replace("Uid:\t101\t101\t101\t101", "Uid:\t101")).is_err()
        );
        assert!(Account::parse("peregrine", "root:x:0:0:root:/root:/bin/sh", "0").is_err());
        // `id -G` always names the primary group.
        assert!(
            Account::parse(
                "peregrine",
                "peregrine:x:101:102::/nonexistent:/usr/sbin/nologin",
                "5"
            )
            .is_err()
        );
    }

    #[test]
    fn a_files_line_has_its_kind_mode_and_owner() {
        assert_eq!(file_line("socket", 0o140660, 0, 102), "socket 0660 0:102");
        assert_eq!(file_line("folder", 0o40755, 0, 0), "folder 0755 0:0");
        let dir = tempfile::TempDir::new().unwrap();
        let file = dir.path().join("lock");
        fs::write(&file, "").unwrap();
        fs::set_permissions(
            &file,
            <fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
        )
        .unwrap();
        let uid = rustix::process::getuid().as_raw();
        let gid = rustix::process::getgid().as_raw();
        assert_eq!(describe(&file).unwrap(), format!("file 0600 {uid}:{gid}"));
    }
}
