//! The configs people start from pass `peregrine check`: every file in `examples/`, and every complete
//! TOML block (a fence whose info string is exactly `toml`) of `README.md`, `docs/*.md` and the
//! examples' own pages. A block that is part of a config is fenced as `toml,fragment` and not checked.
//!
//! Each config is copied into one directory beside the certificates `peregrine tls init` writes into
//! its `tls/`, so that the TLS paths they name (`tls/server.pem`, relative to the config's directory)
//! resolve as they do in `/etc/peregrine/`, and checked by the `peregrine` binary: the parser, the
//! total of workers against this user's process limit, and every certificate and key read and
//! matched, as an operator's `peregrine check` does. The environment overrides are cleared, so the
//! files alone decide.
//!
//! The package's system user (`peregrine`), which the packaged config's workers run as, is `nobody`
//! on a machine the package was never installed on.
//!
//! `check` also finds each worker's program. The third-party servers the docs show (gunicorn,
//! uvicorn, Node, Puma) are found in `PATH` when this machine has them; where it does not, a stand-in
//! executable of that name takes the place of the one an application host installs. Whether those
//! servers really serve on a passed socket is `tests/tests/app_servers.rs`'s business.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    process::Command,
};

use peregrine_contract::url::BindUrl;
use peregrine_supervisor::config::Config;

/// The third-party servers the docs and examples run as workers.
const SERVERS: [&str; 4] = ["gunicorn", "uvicorn", "node", "puma"];

/// The variables that override keys: cleared for the check.
const OVERRIDES: [&str; 4] = [
    "PEREGRINE_BIND",
    "PEREGRINE_METRICS",
    "PEREGRINE_CONTROL",
    "PEREGRINE_ETCD",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

/// A config to check: where it comes from (for messages) and its text.
struct Case {
    origin: String,
    text: String,
}

/// Every `.toml` file under `examples/`, by path relative to the workspace.
fn examples() -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root().join("examples")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("examples/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "toml") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The pages whose TOML blocks are checked: README.md, docs/*.md and the examples' pages.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    for dir in [root().join("docs"), root().join("examples")] {
        let mut dirs = vec![dir];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("a docs directory") {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|ext| ext == "md") {
                    pages.push(path);
                }
            }
        }
    }
    pages.sort();
    pages
}

/// The complete TOML blocks of a Markdown page, each with the line its fence opens on.
fn toml_blocks(page: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String, Option<String>)> = None;
    for (index, line) in page.lines().enumerate() {
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let fence_indent = line.len() - trimmed.len();
                    let text = (info.trim() == "toml").then(String::new);
                    open = Some((index + 1, " ".repeat(fence_indent), text));
                }
            }
            Some((start, indent, text)) => {
                if trimmed.starts_with("```") {
                    if let Some(text) = text.take() {
                        blocks.push((*start, text));
                    }
                    open = None;
                } else if let Some(text) = text {
                    text.push_str(line.strip_prefix(indent.as_str()).unwrap_or(line));
                    text.push('\n');
                }
            }
        }
    }
    blocks
}

fn cases() -> Vec<Case> {
    let root = root();
    let relative = |path: &Path| {
        path.strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string()
    };
    let mut cases: Vec<Case> = examples()
        .iter()
        .map(|path| Case {
            origin: relative(path),
            text: std::fs::read_to_string(path).expect("an example"),
        })
        .collect();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        for (line, block) in toml_blocks(&text) {
            cases.push(Case {
                origin: format!("{}:{line}", relative(&page)),
                text: block,
            });
        }
    }
    cases
}

fn peregrine() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_peregrine"));
    for variable in OVERRIDES {
        command.env_remove(variable);
    }
    command
}

/// `PATH` with stand-ins, in `dir`, for the servers of [`SERVERS`] this machine does not have.
fn search_path(dir: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = |name: &str| std::env::split_paths(&path).any(|dir| dir.join(name).is_file());
    std::fs::create_dir_all(dir).expect("the stand-ins' directory");
    for name in SERVERS.iter().filter(|name| !found(name)) {
        let program = dir.join(name);
        std::fs::write(
            &program,
            format!(
                "#!/bin/sh\necho '{name} is not installed here: this stands in for it so that \
                 peregrine check finds a program' >&2\nexit 127\n"
            ),
        )
        .expect("a stand-in");
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))
            .expect("an executable stand-in");
    }
    let mut dirs = vec![dir.to_owned()];
    dirs.extend(std::env::split_paths(&path));
    std::env::join_paths(dirs)
        .expect("a PATH")
        .into_string()
        .expect("a UTF-8 PATH")
}

/// A directory with `tls/` as `peregrine tls init` writes it, naming the example fleet's addresses.
fn directory_with_certificates() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let output = peregrine()
        .args(["tls", "init"])
        .arg(dir.path().join("tls"))
        .args([
            "--san", "10.0.0.1", "--san", "10.0.0.2", "--san", "10.0.0.3",
        ])
        .output()
        .expect("peregrine tls init runs");
    assert!(
        output.status.success(),
        "peregrine tls init: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    dir
}

/// The system user the package makes, which the packaged config's workers run as.
const PACKAGE_USER: &str = "peregrine";

/// `text`, its workers run as `nobody` instead where they run as the package's user and this
/// machine has none (a build machine the package was never installed on).
fn as_this_machine_has_it(text: &str) -> String {
    let has_package_user = std::fs::read_to_string("/etc/passwd")
        .unwrap_or_default()
        .lines()
        .any(|line| line.split(':').next() == Some(PACKAGE_USER));
    if has_package_user {
        return text.to_owned();
    }
    text.lines()
        .map(|line| {
            let (key, value) = line.split_once('=').unwrap_or_default();
            let value = value.split('#').next().unwrap_or_default().trim();
            if key.trim() == "user" && value == format!("\"{PACKAGE_USER}\"") {
                line.replacen(PACKAGE_USER, "nobody", 1)
            } else {
                line.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// A file name for a case: `examples/fleet-tls/host-a.toml` is `examples-fleet-tls-host-a.toml`.
fn file_name(origin: &str) -> String {
    let stem: String = origin
        .trim_end_matches(".toml")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("{stem}.toml")
}

#[test]
fn every_example_and_every_complete_toml_block_of_the_docs_passes_peregrine_check() {
    let dir = directory_with_certificates();
    let path = search_path(&dir.path().join("bin"));
    let cases = cases();
    let examples = cases.iter().filter(|c| c.origin.starts_with("examples/"));
    assert!(
        examples.count() >= 6,
        "examples/ should hold single-host, gunicorn, affinity-ring-hash and fleet-tls/host-a, b, c"
    );
    assert!(
        cases.iter().any(|c| c.origin.starts_with("README.md:")),
        "README.md's minimal config should be a complete ```toml block"
    );
    let mut failures = Vec::new();
    for case in &cases {
        let file = dir.path().join(file_name(&case.origin));
        std::fs::write(&file, as_this_machine_has_it(&case.text)).expect("a copy of the config");
        let output = peregrine()
            .arg("check")
            .arg(&file)
            .env("PATH", &path)
            .output()
            .expect("peregrine check runs");
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() || !stdout.contains(": ok (") {
            failures.push(format!(
                "{}: peregrine check {} ({}):\n{}{}",
                case.origin,
                if output.status.success() {
                    "said nothing of ok"
                } else {
                    "failed"
                },
                output.status,
                stdout,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} configs do not pass (fence a block that is part of a config as \
         ```toml,fragment):\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn the_example_fleets_hosts_agree_on_what_a_fleet_must_share() {
    let dir = directory_with_certificates();
    let hosts: Vec<Config> = examples()
        .iter()
        .filter(|path| path.parent().is_some_and(|dir| dir.ends_with("fleet-tls")))
        .map(|path| {
            let copy = dir.path().join(path.file_name().expect("a file"));
            std::fs::copy(path, &copy).expect("a copy");
            Config::load(&copy).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
        })
        .collect();
    assert_eq!(hosts.len(), 3, "three hosts in examples/fleet-tls/");
    let clusters: Vec<_> = hosts
        .iter()
        .map(|host| host.cluster.as_ref().expect("a [cluster] table"))
        .collect();
    let names: BTreeSet<&str> = clusters.iter().map(|c| c.host.as_str()).collect();
    assert_eq!(names.len(), 3, "one name per host: {names:?}");
    for (host, cluster) in hosts.iter().zip(&clusters).skip(1) {
        let (first, first_cluster) = (&hosts[0], clusters[0]);
        let name = &cluster.host;
        // ORCA streams reach every host's supervisor on the one port of the cluster.
        assert_eq!(
            host.supervisor.bind.port(),
            first.supervisor.bind.port(),
            "{name}: the gRPC port"
        );
        assert_eq!(
            (&cluster.etcd, &cluster.prefix, cluster.routing),
            (
                &first_cluster.etcd,
                &first_cluster.prefix,
                first_cluster.routing
            ),
            "{name}: one etcd, one fleet"
        );
        assert_eq!(
            host.envoy.xds_servers, first.envoy.xds_servers,
            "{name}: every Envoy may dial every supervisor"
        );
        for (service, config) in &host.services {
            let other = &first.services[service];
            assert_eq!(
                (&config.balancing, &config.weights, config.count),
                (&other.balancing, &other.weights, other.count),
                "{name}: service {service} as on {}",
                first_cluster.host
            );
        }
        assert_eq!(
            host.services.keys().collect::<Vec<_>>(),
            first.services.keys().collect::<Vec<_>>(),
            "{name}: the same services"
        );
    }
    // Each host's workers listen on its own address, one of the fleet's xDS servers.
    let servers: BTreeSet<_> = hosts[0].envoy.xds_servers.iter().map(|s| s.ip()).collect();
    for host in &hosts {
        for service in host.services.values() {
            let url = service.url_for(0);
            let ip = match &url {
                BindUrl::Tcp { host, .. } => host.parse::<IpAddr>().ok(),
                BindUrl::Unix { .. } => None,
            };
            assert!(
                ip.is_some_and(|ip| servers.contains(&ip)),
                "{}: its workers listen on {url}, not on one of the hosts' addresses {servers:?}",
                service.name
            );
        }
    }
}

/// A stop under the package's unit drains (up to `drain_timeout_ms`) and then gives each worker
/// `stop_timeout_ms` before its SIGKILL: an example whose two add up to the unit's `TimeoutStopSec`
/// would have systemd kill the supervisor in the middle of its stop.
#[test]
fn every_example_stops_inside_the_units_stop_timeout() {
    let unit = std::fs::read_to_string(root().join("packaging/systemd/peregrine.service"))
        .expect("the unit");
    let unit_timeout_ms: u64 = unit
        .lines()
        .find_map(|line| line.strip_prefix("TimeoutStopSec="))
        .and_then(|value| value.strip_suffix('s'))
        .and_then(|seconds| seconds.parse::<u64>().ok())
        .expect("TimeoutStopSec=Ns in the unit")
        * 1000;
    let mut files = examples();
    files.push(root().join("packaging/peregrine.toml"));
    for path in files {
        let text = std::fs::read_to_string(&path).expect("an example");
        let config: toml::Table = text.parse().expect("TOML");
        let supervisor = config.get("supervisor").and_then(toml::Value::as_table);
        let ms = |key: &str| {
            supervisor
                .and_then(|table| table.get(key))
                .and_then(toml::Value::as_integer)
                .map_or(10_000, |ms| u64::try_from(ms).expect("a positive count"))
        };
        let stop = ms("drain_timeout_ms") + ms("stop_timeout_ms");
        // The supervisor's own exit after its workers' takes well under a second.
        assert!(
            stop + 1000 < unit_timeout_ms,
            "{}: drain_timeout_ms + stop_timeout_ms = {stop} ms, beyond the unit's \
             TimeoutStopSec ({unit_timeout_ms} ms)",
            path.display()
        );
    }
}

#[test]
fn complete_blocks_are_told_from_fragments() {
    let page = "text\n```toml\n[service.a]\n```\n\n```toml,fragment\ncount = 2\n```\n\n   ```toml\n   [service.b]\n   ```\n```sh\nls\n```\n";
    assert_eq!(
        toml_blocks(page),
        [
            (2, "[service.a]\n".to_string()),
            (10, "[service.b]\n".to_string())
        ]
    );
}
