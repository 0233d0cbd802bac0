//! Room in locked memory for the workers' io_uring rings.
//!
//! A worker without capabilities is charged its ring in its user's locked memory, checked against
//! the creating process's `RLIMIT_MEMLOCK` and summed over every process of the uid
//! ([`peregrine_contract::rings`]). At the common default of 8 MiB, about 290 workers of one user
//! fit (about 40 with the rings of before); the next cannot start its runtime. So the supervisor gives each worker it starts a limit
//! that fits every worker of its user: the workers of every service that runs as that uid and binds
//! its own listener (`count` plus `restart_batch`, for the successors of a rolling restart), on top
//! of the supervisor's own limit, which stands for what else the user locks. It raises the hard
//! limit only if it holds `CAP_SYS_RESOURCE` (root, or the packaged unit); otherwise it gives what
//! its hard limit allows, and warns at start and at each reload when that is too little.
//!
//! A server on a passed listener (`pass_socket`) is not the worker library and has no ring to fit:
//! it keeps the limit it inherits, or gets the kernel's default ([`DEFAULT`]) where the supervisor's
//! own is unlimited. The limit is an allowance for the rings the worker library sets up, bounded by
//! the config; no worker and no app inherits an unlimited one.
//!
//! Invariant: a worker is given the supervisor's own soft limit plus what its user's workers' rings
//! need, or as much of it as the supervisor's hard limit allows; never less than the supervisor's
//! own (but for an unlimited one), and never unlimited.

use std::collections::BTreeMap;

use peregrine_contract::rings;

use crate::config::{ServiceConfig, Warning};

/// A resource limit's soft and hard values (`None`: unlimited).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Limit {
    pub(super) soft: Option<u64>,
    pub(super) hard: Option<u64>,
}

impl Limit {
    /// This process's `RLIMIT_MEMLOCK`.
    pub(super) fn own() -> Self {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock);
        Limit {
            soft: limit.current,
            hard: limit.maximum,
        }
    }
}

impl Limit {
    /// As `setrlimit(2)` takes it.
    pub(super) fn rlimit(self) -> rustix::process::Rlimit {
        rustix::process::Rlimit {
            current: self.soft,
            maximum: self.hard,
        }
    }
}

/// Sets `limit` (if any) as `RLIMIT_MEMLOCK`, in a child between `fork` and `exec`: one system call,
/// async-signal-safe. A refusal leaves the inherited limit: a worker short of locked memory then
/// says what ran out and what to change.
pub(super) fn set_in_child(limit: Option<&rustix::process::Rlimit>) {
    if let Some(limit) = limit {
        let _ = rustix::process::setrlimit(rustix::process::Resource::Memlock, *limit);
    }
}

/// Whether this process may raise a hard limit (`CAP_SYS_RESOURCE` in its effective set).
pub(super) fn may_raise() -> bool {
    rustix::thread::capabilities(None).is_ok_and(|sets| {
        sets.effective
            .contains(rustix::thread::CapabilitySet::SYS_RESOURCE)
    })
}

/// Each uid's workers' rings, in bytes: the services that are not `pass_socket`, by the uid they
/// run as (`own_uid` for those without a `user`).
pub(super) fn needs<'a>(
    services: impl IntoIterator<Item = &'a ServiceConfig>,
    own_uid: u32,
    page: usize,
) -> BTreeMap<u32, u64> {
    let mut needs = BTreeMap::new();
    for service in services.into_iter().filter(|s| !s.pass_socket) {
        let uid = service.account.as_ref().map_or(own_uid, |a| a.uid);
        let workers = u64::from(service.count) + u64::from(service.restart_batch);
        *needs.entry(uid).or_insert(0) += workers * rings::locked_bytes(page) as u64;
    }
    needs
}

/// The kernel's default `RLIMIT_MEMLOCK` (8 MiB since Linux 5.16): what a process that locks no
/// memory of its own needs at most, and what a worker or an app gets under a supervisor whose own
/// limit is unlimited (the packaged unit's `LimitMEMLOCK=infinity`, for BPF maps on old kernels),
/// rather than inheriting that.
pub(super) const DEFAULT: u64 = 8 << 20;

/// What a worker whose user's workers need `need` bytes is given, when the supervisor's own limit is
/// `own`: `None` to leave it what it inherits (enough already), else the limit to set. Its soft
/// value is `own`'s soft ([`DEFAULT`] if unlimited) plus the need; its hard value is at least that
/// (exactly that under an unlimited `own`), unless the supervisor may not raise a hard limit
/// (`may_raise`), where both stop at `own`'s hard.
pub(super) fn for_worker(own: Limit, need: u64, may_raise: bool) -> Option<Limit> {
    let want = own.soft.unwrap_or(DEFAULT).saturating_add(need);
    let soft = match own.hard {
        Some(hard) if !may_raise => want.min(hard),
        _ => want,
    };
    let hard = match own.hard {
        Some(hard) => hard.max(soft),
        None => soft,
    };
    let given = Limit {
        soft: Some(soft),
        hard: Some(hard),
    };
    (given != own).then_some(given)
}

/// What a server on a passed listener is given: [`DEFAULT`] if the supervisor's own limit is
/// unlimited, else what it inherits (`None`).
pub(super) fn for_app(own: Limit) -> Option<Limit> {
    own.soft.is_none().then_some(Limit {
        soft: Some(DEFAULT),
        hard: Some(DEFAULT.min(own.hard.unwrap_or(u64::MAX))),
    })
}

/// The limit each uid's workers are given, and a warning for every uid whose workers do not fit in
/// it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// The limit to set, by uid (absent: leave the inherited one).
    pub(super) limits: BTreeMap<u32, Limit>,
    /// The uids whose workers' rings alone need more than the limit they are given: the bytes
    /// needed and the bytes given.
    pub(super) short: BTreeMap<u32, (u64, u64)>,
}

/// The plan for `services` under the supervisor's `own` limit.
pub(super) fn plan<'a>(
    services: impl IntoIterator<Item = &'a ServiceConfig>,
    own_uid: u32,
    own: Limit,
    may_raise: bool,
    page: usize,
) -> Plan {
    let mut plan = Plan::default();
    for (uid, need) in needs(services, own_uid, page) {
        let given = for_worker(own, need, may_raise);
        if let Some(limit) = given {
            plan.limits.insert(uid, limit);
        }
        // Short only if the rings alone cannot fit, even should the user lock nothing else.
        if let Some(soft) = given.map_or(own.soft, |l| l.soft)
            && soft < need
        {
            plan.short.insert(uid, (need, soft));
        }
    }
    plan
}

/// A warning for each uid whose workers may not all start for want of locked memory.
pub(super) fn shortfalls(
    plan: &Plan,
    services: &BTreeMap<String, ServiceConfig>,
    own_uid: u32,
) -> Vec<Warning> {
    plan.short
        .iter()
        .map(|(uid, (need, given))| {
            let names: Vec<&str> = services
                .values()
                .filter(|s| !s.pass_socket && s.account.as_ref().map_or(own_uid, |a| a.uid) == *uid)
                .map(|s| s.name.as_str())
                .collect();
            Warning::about_the_host(format!(
                "The workers of uid {uid} ({}) may not all start: their io_uring rings need {} KiB \
                 of locked memory, and RLIMIT_MEMLOCK allows {} KiB, which this supervisor cannot \
                 raise (no CAP_SYS_RESOURCE). Raise LimitMEMLOCK= in the unit (or `ulimit -l`), \
                 lower `count`, or give the services users of their own",
                names.join(", "),
                need / 1024,
                given / 1024
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn limit(soft: u64, hard: u64) -> Limit {
        Limit {
            soft: Some(soft),
            hard: Some(hard),
        }
    }

    #[test]
    fn a_supervisor_that_may_raise_gives_its_own_limit_plus_the_rings() {
        assert_eq!(
            for_worker(limit(8 * MIB, 8 * MIB), 15 * MIB, true),
            Some(limit(23 * MIB, 23 * MIB))
        );
        // A higher hard limit stays.
        assert_eq!(
            for_worker(limit(8 * MIB, 64 * MIB), 15 * MIB, true),
            Some(limit(23 * MIB, 64 * MIB))
        );
    }

    #[test]
    fn a_supervisor_that_may_not_raise_stops_at_its_hard_limit() {
        assert_eq!(
            for_worker(limit(8 * MIB, 8 * MIB), 15 * MIB, false),
            None,
            "nothing to raise"
        );
        assert_eq!(
            for_worker(limit(8 * MIB, 16 * MIB), 15 * MIB, false),
            Some(limit(16 * MIB, 16 * MIB))
        );
    }

    #[test]
    fn a_plan_counts_each_users_workers_and_the_successors_of_a_restart() {
        let config = crate::config::Config::parse(
            "[service.a]\nurl = \"http://127.0.0.1:0\"\ncount = 295\n\
             [service.b]\nurl = \"http://127.0.0.1:0\"\ncount = 2\nrestart_batch = 2\n\
             [service.app]\nurl = \"http://127.0.0.1:0\"\ncount = 100\npass_socket = true\n\
             command = [\"/bin/cat\", \"{fd}\"]\n",
            std::path::Path::new("/tmp"),
            &std::collections::HashMap::new(),
        )
        .unwrap();
        let ring = rings::locked_bytes(4096) as u64;
        // 296 + 4 workers of uid 0; the passed-socket app has no ring.
        let needs = needs(config.services.values(), 0, 4096);
        assert_eq!(needs, BTreeMap::from([(0, 300 * ring)]));
        let plan = plan(
            config.services.values(),
            0,
            limit(8 * MIB, 8 * MIB),
            true,
            4096,
        );
        assert!(plan.short.is_empty(), "{plan:?}");
        assert_eq!(plan.limits[&0].soft, Some(8 * MIB + 300 * ring));
        // Without CAP_SYS_RESOURCE the rings of 300 workers do not fit in 8 MiB.
        let plan = plan_without_raise(&config);
        assert!(plan.limits.is_empty());
        assert_eq!(plan.short[&0], (300 * ring, 8 * MIB));
    }

    fn plan_without_raise(config: &crate::config::Config) -> Plan {
        plan(
            config.services.values(),
            0,
            limit(8 * MIB, 8 * MIB),
            false,
            4096,
        )
    }

    #[test]
    fn an_unlimited_supervisor_gives_its_workers_and_apps_a_bounded_limit() {
        let unlimited = Limit {
            soft: None,
            hard: None,
        };
        assert_eq!(
            for_worker(unlimited, 15 * MIB, false),
            Some(limit(23 * MIB, 23 * MIB))
        );
        assert_eq!(for_app(unlimited), Some(limit(8 * MIB, 8 * MIB)));
        assert_eq!(for_app(limit(8 * MIB, 8 * MIB)), None, "inherited");
        let soft_only = Limit {
            soft: Some(8 * MIB),
            hard: None,
        };
        assert_eq!(
            for_worker(soft_only, 15 * MIB, false),
            Some(limit(23 * MIB, 23 * MIB))
        );
    }
}
