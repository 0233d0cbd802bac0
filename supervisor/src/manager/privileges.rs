//! What a worker is stripped of before it runs: the supervisor's user (for a service's `user` and
//! `group`) and every capability, whatever the supervisor holds.
//!
//! The steps run in the child between `fork` and `exec` ([`Privileges::apply`]), in the order the
//! kernel needs: supplementary groups and gid while CAP_SETGID is still held; the bounding set emptied
//! while CAP_SETPCAP is; ambient capabilities cleared; the uid last of the switches (leaving uid 0
//! clears the permitted and effective sets); then the inheritable set cleared and `no_new_privs` set,
//! so that no later `execve` (the worker's or its children's: set-user-ID programs, file
//! capabilities) gives any of it back. A bounding set that cannot be emptied (a supervisor without
//! CAP_SETPCAP) is left as it is: without permitted, inheritable or ambient capabilities, and under
//! `no_new_privs`, nothing in it can be gained.
//!
//! Invariant: [`Privileges::apply`] makes system calls only (no allocation, no lock), as code between
//! `fork` and `exec` must; everything it needs (the gid
//! list) is computed before the fork.

use std::io;

use rustix::{
    process::{Gid, Uid},
    thread::{CapabilitySet, CapabilitySets},
};

/// The user and groups a worker switches to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Identity {
    /// The uid (real, effective and saved).
    pub(super) uid: Uid,
    /// The gid (real, effective and saved).
    pub(super) gid: Gid,
    /// The supplementary groups.
    pub(super) groups: Vec<Gid>,
}

impl Identity {
    /// A service's account, as the config resolved it.
    pub(super) fn of(account: &crate::config::Account) -> Self {
        Identity {
            uid: Uid::from_raw(account.uid),
            gid: Gid::from_raw(account.gid),
            groups: account.groups.iter().copied().map(Gid::from_raw).collect(),
        }
    }
}

/// What a worker gives up before `exec`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Privileges {
    /// Another user to run as (a service's `user`), or the supervisor's own.
    pub(super) identity: Option<Identity>,
}

/// The highest capability number the bounding set is emptied up to: past the kernel's last one,
/// `PR_CAPBSET_DROP` fails with `EINVAL` and the loop stops there.
const CAP_MAX: u32 = 63;

impl Privileges {
    /// Drops them, in the child, between `fork` and `exec`.
    ///
    /// Async-signal-safe: raw system calls on memory the child owns (its copy of `self`).
    pub(super) fn apply(&self) -> io::Result<()> {
        if let Some(identity) = &self.identity {
            rustix::thread::set_thread_groups(&identity.groups)?;
            let gid = identity.gid;
            rustix::thread::set_thread_res_gid(gid, gid, gid)?;
        }
        empty_bounding_set()?;
        match rustix::thread::clear_ambient_capability_set() {
            // EINVAL: a kernel without ambient capabilities (before 4.3) has none to clear.
            Ok(()) | Err(rustix::io::Errno::INVAL) => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(identity) = &self.identity {
            let uid = identity.uid;
            rustix::thread::set_thread_res_uid(uid, uid, uid)?;
        }
        rustix::thread::set_capabilities(
            None,
            CapabilitySets {
                effective: CapabilitySet::empty(),
                permitted: CapabilitySet::empty(),
                inheritable: CapabilitySet::empty(),
            },
        )?;
        rustix::thread::set_no_new_privs(true)?;
        Ok(())
    }
}

/// Empties the bounding set, when this process may (CAP_SETPCAP).
fn empty_bounding_set() -> io::Result<()> {
    for cap in 0..=CAP_MAX {
        // SAFETY: prctl(PR_CAPBSET_DROP, cap) takes no pointer; the call is a raw system call.
        let dropped = unsafe {
            libc::prctl(
                libc::PR_CAPBSET_DROP,
                cap as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if dropped == 0 {
            continue;
        }
        return match io::Error::last_os_error().raw_os_error() {
            // Past the kernel's last capability: all are dropped.
            Some(libc::EINVAL) => Ok(()),
            // No CAP_SETPCAP: the set stays (see the module docs), unless a capability was dropped
            // already, which cannot be without CAP_SETPCAP.
            Some(libc::EPERM) if cap == 0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// Runs `/bin/cat /proc/self/status` with `privileges` dropped, and returns its lines.
    fn status_under(privileges: Privileges) -> String {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new("/bin/cat");
        command.arg("/proc/self/status");
        // SAFETY: `apply` is async-signal-safe (raw system calls on the child's own copy of
        // `privileges`), as a pre_exec closure must be.
        unsafe {
            command.pre_exec(move || privileges.apply());
        }
        let output = command.output().expect("cat runs");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    }

    fn field(status: &str, name: &str) -> String {
        peregrine_contract::procfs::StatusText::new(status)
            .field(name)
            .unwrap_or_else(|| panic!("{name} in {status}"))
            .to_owned()
    }

    #[test]
    fn a_worker_holds_no_capability_and_cannot_gain_one() {
        let status = status_under(Privileges::default());
        for set in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
            assert_eq!(field(&status, set), "0000000000000000", "{set}");
        }
        assert_eq!(field(&status, "NoNewPrivs"), "1");
        if rustix::process::geteuid().is_root() {
            assert_eq!(field(&status, "CapBnd"), "0000000000000000");
        }
    }

    #[test]
    fn a_worker_of_another_user_has_its_ids_and_groups_alone() {
        if !rustix::process::geteuid().is_root() {
            peregrine_testenv::skip(
                "a_worker_of_another_user_has_its_ids_and_groups_alone",
                "switching to another user needs root",
            );
            return;
        }
        let status = status_under(Privileges {
            identity: Some(Identity {
                uid: Uid::from_raw(65534),
                gid: Gid::from_raw(65533),
                groups: vec![Gid::from_raw(65533), Gid::from_raw(4242)],
            }),
        });
        assert_eq!(field(&status, "Uid"), "65534\t65534\t65534\t65534");
        assert_eq!(field(&status, "Gid"), "65533\t65533\t65533\t65533");
        assert_eq!(field(&status, "Groups"), "4242 65533");
        assert_eq!(field(&status, "CapEff"), "0000000000000000");
        assert_eq!(field(&status, "CapBnd"), "0000000000000000");
    }
}
