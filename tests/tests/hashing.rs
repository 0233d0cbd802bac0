//! Consistent hashing through the real Envoy: each worker slot is published with a stable `hash_key`
//! (service and index), so a key always reaches the same slot, a restarted worker (new pid, new port)
//! gets back exactly its keys, and growing from 3 to 4 workers moves about a quarter of them; bounded
//! loads spill a hot key, and per-worker weights reach Envoy.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor, envoy_or_skip, free_port, hosts, http_get_with,
    moved, route_keys, try_wait_until, wait_for_slots, worker_pid,
};

const KEYS: usize = 1000;

/// A ring-hash service `web` of `count` workers hashed on `x-entity-id`, with the given ports.
fn config(grpc: u16, listen: u16, admin: u16, count: u32) -> String {
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    config.service("web", ring_hashed("http://127.0.0.1:0", count));
    config.toml()
}

/// A service of `count` workers at `url`, ring-hashed on the header `x-entity-id`.
fn ring_hashed(url: &str, count: u32) -> ServiceTable {
    ServiceTable {
        lb_policy: Some("ring_hash".into()),
        hash_on: Some("header:x-entity-id".into()),
        ..ServiceTable::at(url).count(count)
    }
}

/// Waits until Envoy routes to the supervisor's `count` workers with the ring sized for them (1024
/// points each).
fn wait_for_workers(supervisor: &Supervisor, envoy: &Envoy, count: usize) -> BTreeMap<u32, u64> {
    let ring = format!("\"minimum_ring_size\": \"{}\"", 1024 * count);
    wait_for_slots(supervisor, envoy, "web", count, Some(&ring)).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The slot each key reaches through Envoy.
fn route(listen: SocketAddr, slots: &BTreeMap<u32, u64>) -> Vec<u64> {
    let keys: Vec<String> = (0..KEYS).map(|key| format!("entity-{key}")).collect();
    route_keys(listen, "/", "x-entity-id", &keys, 4, slots).unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn keys_stick_to_their_slot_across_requests_and_a_worker_restart() {
    let Some(_envoy) = envoy_or_skip("hashing: stickiness") else {
        return;
    };
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let supervisor = Supervisor::start(&config(grpc, listen, admin, 3));
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    let slots = wait_for_workers(&supervisor, &envoy, 3);

    let first = route(listen, &slots);
    let again = route(listen, &slots);
    assert_eq!(
        moved(&first, &again),
        0,
        "a key changed slot between requests"
    );
    let per_slot = (0..3)
        .map(|slot| first.iter().filter(|&&s| s == slot).count())
        .collect::<Vec<_>>();
    eprintln!("keys per slot: {per_slot:?}");
    assert!(
        per_slot.iter().all(|&n| n > KEYS / 10),
        "a slot got almost no keys: {per_slot:?}"
    );

    // Kill slot 1's worker: its replacement has a new pid, port and hostname, the same hash key.
    let victim = *slots.iter().find(|(_, slot)| **slot == 1).unwrap().0;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(victim as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let slots = try_wait_until(Duration::from_secs(30), "the replacement", || {
        let slots = wait_for_workers(&supervisor, &envoy, 3);
        (!slots.contains_key(&victim)).then_some(slots)
    })
    .unwrap();
    let after = route(listen, &slots);
    assert_eq!(
        moved(&first, &after),
        0,
        "keys moved for good after a worker restart"
    );
}

#[test]
fn growing_from_three_to_four_workers_moves_about_a_quarter_of_the_keys() {
    let Some(_envoy) = envoy_or_skip("hashing: scale") else {
        return;
    };
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let supervisor = Supervisor::start(&config(grpc, listen, admin, 3));
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let listen_addr = SocketAddr::from(([127, 0, 0, 1], listen));
    let slots = wait_for_workers(&supervisor, &envoy, 3);
    let before = route(listen_addr, &slots);

    // `peregrine reload` with count = 4: the three workers keep running, a fourth joins, and the
    // ring grows by its points.
    supervisor.set_count(4).unwrap();
    supervisor.control("reload", &[]).unwrap();
    let slots = wait_for_workers(&supervisor, &envoy, 4);
    let after = route(listen_addr, &slots);
    let moved = moved(&before, &after);
    let to_new_slot = after.iter().filter(|&&s| s == 3).count();
    eprintln!(
        "3 -> 4 workers: {moved} of {KEYS} keys moved ({:.1}%; the minimum is 25%), {to_new_slot} to the new slot",
        100.0 * moved as f64 / KEYS as f64
    );
    // Consistent hashing moves keys only to the new slot; about 1/4 of them.
    assert_eq!(moved, to_new_slot, "keys moved between the old slots");
    assert!(
        (KEYS / 8..=KEYS * 2 / 5).contains(&moved),
        "{moved} of {KEYS} keys moved"
    );
}

/// `clients` threads sending requests for one hot key to `path` for `duration`; requests per pid.
fn hot_key_load(
    listen: SocketAddr,
    path: &str,
    clients: usize,
    duration: Duration,
) -> BTreeMap<u32, u64> {
    let deadline = std::time::Instant::now() + duration;
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let path = path.to_owned();
            std::thread::spawn(move || {
                let mut counts = BTreeMap::new();
                while std::time::Instant::now() < deadline {
                    let (code, body) = http_get_with(listen, &path, &[("x-entity-id", "hot")])
                        .unwrap_or_else(|e| panic!("{e:#}"));
                    assert_eq!(code, 200, "{body}");
                    *counts.entry(worker_pid(&body).unwrap()).or_insert(0u64) += 1;
                }
                counts
            })
        })
        .collect();
    let mut total = BTreeMap::new();
    for thread in threads {
        for (pid, n) in thread.join().unwrap() {
            *total.entry(pid).or_insert(0) += n;
        }
    }
    total
}

#[test]
fn bounded_loads_spill_a_hot_key_over_to_other_workers() {
    let Some(_envoy) = envoy_or_skip("hashing: bounded loads") else {
        return;
    };
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    for (name, factor) in [("bounded", Some(125)), ("unbounded", None)] {
        let service = ServiceTable {
            hash_balance_factor: factor,
            ..ring_hashed("http://127.0.0.1:0", 3).prefix(format!("/{name}"))
        };
        config.service(name, service);
    }
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    for cluster in ["bounded", "unbounded"] {
        try_wait_until(Duration::from_secs(60), "3 hosts per cluster", || {
            let hosts = hosts(&envoy.admin_get("/clusters").ok()?, cluster);
            (hosts.len() == 3 && hosts.iter().all(|h| h.healthy)).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.logs()));
    }
    // Every request carries the same key and takes a few milliseconds, so 9 clients keep about 9
    // requests active: 3 per worker on average, and the bound is 125% of that.
    let hottest = |counts: &BTreeMap<u32, u64>| {
        *counts.values().max().unwrap() as f64 / counts.values().sum::<u64>() as f64
    };
    let unbounded = hot_key_load(listen, "/unbounded?cpu=5", 9, Duration::from_secs(3));
    let bounded = hot_key_load(listen, "/bounded?cpu=5", 9, Duration::from_secs(3));
    eprintln!(
        "one hot key, 9 clients: the hottest worker served {:.0}% without a bound ({unbounded:?}), \
         {:.0}% with hash_balance_factor = 125 ({bounded:?})",
        hottest(&unbounded) * 100.0,
        hottest(&bounded) * 100.0
    );
    assert!(hottest(&unbounded) > 0.99, "{unbounded:?}");
    // About ceil(3 * 1.25) = 4 of the 9 active requests on the key's worker (Envoy counts active
    // requests as it picks, so a little more gets through): about half the requests, not all.
    assert!(
        hottest(&bounded) < 0.7,
        "the bound did not spill the hot key: {bounded:?}"
    );
    // The excess goes to the next worker along the ring that is under the bound.
    assert!(
        bounded.len() >= 2,
        "the excess reaches other workers: {bounded:?}"
    );
}

#[test]
fn per_worker_weights_reach_envoy_and_split_traffic() {
    let Some(_envoy) = envoy_or_skip("weights") else {
        return;
    };
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
    let service = ServiceTable {
        lb_policy: Some("round_robin".into()),
        weights: Some(vec![1, 3]),
        ..ServiceTable::at("http://127.0.0.1:0").count(2)
    };
    config.service("web", service);
    let supervisor = Supervisor::start(&config.toml());
    let envoy = Envoy::start(&supervisor.envoy_bootstrap().expect("bootstrap"));
    let slots = wait_for_slots(&supervisor, &envoy, "web", 2, None).unwrap();
    let weights: BTreeMap<u64, u64> = hosts(&envoy.clusters(), "web")
        .iter()
        .map(|h| {
            let pid: u32 = h.hostname.rsplit('-').next().unwrap().parse().unwrap();
            (slots[&pid], h.weight)
        })
        .collect();
    assert_eq!(weights, BTreeMap::from([(0, 1), (1, 3)]));
    // Weighted round robin: slot 1 answers three requests in four.
    let keys: Vec<String> = (0..400).map(|k| k.to_string()).collect();
    let routed = route_keys(
        SocketAddr::from(([127, 0, 0, 1], listen)),
        "/",
        "x-ignored",
        &keys,
        1,
        &slots,
    )
    .unwrap();
    let to_heavy = routed.iter().filter(|&&slot| slot == 1).count();
    assert!(
        (270..=330).contains(&to_heavy),
        "slot 1 answered {to_heavy} of 400"
    );
}
