//! What a fleet's etcd prefix may hold, against a supervisor that joins it: many records (more than
//! one etcd message holds), values too large to be records, and records written by hand. Each test
//! writes the records straight into a real etcd, as hosts or an intruder would, and reads the
//! supervisor's view through `peregrine status`.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use peregrine_e2e::{Etcd, EtcdClient, Supervisor, etcd_or_skip, free_port, wait_until};

/// The fleet's key prefix (the default).
const PREFIX: &str = "/peregrine/v1";
/// The service every host runs.
const SERVICE: &str = "web";
/// The lease of the hosts the tests write: longer than any test, so it needs no keep-alive.
const HOST_LEASE: Duration = Duration::from_secs(600);
/// etcd's largest request, raised so that a test can write a 3 MB value.
const MAX_REQUEST_BYTES: &str = "8388608";

/// A supervisor named `name` in the fleet on `etcd`, with one worker of [`SERVICE`], serving gRPC
/// on `grpc`.
fn host(name: &str, etcd: &Etcd, grpc: u16) -> Supervisor {
    let config = format!(
        r#"[supervisor]
bind = "http://127.0.0.1:{grpc}"
control = "{{dir}}/peregrine.sock"
sampler = "off"

[envoy]
listen = "127.0.0.1:{listen}"
admin = "127.0.0.1:{admin}"

[cluster]
etcd = ["{etcd}"]
host = "{name}"
# One machine's loopback: nothing leaves it.
allow_insecure = true
lease_ttl_ms = 2000

[service.{SERVICE}]
count = 1
url = "http://127.0.0.1:0"
"#,
        listen = free_port(),
        admin = free_port(),
        etcd = etcd.endpoint(),
    );
    Supervisor::start(&config)
}

/// A host's record, as a supervisor serving gRPC on `grpc` writes it.
fn host_record(grpc: u16) -> String {
    format!(r#"{{"region":"","zone":"","grpc_port":{grpc}}}"#)
}

/// Worker `index`'s record on `host`, listening on `ip` (one port per index).
fn worker_record(host: &str, index: u32, ip: &str) -> String {
    format!(
        r#"{{"hostname":"{host}-{SERVICE}-{index}-{pid}","protocols":["http1"],"addresses":["{ip}:{port}"],"health":"serving","weight":1,"hash_key":"{host}-{SERVICE}-{index}"}}"#,
        pid = 100_000 + index,
        port = 20_000 + index % 40_000,
    )
}

/// Writes hosts `names`, each under a lease of its own, with `workers` workers of [`SERVICE`] in
/// all (shared out evenly), as their supervisors would (a host's records in transactions under its
/// lease). Returns each host's lease.
fn write_hosts(
    etcd: &EtcdClient,
    names: &[&str],
    workers: u32,
    grpc: u16,
) -> BTreeMap<String, i64> {
    let each = workers / names.len() as u32;
    names
        .iter()
        .enumerate()
        .map(|(n, name)| {
            let lease = etcd.grant(HOST_LEASE).expect("a lease");
            let ip = format!("127.0.0.{}", n + 2);
            let mut kvs = vec![
                (format!("{PREFIX}/hosts/{name}"), host_record(grpc)),
                (
                    format!("{PREFIX}/services/{name}/{SERVICE}"),
                    r#"{"balancer":{"kind":"round_robin"}}"#.to_owned(),
                ),
            ];
            kvs.extend((0..each).map(|index| {
                (
                    format!(
                        "{PREFIX}/workers/{name}/{SERVICE}/{index}/{}",
                        100_000 + index
                    ),
                    worker_record(name, index, &ip),
                )
            }));
            etcd.put_all(&kvs, lease).expect("the host's records");
            ((*name).to_owned(), lease)
        })
        .collect()
}

/// The other hosts' workers in `supervisor`'s view, by host.
fn remote_workers(supervisor: &Supervisor, me: &str) -> BTreeMap<String, usize> {
    let status = supervisor.status_json().expect("status");
    let mut by_host = BTreeMap::new();
    for row in status["workers"].as_array().into_iter().flatten() {
        if let Some(host) = row["host"].as_str().filter(|host| *host != me) {
            *by_host.entry(host.to_owned()).or_default() += 1;
        }
    }
    by_host
}

/// Waits until `supervisor`'s view holds `expected` workers by host. Each look lists every row of
/// `peregrine status` (25,000 of them): it looks at most twice a second.
#[track_caller]
fn wait_for_view(
    supervisor: &Supervisor,
    me: &str,
    expected: &BTreeMap<String, usize>,
    within: Duration,
) {
    let mut last = Instant::now() - Duration::from_secs(1);
    let mut seen = BTreeMap::new();
    let done = peregrine_e2e::try_wait_until(within, "the fleet view", || {
        if last.elapsed() < Duration::from_millis(500) {
            return None;
        }
        last = Instant::now();
        seen = remote_workers(supervisor, me);
        (seen == *expected).then_some(())
    });
    if let Err(error) = done {
        panic!(
            "{error}: {seen:?} instead of {expected:?}\n{}",
            tail(&supervisor.logs(), 4000)
        );
    }
}

/// The resident memory of process `pid`, in KiB (`VmRSS`).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// The last `n` bytes of `text` (at a character boundary).
fn tail(text: &str, n: usize) -> &str {
    let mut start = text.len().saturating_sub(n);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// A supervisor joins a fleet whose range is far over one etcd message (25,000 worker records, and
/// a 3 MB value written by hand under a real host): it lists the range in pages, skips the value
/// with its reason, and serves every worker. Before, its first listing was refused by the client's
/// 4 MiB limit at every try, and it never joined.
#[test]
fn a_host_joins_a_fleet_of_25000_workers_and_a_3_mb_value() {
    let test = "a_host_joins_a_fleet_of_25000_workers_and_a_3_mb_value";
    if !etcd_or_skip(test) {
        return;
    }
    let etcd = Etcd::start_with_args(&["--max-request-bytes", MAX_REQUEST_BYTES]).expect("etcd");
    let client = EtcdClient::connect(&etcd.endpoint()).expect("an etcd client");
    let grpc = free_port();
    let written = Instant::now();
    write_hosts(&client, &["h1", "h2"], 25_000, grpc);
    let garbage = format!("{PREFIX}/workers/h1/{SERVICE}/99999/1");
    client
        .put(&garbage, vec![b'x'; 3_000_000], 0)
        .expect("the 3 MB value");
    eprintln!(
        "wrote 25,000 worker records and a 3 MB value in {:.2?}",
        written.elapsed()
    );

    let started = Instant::now();
    let a = host("a", &etcd, grpc);
    wait_until(Duration::from_secs(30), "a to join the fleet", || {
        a.logs().contains("Joined the fleet").then_some(())
    });
    let joined = started.elapsed();
    let at = rss_kib(a.pid());
    let expected = BTreeMap::from([("h1".to_owned(), 12_500), ("h2".to_owned(), 12_500)]);
    wait_for_view(&a, "a", &expected, Duration::from_secs(10));
    let status = a.status_json().expect("status");
    assert_eq!(status["fleet"]["etcd"], "connected", "{}", status["fleet"]);
    let logs = a.logs();
    let skipped: Vec<&str> = logs.lines().filter(|l| l.contains(&garbage)).collect();
    assert_eq!(
        skipped.len(),
        1,
        "the 3 MB value is skipped once: {skipped:#?}"
    );
    assert!(
        skipped[0].contains("3000000 bytes, over the 65536-byte limit of a record"),
        "{}",
        skipped[0]
    );
    eprintln!(
        "a joined a fleet of 25,000 workers and a 3 MB value {joined:.2?} after it was started; \
         RSS {at} KiB once joined"
    );
}
