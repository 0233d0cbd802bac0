//! The account a service's workers run as (`user`, `group`): resolved from the user and group
//! databases when the config is checked, with the supplementary groups `initgroups(3)` would give.
//!
//! Also what the supervisor itself is ([`Identity`]: its uid, gid and whether it may start processes
//! as someone else), and where the workers of a service with a `user` register
//! ([`worker_socket`]).
//!
//! Invariant: an [`Account`] is complete: its uid, gid and groups are numbers, resolved once, so a
//! worker is started without a database lookup between `fork` and `exec` (where none is safe), and a
//! database changed after the check changes nothing until the config is loaded again.

use std::{
    ffi::{CString, OsString},
    path::{Path, PathBuf},
};

use nix::unistd::{Gid, Group, Uid, User, getgrouplist};
use rustix::thread::CapabilitySet;

/// The account a service's workers run as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    /// The user as the config writes it (a name or a uid), for logs.
    pub user: String,
    /// The uid the workers run as.
    pub uid: u32,
    /// Their gid: the `group` key's, or the user's primary group.
    pub gid: u32,
    /// Their supplementary groups, as `getgrouplist(3)` gives them for the user and `gid` (which it
    /// includes); `[gid]` alone for a uid without an entry in the user database.
    pub groups: Vec<u32>,
    /// The user's login name and home directory from the user database, for the workers' `USER`,
    /// `LOGNAME` and `HOME` (as systemd's `User=` sets them); none for a uid without an entry.
    pub login: Option<(String, PathBuf)>,
}

impl Account {
    /// Whether workers of this account run as another uid or gid than `identity`, so that starting
    /// them takes the right to switch users.
    pub fn is_other_than(&self, identity: &Identity) -> bool {
        self.uid != identity.uid || self.gid != identity.gid
    }

    /// Whether a process of this account, holding no capability (as every worker), is granted
    /// `access` (an `rwx` triplet: 4 read, 2 write, 1 search or execute) on a file of owner `uid`,
    /// group `gid` and permission bits `mode`, as the kernel judges it from the mode bits alone (the
    /// owner's bits for the owner, the group's for a member of the group, the others' for anyone
    /// else; no ACLs).
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

    /// The nearest folder on the way to `path` that this account may not search, with its
    /// permission bits; `None` when it may search every one (or one cannot be looked at: nothing
    /// is then known to stop it).
    pub fn unsearchable_folder(&self, path: &Path) -> Option<(PathBuf, u32)> {
        use std::os::unix::fs::MetadataExt;
        path.ancestors().skip(1).find_map(|dir| {
            let meta = std::fs::metadata(dir).ok()?;
            (!self.may(0o1, (meta.uid(), meta.gid(), meta.mode())))
                .then(|| (dir.to_path_buf(), meta.mode() & 0o7777))
        })
    }
}

/// Who the supervisor runs as, and whether it may start workers as someone else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The effective uid.
    pub uid: u32,
    /// The effective gid.
    pub gid: u32,
    /// Whether it may switch users ([`can_switch_users`]).
    pub can_switch: bool,
}

impl Identity {
    /// This process's.
    pub fn of_this_process() -> Identity {
        Identity {
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
            can_switch: can_switch_users(),
        }
    }

    /// A supervisor that runs as root, as the package's unit runs it: what a command that only
    /// reads the config (`envoy-bootstrap`) checks it as, whoever runs that command.
    pub fn root() -> Identity {
        Identity {
            uid: 0,
            gid: 0,
            can_switch: true,
        }
    }
}

/// Whether this process may start workers as another user: its effective capabilities hold
/// CAP_SETUID and CAP_SETGID (a root process normally holds every capability). When the capabilities
/// cannot be read, an effective uid of 0 stands for them.
pub fn can_switch_users() -> bool {
    let needed = CapabilitySet::SETUID | CapabilitySet::SETGID;
    match rustix::thread::capabilities(None) {
        Ok(sets) => sets.effective.contains(needed),
        Err(_) => rustix::process::geteuid().is_root(),
    }
}

/// Whether this process may read files of other users that only their owner may read, as each
/// process's `/proc/PID/environ` is (mode 0400): its effective capabilities hold CAP_DAC_READ_SEARCH
/// or CAP_DAC_OVERRIDE. Adopting a worker of another user reads that file. When the capabilities
/// cannot be read, an effective uid of 0 stands for them.
pub fn can_read_other_users_files() -> bool {
    match rustix::thread::capabilities(None) {
        Ok(sets) => sets
            .effective
            .intersects(CapabilitySet::DAC_READ_SEARCH | CapabilitySet::DAC_OVERRIDE),
        Err(_) => rustix::process::geteuid().is_root(),
    }
}

/// The socket the workers of `service` register on when it runs under a `user` of its own:
/// `<control>.<service>.workers`, the service's name and `.workers` appended to the control socket's
/// file name (`/run/peregrine/peregrine.sock.web.workers`).
pub fn worker_socket(control: &Path, service: &str) -> PathBuf {
    let mut path = OsString::from(control.as_os_str());
    path.push(format!(".{service}.workers"));
    PathBuf::from(path)
}

/// A `user` or `group` as written: a name, or a numeric id (a text of ASCII digits).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Who<'a> {
    Name(&'a str),
    Id(u32),
}

/// Which of the two keys a problem is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AccountKey {
    /// `user`.
    User,
    /// `group`.
    Group,
}

impl AccountKey {
    /// The key's name: `user` or `group`.
    pub(super) fn name(self) -> &'static str {
        match self {
            AccountKey::User => "user",
            AccountKey::Group => "group",
        }
    }

    /// What its numeric form is: `uid` or `gid`.
    fn id(self) -> &'static str {
        match self {
            AccountKey::User => "uid",
            AccountKey::Group => "gid",
        }
    }
}

/// Why a `user` or `group` was refused; [`AccountError::key`] says at which.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum AccountError {
    /// `user` or `group` is empty.
    #[error("must name a {} or give a numeric {}", .0.name(), .0.id())]
    Empty(AccountKey),
    /// A numeric id beyond what the kernel takes.
    #[error("{written} is not a valid {}: ids run from 0 to 4294967294", .key.id())]
    IdOutOfRange {
        /// Which key.
        key: AccountKey,
        /// The id as written.
        written: String,
    },
    /// No such user name.
    #[error("no user {0:?} in the user database")]
    UnknownUser(String),
    /// A uid without an entry, and no `group` to give its gid.
    #[error(
        "uid {0} has no entry in the user database, so it has no primary group: set group too \
         (the workers then have that group alone)"
    )]
    UidWithoutGroup(u32),
    /// No such group name.
    #[error("no group {0:?} in the group database")]
    UnknownGroup(String),
    /// `group` without `user`.
    #[error(
        "is set without user: a service's workers run as the supervisor's own user and group \
         unless user names another; set user too"
    )]
    GroupWithoutUser,
    /// The database could not be read.
    #[error("cannot read the {} database: {error}", .key.name())]
    Database {
        /// Which key's database.
        key: AccountKey,
        /// The cause.
        error: nix::Error,
    },
    /// The user's supplementary groups could not be listed.
    #[error("cannot list the supplementary groups of {user:?}: {error}")]
    Groups {
        /// The user's name.
        user: String,
        /// The cause.
        error: nix::Error,
    },
}

impl AccountError {
    /// The key the problem is reported at.
    pub(super) fn key(&self) -> AccountKey {
        match self {
            AccountError::Empty(key)
            | AccountError::IdOutOfRange { key, .. }
            | AccountError::Database { key, .. } => *key,
            AccountError::UnknownGroup(_) | AccountError::GroupWithoutUser => AccountKey::Group,
            AccountError::UnknownUser(_)
            | AccountError::UidWithoutGroup(_)
            | AccountError::Groups { .. } => AccountKey::User,
        }
    }
}

/// The account `user` and `group` (as written; either may be left out) name, from the user and
/// group databases: `None` when neither is written (the workers run as the supervisor does).
pub(super) fn resolve(
    user: Option<&str>,
    group: Option<&str>,
) -> Result<Option<Account>, AccountError> {
    let Some(user) = user else {
        return match group {
            Some(_) => Err(AccountError::GroupWithoutUser),
            None => Ok(None),
        };
    };
    let entry = match parse(user, AccountKey::User)? {
        Who::Name(name) => Some(
            User::from_name(name)
                .map_err(|error| database(AccountKey::User, error))?
                .ok_or_else(|| AccountError::UnknownUser(name.to_owned()))?,
        ),
        Who::Id(uid) => {
            User::from_uid(Uid::from_raw(uid)).map_err(|error| database(AccountKey::User, error))?
        }
    };
    let gid = match group
        .map(|group| parse(group, AccountKey::Group))
        .transpose()?
    {
        Some(Who::Name(name)) => Group::from_name(name)
            .map_err(|error| database(AccountKey::Group, error))?
            .ok_or_else(|| AccountError::UnknownGroup(name.to_owned()))?
            .gid
            .as_raw(),
        Some(Who::Id(gid)) => gid,
        None => match &entry {
            Some(entry) => entry.gid.as_raw(),
            None => return Err(AccountError::UidWithoutGroup(uid_of(user))),
        },
    };
    let (uid, groups, login) = match entry {
        Some(entry) => (
            entry.uid.as_raw(),
            supplementary_groups(&entry.name, gid)?,
            Some((entry.name, entry.dir)),
        ),
        None => (uid_of(user), vec![gid], None),
    };
    Ok(Some(Account {
        user: user.to_owned(),
        uid,
        gid,
        groups,
        login,
    }))
}

/// `written` (the value of `key`) as a name or an id.
fn parse(written: &str, key: AccountKey) -> Result<Who<'_>, AccountError> {
    if written.is_empty() {
        return Err(AccountError::Empty(key));
    }
    if !written.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(Who::Name(written));
    }
    // -1 (u32::MAX) is not an id: to setresuid(2) and setresgid(2) it means "leave unchanged".
    match written.parse::<u32>() {
        Ok(n) if n != u32::MAX => Ok(Who::Id(n)),
        _ => Err(AccountError::IdOutOfRange {
            key,
            written: written.to_owned(),
        }),
    }
}

/// The uid `user` writes, once known to be one.
fn uid_of(user: &str) -> u32 {
    user.parse().expect("parsed as a uid before")
}

/// The groups `initgroups(user, gid)` would set: `gid` and every group that lists `user` as a
/// member, each once, in the database's order.
fn supplementary_groups(user: &str, gid: u32) -> Result<Vec<u32>, AccountError> {
    let groups_error = |error| AccountError::Groups {
        user: user.to_owned(),
        error,
    };
    let name = CString::new(user).map_err(|_| groups_error(nix::Error::EINVAL))?;
    let listed = getgrouplist(&name, Gid::from_raw(gid)).map_err(groups_error)?;
    let mut groups: Vec<u32> = Vec::with_capacity(listed.len());
    for group in listed.into_iter().map(Gid::as_raw) {
        if !groups.contains(&group) {
            groups.push(group);
        }
    }
    Ok(groups)
}

fn database(key: AccountKey, error: nix::Error) -> AccountError {
    AccountError::Database { key, error }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The uid and gid of `name` from the database.
    fn entry(name: &str) -> (u32, u32) {
        let user = User::from_name(name)
            .unwrap()
            .unwrap_or_else(|| panic!("no {name} here"));
        (user.uid.as_raw(), user.gid.as_raw())
    }

    /// A uid no entry of the database has.
    fn unlisted_uid() -> u32 {
        (2_000_000_000..)
            .find(|&uid| User::from_uid(Uid::from_raw(uid)).unwrap().is_none())
            .expect("a free uid")
    }

    #[test]
    fn a_user_by_name_gets_its_primary_group_and_its_supplementary_groups() {
        let (uid, gid) = entry("nobody");
        let account = resolve(Some("nobody"), None).unwrap().unwrap();
        assert_eq!((account.user.as_str(), account.uid), ("nobody", uid));
        assert_eq!(account.gid, gid);
        assert!(account.groups.contains(&gid), "{account:?}");
        // root is listed in the root group (gid 0), and getgrouplist names it once.
        let root = resolve(Some("root"), None).unwrap().unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert_eq!(
            root.groups.iter().filter(|&&g| g == 0).count(),
            1,
            "{root:?}"
        );
    }

    #[test]
    fn a_user_by_id_and_a_group_by_name_or_id() {
        let (uid, gid) = entry("nobody");
        let by_id = resolve(Some(&uid.to_string()), None).unwrap().unwrap();
        assert_eq!((by_id.uid, by_id.gid), (uid, gid));
        assert_eq!(by_id.user, uid.to_string());
        let with_root_group = resolve(Some("nobody"), Some("root")).unwrap().unwrap();
        assert_eq!((with_root_group.uid, with_root_group.gid), (uid, 0));
        assert_eq!(with_root_group.groups[0], 0, "{with_root_group:?}");
        let with_gid = resolve(Some("nobody"), Some("4242")).unwrap().unwrap();
        assert_eq!(with_gid.gid, 4242);
        assert!(with_gid.groups.contains(&4242), "{with_gid:?}");
    }

    #[test]
    fn a_uid_without_an_entry_needs_a_group_and_then_has_it_alone() {
        let uid = unlisted_uid();
        assert_eq!(
            resolve(Some(&uid.to_string()), None),
            Err(AccountError::UidWithoutGroup(uid))
        );
        let account = resolve(Some(&uid.to_string()), Some("root"))
            .unwrap()
            .unwrap();
        assert_eq!(
            (account.uid, account.gid, account.groups),
            (uid, 0, vec![0])
        );
    }

    #[test]
    fn unknown_names_empty_keys_and_bad_ids_are_refused_at_their_key() {
        let cases = [
            (Some("no-such-user-here"), None, AccountKey::User),
            (
                Some("nobody"),
                Some("no-such-group-here"),
                AccountKey::Group,
            ),
            (None, Some("root"), AccountKey::Group),
            (Some(""), None, AccountKey::User),
            (Some("nobody"), Some(""), AccountKey::Group),
            (Some("4294967295"), None, AccountKey::User),
            (Some("nobody"), Some("99999999999"), AccountKey::Group),
        ];
        for (user, group, key) in cases {
            let error = resolve(user, group).unwrap_err();
            assert_eq!(error.key(), key, "{user:?} {group:?}: {error}");
        }
        assert_eq!(
            resolve(Some("no-such-user-here"), None)
                .unwrap_err()
                .to_string(),
            "no user \"no-such-user-here\" in the user database"
        );
        assert_eq!(resolve(None, None), Ok(None));
    }

    #[test]
    fn the_supervisors_own_account_needs_no_switch() {
        let root = resolve(Some("root"), None).unwrap().unwrap();
        let unprivileged = Identity {
            uid: 0,
            gid: 0,
            can_switch: false,
        };
        assert!(!root.is_other_than(&unprivileged));
        let nobody = resolve(Some("nobody"), None).unwrap().unwrap();
        assert!(nobody.is_other_than(&unprivileged));
    }

    #[test]
    fn switching_users_takes_cap_setuid_and_cap_setgid_as_proc_shows_them() {
        let effective = peregrine_contract::procfs::StatusText::read_self()
            .unwrap()
            .hex("CapEff")
            .expect("a CapEff line");
        // CAP_SETGID is 6, CAP_SETUID 7.
        let both = 1 << 6 | 1 << 7;
        assert_eq!(can_switch_users(), effective & both == both);
    }

    #[test]
    fn the_worker_socket_extends_the_control_sockets_name() {
        assert_eq!(
            worker_socket(Path::new("/run/peregrine/peregrine.sock"), "web"),
            Path::new("/run/peregrine/peregrine.sock.web.workers")
        );
    }

    fn nobody_with_a_group() -> Account {
        Account {
            user: "nobody".into(),
            uid: 65534,
            gid: 65534,
            groups: vec![65534, 100],
            login: None,
        }
    }

    #[test]
    fn a_directory_is_searched_by_owner_group_or_others_bits_alone() {
        let account = nobody_with_a_group();
        // Owned by the account: the owner's bit alone counts.
        assert!(account.may(0o1, (65534, 0, 0o700)));
        assert!(!account.may(0o1, (65534, 65534, 0o077)));
        // Its primary or a supplementary group: the group's bit.
        assert!(account.may(0o1, (0, 65534, 0o710)));
        assert!(account.may(0o1, (0, 100, 0o750)));
        assert!(!account.may(0o1, (0, 100, 0o701)));
        // Anyone else's: the others' bit.
        assert!(account.may(0o1, (0, 0, 0o711)));
        assert!(!account.may(0o1, (0, 0, 0o770)));
    }

    #[test]
    fn an_owner_only_directory_on_the_way_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join("run");
        std::fs::create_dir(&inner).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let socket = inner.join("control.sock.web.workers");
        // Unless the test runs as that very user, the temporary directory is not its to search.
        if rustix::process::geteuid().as_raw() != nobody_with_a_group().uid {
            assert_eq!(
                nobody_with_a_group().unsearchable_folder(&socket),
                Some((dir.path().to_owned(), 0o700))
            );
        }
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        assert_eq!(nobody_with_a_group().unsearchable_folder(&socket), None);
    }
}
