//! `cargo xtask bench hashing`: how many keys consistent hashing moves through the real Envoy.
//!
//! For each variant (ring hash and Maglev, each without and with bounded loads) one supervisor runs a
//! hashing service of 3 workers behind one Envoy, and `--keys` keys (10,000) are routed through Envoy
//! with the key in a header, 8 requests in flight. Then, each time routing all keys again:
//!
//! 0. **routed again**: the same keys once more, nothing changed (with bounded loads some requests
//!    find their worker over the bound and go to the next one: the noise floor of the other steps);
//! 1. **restart**: one worker is SIGKILLed and replaced (new pid, new port, same slot);
//! 2. **3 -> 4**: `peregrine reload` with `count = 4`: the three workers keep running and a fourth
//!    joins (the ring grows by its points);
//! 3. **4 -> 3**: and a reload back to 3, which drains the fourth.
//!
//! A key "moved" when it reaches another slot than before the step. The minimum a step can move is the
//! new worker's share (1/4 going up) or the removed one's (1/4 of the keys going down); the spread is
//! the most keys any worker has over the mean.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::Path,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use peregrine_e2e::{
    Envoy, PeregrineToml, ServiceTable, Supervisor, TempDir, free_port, moved, route_keys,
    wait_for_slots,
};
use rustix::process::{Pid, Signal, kill_process};
use xtask::envoy;

use super::{machine::today, table::markdown};

const USAGE: &str = "cargo xtask bench hashing [--keys N]";

/// Requests in flight while routing keys.
const CLIENTS: usize = 8;

#[derive(Clone, Copy, Debug)]
struct Variant {
    policy: &'static str,
    bound: Option<u32>,
}

impl Variant {
    const ALL: [Variant; 4] = [
        Variant {
            policy: "ring_hash",
            bound: None,
        },
        Variant {
            policy: "ring_hash",
            bound: Some(150),
        },
        Variant {
            policy: "maglev",
            bound: None,
        },
        Variant {
            policy: "maglev",
            bound: Some(150),
        },
    ];

    fn name(self) -> String {
        match self.bound {
            None => self.policy.to_owned(),
            Some(factor) => format!("{}, hash_balance_factor {factor}", self.policy),
        }
    }

    /// The config of `count` workers of service `web` under this variant; its control socket is
    /// `{dir}/peregrine.sock`.
    fn config(self, grpc: u16, listen: u16, admin: u16, count: u32) -> String {
        let mut config = PeregrineToml::local(grpc).with_envoy(listen, admin);
        config.service(
            "web",
            ServiceTable {
                lb_policy: Some(self.policy.to_owned()),
                hash_on: Some("header:x-entity-id".into()),
                hash_balance_factor: self.bound,
                ..ServiceTable::at("http://127.0.0.1:0").count(count)
            },
        );
        config.toml()
    }

    /// A fragment of Envoy's active cluster config that shows the cluster is set up for `count`
    /// workers (the ring's size follows the worker count; Maglev's table does not).
    fn settled(self, count: usize) -> Option<String> {
        (self.policy == "ring_hash").then(|| format!("\"minimum_ring_size\": \"{}\"", 1024 * count))
    }
}

/// What one variant moved.
#[derive(Debug)]
struct Figures {
    /// Keys answered by another slot when the same keys are routed again with nothing changed: with
    /// bounded loads, requests that found their worker over the bound.
    again: usize,
    restart: usize,
    up: usize,
    down: usize,
    /// Keys of the most loaded worker over the mean, at 3 and at 4 workers.
    spread3: f64,
    spread4: f64,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let keys = match args {
        [] => 10_000,
        [flag, n] if flag == "--keys" => n.parse().context("--keys N: a whole number")?,
        _ => bail!("usage: {USAGE}"),
    };
    let envoy_binary = envoy::install()?;
    let peregrine = super::release_peregrine()?;
    let keys: Vec<String> = (0..keys).map(|k| format!("entity-{k}")).collect();
    let started = Instant::now();
    let mut rows = Vec::new();
    for variant in Variant::ALL {
        let figures = measure(variant, &peregrine, &envoy_binary, &keys)
            .with_context(|| format!("measuring {}", variant.name()))?;
        eprintln!("{}: {figures:?}", variant.name());
        rows.push((variant, figures));
    }

    let n = keys.len();
    let pct = |moved: usize| format!("{moved} ({:.1}%)", 100.0 * moved as f64 / n as f64);
    let mut table = vec![[
        "variant".to_string(),
        "routed again / restart".into(),
        "3 -> 4 (min 25%)".into(),
        "4 -> 3 (min 25%)".into(),
        "spread 3 / 4 workers".into(),
    ]];
    for (variant, f) in &rows {
        table.push([
            variant.name(),
            format!("{} / {}", pct(f.again), pct(f.restart)),
            format!("{} = {:.2}x min", pct(f.up), f.up as f64 / (n as f64 / 4.0)),
            format!(
                "{} = {:.2}x min",
                pct(f.down),
                f.down as f64 / (n as f64 / 4.0)
            ),
            format!("{:.2} / {:.2}", f.spread3, f.spread4),
        ]);
    }
    let mut report = String::new();
    writeln!(
        report,
        "Command: `{}` ({} keys, {CLIENTS} in flight, {:.0?} in all)",
        super::command_line("hashing", args),
        n,
        started.elapsed()
    )?;
    writeln!(report, "Date: {}", today()?)?;
    writeln!(report)?;
    report.push_str(&markdown(&table, 2));
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

fn measure(
    variant: Variant,
    peregrine: &Path,
    envoy_binary: &Path,
    keys: &[String],
) -> anyhow::Result<Figures> {
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let listen_addr = SocketAddr::from(([127, 0, 0, 1], listen));
    let envoy_dir = TempDir::new()?;
    let start = |count: u32| -> anyhow::Result<(TempDir, Supervisor)> {
        let dir = TempDir::new()?;
        let supervisor = Supervisor::start_in(
            peregrine,
            dir.path(),
            &variant
                .config(grpc, listen, admin, count)
                .replace("{dir}", &dir.path().display().to_string()),
        )?;
        Ok((dir, supervisor))
    };
    let (_dir3, three) = start(3)?;
    let envoy = Envoy::start_in(envoy_binary, envoy_dir.path(), &three.envoy_bootstrap()?)?;
    let settle = |supervisor: &Supervisor, count: usize| {
        wait_for_slots(
            supervisor,
            &envoy,
            "web",
            count,
            variant.settled(count).as_deref(),
        )
    };
    let route = |slots| route_keys(listen_addr, "/", "x-entity-id", keys, CLIENTS, slots);

    let slots = settle(&three, 3)?;
    let at3 = route(&slots)?;
    let again = route(&slots)?;

    // A worker restart.
    let victim = *slots
        .iter()
        .find(|(_, slot)| **slot == 1)
        .context("no worker in slot 1")?
        .0;
    kill_process(
        Pid::from_raw(victim as i32).context("bad pid")?,
        Signal::KILL,
    )?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let slots = loop {
        let slots = settle(&three, 3)?;
        if !slots.contains_key(&victim) {
            break slots;
        }
        if Instant::now() > deadline {
            bail!("worker {victim} was not replaced");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let restarted = route(&slots)?;

    // 3 -> 4 -> 3 by `peregrine reload`: the running workers stay, one joins, then it is drained.
    three.set_count(4)?;
    three.control("reload", &[])?;
    let slots4 = settle(&three, 4)?;
    let at4 = route(&slots4)?;
    three.set_count(3)?;
    three.control("reload", &[])?;
    let slots = settle(&three, 3)?;
    let back = route(&slots)?;
    drop(envoy);

    let spread = |routed: &[u64], workers: u64| {
        let most = (0..workers)
            .map(|slot| routed.iter().filter(|&&s| s == slot).count())
            .max()
            .unwrap_or(0);
        most as f64 / (routed.len() as f64 / workers as f64)
    };
    Ok(Figures {
        again: moved(&at3, &again),
        restart: moved(&at3, &restarted),
        up: moved(&at3, &at4),
        down: moved(&at4, &back),
        spread3: spread(&at3, 3),
        spread4: spread(&at4, 4),
    })
}
