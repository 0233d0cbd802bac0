//! examples/fleet-tls/README.md followed from top to bottom, with the page's own words: its `tls
//! init` command, its etcd settings (three members, TLS to clients and between members), its health
//! check, the three example configs, and Envoy bootstrapped from each. Each host is a network
//! namespace of its own; the page's addresses (10.0.0.1-3) become the namespaces' and its paths
//! (`/etc/peregrine/`, `/run/peregrine/`, etcd's data) folders of the test's. Then one host dies
//! whole (its supervisor, its workers and its etcd member), and the others go on serving.
//!
//! Needs root (namespaces), etcd and Envoy: skips saying why when one is missing, and fails instead
//! under `PEREGRINE_REQUIRE_ETCD=1` (`cargo xtask test`).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    process::Command,
    time::Duration,
};

use peregrine_e2e::{
    ChildGuard, Envoy, NetHost, Network, Supervisor, envoy_or_skip, etcd_or_skip, etcd_path, hosts,
    http_get, netns_or_skip, peregrine_path, try_wait_until, worker_pid, workspace_root,
};

/// The hosts, as the page names them.
const HOSTS: [&str; 3] = ["a", "b", "c"];
/// The service of the example configs.
const SERVICE: &str = "web";
/// Each example config's workers.
const WORKERS: usize = 4;
/// How long a step may take: etcd's election, a supervisor's start, Envoy's first fetch.
const STEP: Duration = Duration::from_secs(60);
/// Envoy's listener and admin address on its host, as the bootstrap of the example configs has
/// them (the defaults of `[envoy]`).
const ENVOY_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10000);

/// The page.
fn page() -> String {
    std::fs::read_to_string(workspace_root().join("examples/fleet-tls/README.md"))
        .expect("examples/fleet-tls/README.md")
}

/// The ```sh blocks of `page`.
fn shell_blocks(page: &str) -> Vec<&str> {
    page.split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .collect()
}

/// The one line of `page`'s shell blocks that holds `needle`.
fn command_line<'a>(page: &'a str, needle: &str) -> &'a str {
    let mut lines = shell_blocks(page)
        .into_iter()
        .flat_map(str::lines)
        .filter(|line| line.contains(needle));
    let line = lines
        .next()
        .unwrap_or_else(|| panic!("no command with {needle:?} in the page"));
    assert!(lines.next().is_none(), "two commands with {needle:?}");
    line
}

/// A host of the journey: its namespace and its folder, which stands for its file system.
struct JourneyHost {
    name: &'static str,
    net: NetHost,
    dir: PathBuf,
}

impl JourneyHost {
    /// `text` as on this host of the test: the page's addresses the namespaces', its paths this
    /// host's folder's.
    fn localize(&self, text: &str, network: &Network) -> String {
        let mut text = text
            .replace("/etc/peregrine/", &format!("{}/", self.dir.display()))
            .replace("/run/peregrine/", &format!("{}/run/", self.dir.display()))
            .replace(
                "/var/lib/etcd/default",
                &self.dir.join("etcd-data").display().to_string(),
            );
        for (index, name) in HOSTS.iter().enumerate() {
            let address = network.host(name).address().to_string();
            text = text.replace(&format!("10.0.0.{}", index + 1), &address);
        }
        text
    }

    /// A command run on this host (`ip netns exec`).
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let wrapper = self.net.wrapper();
        let mut command = Command::new(wrapper[0]);
        command.args(&wrapper[1..]).arg(program);
        command
    }
}

/// The page's etcd settings for member `index` (`ETCD_NAME` and the four URLs its own, as the page
/// says for b and c), as `NAME=VALUE` pairs.
fn etcd_settings(page: &str, index: usize) -> Vec<(String, String)> {
    let block = shell_blocks(page)
        .into_iter()
        .find(|block| block.contains("ETCD_NAME="))
        .expect("the page's /etc/default/etcd block");
    let own_urls = [
        "ETCD_LISTEN_CLIENT_URLS",
        "ETCD_ADVERTISE_CLIENT_URLS",
        "ETCD_LISTEN_PEER_URLS",
        "ETCD_INITIAL_ADVERTISE_PEER_URLS",
    ];
    block
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| {
            let value = value.trim_matches('"');
            let value = if name == "ETCD_NAME" {
                HOSTS[index].to_owned()
            } else if own_urls.contains(&name) {
                value.replace("10.0.0.1", &format!("10.0.0.{}", index + 1))
            } else {
                value.to_owned()
            };
            (name.to_owned(), value)
        })
        .collect()
}

#[test]
fn the_fleet_page_followed_with_its_own_commands_serves_and_survives_a_host() {
    let test = "the_fleet_page_followed_with_its_own_commands_serves_and_survives_a_host";
    if !(netns_or_skip(test) && etcd_or_skip(test)) {
        return;
    }
    let Some(envoy_binary) = envoy_or_skip(test) else {
        return;
    };
    let page = page();
    let network = Network::create(&HOSTS).expect("the network");
    let root = tempfile::tempdir().expect("a folder");
    let machines: Vec<JourneyHost> = HOSTS
        .iter()
        .map(|name| {
            let dir = root.path().join(name);
            std::fs::create_dir_all(dir.join("run")).expect("the host's folder");
            JourneyHost {
                name,
                net: network.host(name).clone(),
                dir,
            }
        })
        .collect();

    // 1. The certificates, by the page's command (its addresses the namespaces').
    let init = machines[0].localize(command_line(&page, "peregrine tls init"), &network);
    let words: Vec<&str> = init.split_whitespace().collect();
    assert_eq!(&words[..3], ["peregrine", "tls", "init"], "{init}");
    let made = Command::new(peregrine_path())
        .args(&words[1..])
        .current_dir(root.path())
        .output()
        .expect("peregrine tls init");
    assert!(
        made.status.success(),
        "{init}: {}",
        String::from_utf8_lossy(&made.stderr)
    );

    // 2. The files on every host: every certificate and key but the CAs' keys, and its config.
    for (index, host) in machines.iter().enumerate() {
        let tls = host.dir.join("tls");
        std::fs::create_dir_all(&tls).unwrap();
        for entry in std::fs::read_dir(root.path().join("tls")).unwrap() {
            let from = entry.unwrap().path();
            let name = from.file_name().unwrap().to_string_lossy().into_owned();
            if name != "ca.key" && name != "etcd-ca.key" {
                std::fs::copy(&from, tls.join(&name)).unwrap();
            }
        }
        assert!(
            tls.join("etcd-peer.pem").is_file(),
            "tls init made the peer certificate"
        );
        let example =
            workspace_root().join(format!("examples/fleet-tls/host-{}.toml", HOSTS[index]));
        let config = host.localize(&std::fs::read_to_string(example).unwrap(), &network);
        std::fs::write(host.dir.join("peregrine.toml"), config).unwrap();
    }

    // 3. etcd, with the page's settings, one member per host.
    let etcd = etcd_path().expect("etcd");
    let mut members: Vec<ChildGuard> = machines
        .iter()
        .enumerate()
        .map(|(index, host)| {
            let mut command = host.command(&etcd);
            for (name, value) in etcd_settings(&page, index) {
                command.env(name, host.localize(&value, &network));
            }
            ChildGuard::spawn(&format!("etcd-{}", host.name), &mut command, &host.dir)
                .expect("etcd starts")
        })
        .collect();
    // The page's health check, on host a.
    let health = machines[0].localize(command_line(&page, "/health"), &network);
    let words: Vec<String> = health
        .trim_start_matches("sudo ")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(words[0], "curl", "{health}");
    let healthy = try_wait_until(STEP, "etcd healthy over TLS, by the page's check", || {
        let out = machines[0]
            // Bounded: a member that takes the connection and never answers would hold curl.
            .command("timeout")
            .arg("5")
            .args(&words)
            .output()
            .ok()?;
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        said.contains("\"health\":\"true\"").then_some(said)
    });
    healthy.unwrap_or_else(|error| {
        panic!(
            "{error}\n{}",
            machines
                .iter()
                .map(
                    |h| std::fs::read_to_string(h.dir.join(format!("etcd-{}.stderr.log", h.name)))
                        .unwrap_or_default()
                )
                .collect::<Vec<_>>()
                .join("\n")
        )
    });

    // 4. Peregrine and Envoy on every host.
    let mut supervisors: Vec<Supervisor> = machines
        .iter()
        .map(|host| {
            let config = std::fs::read_to_string(host.dir.join("peregrine.toml")).unwrap();
            Supervisor::start_wrapped_at(&host.net.wrapper(), &peregrine_path(), &host.dir, &config)
                .expect("the supervisor starts")
        })
        .collect();
    let envoys: Vec<Envoy> = machines
        .iter()
        .zip(&supervisors)
        .map(|(host, supervisor)| {
            let bootstrap = supervisor.envoy_bootstrap().expect("envoy-bootstrap");
            Envoy::start_wrapped_in(&host.net.wrapper(), &envoy_binary, &host.dir, &bootstrap)
                .expect("Envoy starts")
        })
        .collect();
    let everyone = |supervisors: &[Supervisor]| -> BTreeSet<String> {
        supervisors
            .iter()
            .flat_map(|s| s.worker_pids())
            .map(|pid| pid.to_string())
            .collect()
    };
    let healthy_in = |index: usize| -> BTreeSet<String> {
        machines[index].net.run(|| {
            hosts(&envoys[index].clusters(), SERVICE)
                .into_iter()
                .filter(|h| h.healthy)
                .filter_map(|h| h.hostname.rsplit('-').next().map(str::to_owned))
                .collect()
        })
    };
    for (supervisor, name) in supervisors.iter().zip(HOSTS) {
        try_wait_until(STEP, "the host's workers registered", || {
            let status = supervisor.status_json().ok()?;
            let ready = status["workers"]
                .as_array()?
                .iter()
                // The example configs name their hosts `host-a`, `host-b`, `host-c`.
                .filter(|w| w["host"] == format!("host-{name}").as_str() && w["state"] == "ready")
                .count();
            (ready == WORKERS && supervisor.worker_pids().len() == WORKERS).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: host {name}\n{}", supervisor.all_logs()));
    }
    let all = everyone(&supervisors);
    assert_eq!(all.len(), HOSTS.len() * WORKERS, "{all:?}");
    for (index, name) in HOSTS.iter().enumerate() {
        try_wait_until(STEP, "every host's workers in this host's Envoy", || {
            (healthy_in(index) == all).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: host {name}'s Envoy has {:?}", healthy_in(index)));
    }
    // `peregrine status` on host a lists every host's workers, once its view of the fleet has them
    // all (its Envoy may be fed by another host's supervisor, whose view was complete first).
    let listed = || -> BTreeSet<String> {
        let status = supervisors[0].status_json().unwrap_or_default();
        status["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|w| w["pid"].as_u64().map(|p| p.to_string()))
            .collect()
    };
    try_wait_until(STEP, "every host's workers in host a's status", || {
        (listed() == all).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: host a's status lists {:?}", listed()));
    let answer = |index: usize| {
        machines[index]
            .net
            .run(|| http_get(ENVOY_LISTEN, "/"))
            .ok()
            .filter(|(code, _)| *code == 200)
            .and_then(|(_, body)| worker_pid(&body))
    };
    let own: BTreeSet<u32> = supervisors[0].worker_pids().into_iter().collect();
    let by = answer(0).expect("an answer through host a's Envoy");
    assert!(
        own.contains(&by),
        "local-first: {by} is not one of host a's {own:?}"
    );

    // A host dies whole: its supervisor and workers, and its etcd member.
    let dead = supervisors[2].worker_pids();
    supervisors[2].kill_with_workers();
    members[2].kill();
    let left = everyone(&supervisors[..2]);
    for (index, name) in HOSTS.iter().enumerate().take(2) {
        try_wait_until(
            STEP,
            "the dead host's workers gone from this host's Envoy",
            || (healthy_in(index) == left).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}: host {name}'s Envoy has {:?}", healthy_in(index)));
        let by = answer(index).expect("an answer after a host died");
        assert!(!dead.contains(&by), "{by} was the dead host's");
    }
    // Two members of three keep the quorum: host a's session is (again) connected.
    try_wait_until(STEP, "host a's etcd session connected", || {
        let status = supervisors[0].status_json().ok()?;
        (status["fleet"]["etcd"] == "connected").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {}", supervisors[0].all_logs()));
    drop(envoys);
    drop(supervisors);
    drop(members);
}
