//! Host loss: a host's supervisor and workers SIGKILLed at once (a machine that loses power), until
//! every other host's Envoy has dropped its workers; then the host is started again and every Envoy,
//! its own included, must hold the whole fleet before the next loss.
//!
//! Nothing tells the other hosts but etcd: the dead supervisor stops renewing its lease (every third
//! of the TTL), etcd expires it (its expiry loop runs every 500 ms) and deletes the host's keys in
//! one revision, and each watcher drops them. So a loss takes between TTL minus a renewal period and
//! the TTL, plus etcd's check and the propagation; the goal is the TTL + 500 ms. The default TTL
//! (3 s) is used.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use anyhow::Context;
use peregrine_e2e::Host;
use xtask::{
    interrupt,
    logs::{self, VIEW_CHANGED},
};

use super::{
    Options,
    host::{FleetHost, owned_by},
    poll::{self, Seen},
    propagation::{ms, wait_for_fleet, whole_fleet},
};

/// The default lease TTL (`lease_ttl_ms`), which the hosts run with.
pub(super) const TTL: Duration = Duration::from_secs(3);
/// The goal: within the TTL and this.
pub(super) const MARGIN: Duration = Duration::from_millis(500);
/// How long a host may take to leave, and to come back.
const DEADLINE: Duration = Duration::from_secs(30);

/// One loss.
#[derive(Clone, Debug)]
pub(super) struct Loss {
    pub(super) host: usize,
    pub(super) killed: SystemTime,
    /// Per surviving host: when its Envoy listed none of the dead host's workers.
    pub(super) gone: Vec<Seen>,
    /// Per surviving host: when its registry's view lost the dead host (`Fleet view changed`).
    pub(super) registries: Vec<SystemTime>,
    /// From the start of the new `peregrine run` until every Envoy held the whole fleet again, in
    /// ms.
    pub(super) rejoined_ms: f64,
}

impl Loss {
    /// SIGKILL -> every other Envoy without the host's workers, in ms.
    pub(super) fn everywhere(&self) -> f64 {
        ms(
            self.killed,
            self.gone.iter().map(|s| s.at).max().expect("survivors"),
        )
    }

    /// SIGKILL -> every other registry without the host, in ms.
    pub(super) fn registries_ms(&self) -> f64 {
        ms(
            self.killed,
            self.registries.iter().copied().max().expect("survivors"),
        )
    }
}

/// `options.losses` losses on `fleet` (every host with an Envoy), the hosts taken in turn.
pub(super) fn run(fleet: &mut [FleetHost], options: &Options) -> anyhow::Result<Vec<Loss>> {
    let (admins, total, mut current) = whole_fleet(fleet, options)?;
    let mut losses = Vec::with_capacity(options.losses);
    for round in 0..options.losses {
        let host = round % fleet.len();
        let loss = lose(fleet, &admins, host, total, &mut current, options)
            .with_context(|| format!("loss {round} (host {})", fleet[host].name))?;
        eprintln!(
            "loss {round:>2} of {}: every other Envoy without it after {:.0} ms (registries {:.0} ms); back in every Envoy {:.0} ms after its restart",
            fleet[host].name,
            loss.everywhere(),
            loss.registries_ms(),
            loss.rejoined_ms
        );
        losses.push(loss);
    }
    Ok(losses)
}

fn lose(
    fleet: &mut [FleetHost],
    admins: &[SocketAddr],
    host: usize,
    total: usize,
    current: &mut BTreeSet<String>,
    options: &Options,
) -> anyhow::Result<Loss> {
    let survivors: Vec<usize> = (0..fleet.len()).filter(|&j| j != host).collect();
    let survivor_admins: Vec<SocketAddr> = survivors.iter().map(|&j| admins[j]).collect();
    let ip = fleet[host].ip;
    let gone = |hosts: &[Host]| !hosts.iter().any(|h| owned_by(ip, &h.address));
    let killed = SystemTime::now();
    fleet[host].kill();
    let victim = &fleet[host];
    let watched = poll::watch(&survivor_admins, options.poll, DEADLINE, &[&gone])?;
    let others = fleet.len() - 1;
    let mut registries = Vec::new();
    for &j in &survivors {
        let at = interrupt::wait_until(
            Duration::from_secs(2),
            Duration::from_millis(10),
            &format!("host {}'s view to lose host {}", fleet[j].name, victim.name),
            || {
                let logs = fleet[j].logs();
                Ok(logs::first_after(&logs, VIEW_CHANGED, killed, |l| {
                    l.number("hosts").is_some_and(|n| n + 1 == others as u64)
                })
                .map(|l| l.at))
            },
        )?;
        registries.push(at);
    }

    // Its Envoy, cut off from its supervisor, still lists the dead workers until it reconnects.
    let dead: BTreeSet<String> = watched[0].last.iter().map(|h| h.hostname.clone()).fold(
        current.clone(),
        |mut dead, alive| {
            dead.remove(&alive);
            dead
        },
    );
    let restarted = SystemTime::now();
    fleet[host].start_again()?;
    *current = wait_for_fleet(admins, total, &dead, DEADLINE)?;
    Ok(Loss {
        host,
        killed,
        gone: watched.iter().map(|w| w.seen[0]).collect(),
        registries,
        rejoined_ms: ms(restarted, SystemTime::now()),
    })
}
