//! Where the binaries under test are, and free ports for them.

use std::{
    env,
    net::{Ipv4Addr, TcpListener},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        OnceLock,
        atomic::{AtomicU16, Ordering},
    },
};

use peregrine_contract::ErrorChain;
use peregrine_testenv::{target_dir, venv_envoy_binary, workspace_root};

/// The Envoy binary to test against: `ENVOY` when set, else the one `cargo xtask envoy` installed under
/// the target directory (or under `<workspace>/target` when `CARGO_TARGET_DIR` points elsewhere).
pub fn envoy_path() -> Option<PathBuf> {
    if let Some(path) = env::var_os("ENVOY").filter(|path| !path.is_empty()) {
        return Some(PathBuf::from(path));
    }
    [target_dir(), workspace_root().join("target")]
        .iter()
        .find_map(|target| venv_envoy_binary(&target.join("envoy/venv")))
}

/// Whether `program` runs (`program ARG` exits 0), for a test named `test` that needs it; else
/// prints why the test skips and returns false, or panics when `require` (e.g.
/// `PEREGRINE_REQUIRE_PROMETHEUS`) is `1`: a CI run must not skip. `install` says how to get it.
pub fn tool_or_skip(test: &str, program: &str, arg: &str, require: &str, install: &str) -> bool {
    let found = std::process::Command::new(program)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        let reason = format!("no {program} ({install})");
        assert!(
            env::var(require).map_or(true, |v| v != "1"),
            "{test}: {require}=1 but {reason}"
        );
        crate::skip(test, reason);
    }
    found
}

/// The Envoy binary for a test named `test`, or `None` after printing why the test skips.
///
/// # Panics
///
/// When there is no Envoy and `PEREGRINE_REQUIRE_ENVOY` is set: a CI run must not skip.
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    let path = envoy_path();
    if path.is_none() {
        let reason = "no Envoy binary: set ENVOY or run `cargo xtask envoy`";
        if env::var_os("PEREGRINE_REQUIRE_ENVOY").is_some() {
            panic!(
                "{test}: {reason} (PEREGRINE_REQUIRE_ENVOY is set, so this fails instead of skipping)"
            );
        }
        crate::skip(test, reason);
    }
    path
}

/// The `peregrine` binary: `PEREGRINE` when set, else `<target>/debug/peregrine` after running
/// `$CARGO build -p peregrine --bin peregrine` once per process.
///
/// The build runs even when the binary exists, because a stale binary would test old code; it takes well
/// under a second when nothing changed (`cargo xtask test` sets `PEREGRINE` and skips it).
///
/// # Panics
///
/// When the build fails.
pub fn peregrine_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(path) = env::var_os("PEREGRINE").filter(|path| !path.is_empty()) {
            return PathBuf::from(path);
        }
        cargo_build(&["-p", "peregrine", "--bin", "peregrine"]);
        let path = target_dir().join("debug/peregrine");
        assert!(
            path.is_file(),
            "{} is missing after the build",
            path.display()
        );
        path
    })
    .clone()
}

/// The worker crate's example binary `name` (e.g. `axum`): in `PEREGRINE_EXAMPLES` when set (a directory;
/// `cargo xtask test` builds the examples and sets it), else `<target>/debug/examples/<name>` after
/// running `$CARGO build -p peregrine-worker --example <name>`.
///
/// # Panics
///
/// When the build fails.
pub fn example_path(name: &str) -> PathBuf {
    if let Some(dir) = env::var_os("PEREGRINE_EXAMPLES").filter(|dir| !dir.is_empty()) {
        return Path::new(&dir).join(name);
    }
    cargo_build(&["-p", "peregrine-worker", "--example", name]);
    target_dir().join("debug/examples").join(name)
}

/// Runs `$CARGO build --quiet ARGS` in the workspace.
///
/// # Panics
///
/// When the build fails.
fn cargo_build(args: &[&str]) {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet"])
        .args(args)
        .current_dir(workspace_root())
        .status()
        .expect("cargo runs");
    assert!(
        status.success(),
        "cargo build {} failed: {status}",
        args.join(" ")
    );
}

/// A python with the strict HTTP clients `h11` and `h2`: `PEREGRINE_PYTHON` (set by `cargo xtask test`),
/// else `<target>/pyclients/venv/bin/python` when it can import them. `None` prints why the caller
/// skips, unless `PEREGRINE_REQUIRE_ENVOY` is set (`cargo xtask test`), where it panics instead.
pub fn python_clients_or_skip(test: &str) -> Option<PathBuf> {
    let python = env::var_os("PEREGRINE_PYTHON")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("pyclients/venv/bin/python"));
    let works = Command::new(&python)
        .args(["-c", "import h11, h2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if works {
        return Some(python);
    }
    let why = format!(
        "{} cannot import h11 and h2 (run `cargo xtask test`)",
        python.display()
    );
    assert!(
        env::var_os("PEREGRINE_REQUIRE_ENVOY").is_none(),
        "{test}: {why}"
    );
    crate::skip(test, why);
    None
}

/// The unchanged third-party HTTP servers the tests run as workers, each found and seen to run.
#[derive(Clone, Debug)]
pub struct AppServers {
    /// gunicorn (WSGI), from the virtualenv `cargo xtask test` installs.
    pub gunicorn: PathBuf,
    /// uvicorn (ASGI), from the same virtualenv.
    pub uvicorn: PathBuf,
    /// Node, from `PATH`.
    pub node: PathBuf,
}

/// The third-party servers for a test named `test`: gunicorn and uvicorn in `PEREGRINE_PYAPPS` (a bin
/// directory, set by `cargo xtask test`), else in `<target>/pyapps/venv/bin`, and `node` on `PATH`, each
/// checked to run (`--version`). `None` prints why the caller skips, unless `PEREGRINE_REQUIRE_ENVOY`
/// is set (`cargo xtask test`), where it panics instead.
pub fn app_servers_or_skip(test: &str) -> Option<AppServers> {
    let bin = env::var_os("PEREGRINE_PYAPPS")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("pyapps/venv/bin"));
    let runs = |program: &Path| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let gunicorn = bin.join("gunicorn");
    let uvicorn = bin.join("uvicorn");
    let node = program_in_path("node");
    let mut missing = Vec::new();
    for program in [&gunicorn, &uvicorn] {
        if !runs(program) {
            missing.push(format!(
                "{} does not run (run `cargo xtask test`)",
                program.display()
            ));
        }
    }
    match &node {
        Some(node) if runs(node) => {}
        Some(node) => missing.push(format!("{} does not run", node.display())),
        None => missing.push("no node in PATH (apt-get install nodejs)".to_owned()),
    }
    if let Some(node) = node.filter(|_| missing.is_empty()) {
        return Some(AppServers {
            gunicorn,
            uvicorn,
            node,
        });
    }
    let why = missing.join("; ");
    assert!(
        env::var_os("PEREGRINE_REQUIRE_ENVOY").is_none(),
        "{test}: {why}"
    );
    crate::skip(test, why);
    None
}

/// The previous release's `peregrine` (`PEREGRINE_PREVIOUS`, which `cargo xtask test` builds from
/// the release's commit, else `target/previous/*/peregrine`), checked to run. `None` prints why the
/// caller skips, unless `PEREGRINE_REQUIRE_ENVOY` is set (`cargo xtask test`), where it panics.
pub fn previous_release_or_skip(test: &str) -> Option<PathBuf> {
    let binary = env::var_os("PEREGRINE_PREVIOUS")
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::fs::read_dir(target_dir().join("previous"))
                .ok()?
                .flatten()
                .map(|entry| entry.path().join("peregrine"))
                .find(|path| path.exists())
        });
    let runs = |program: &Path| {
        Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    match binary {
        Some(binary) if runs(&binary) => return Some(binary),
        Some(binary) => {
            let why = format!("{} does not run (run `cargo xtask test`)", binary.display());
            assert!(
                env::var_os("PEREGRINE_REQUIRE_ENVOY").is_none(),
                "{test}: {why}"
            );
            crate::skip(test, why);
        }
        None => {
            let why = "no previous release built (`cargo xtask test` builds it)";
            assert!(
                env::var_os("PEREGRINE_REQUIRE_ENVOY").is_none(),
                "{test}: {why}"
            );
            crate::skip(test, why);
        }
    }
    None
}

/// `install -m 0755 from to`: a new file (a new inode) in `to`'s place, as a package installs one
/// over a running program.
///
/// # Panics
///
/// When `install` fails.
#[track_caller]
pub fn install_program(from: &Path, to: &Path) {
    let status = Command::new("install")
        .args(["-m", "0755"])
        .arg(from)
        .arg(to)
        .status()
        .expect("install runs");
    assert!(
        status.success(),
        "install {} {}",
        from.display(),
        to.display()
    );
}

/// The command that runs `gunicorn` on the WSGI test application, one process on the listener the
/// supervisor passes (gunicorn takes it from `LISTEN_FDS` itself: no `--bind`).
pub fn gunicorn_command(gunicorn: &Path) -> Vec<String> {
    vec![
        gunicorn.display().to_string(),
        "--no-control-socket".into(),
        "--workers".into(),
        "1".into(),
        "--chdir".into(),
        test_app("").display().to_string(),
        "wsgi_app:app".into(),
    ]
}

/// The absolute path of the test application `tests/apps/<name>` (e.g. `wsgi_app.py`).
pub fn test_app(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("apps")
        .join(name)
}

/// `program` in one of `PATH`'s directories, if it is there.
fn program_in_path(program: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// Whether the eBPF sampler loads here (root with CAP_BPF and CAP_PERFMON, a kernel with BTF, and a
/// build that had clang). When it does not, the test is skipped with a message, unless
/// `PEREGRINE_REQUIRE_EBPF=1` (CI), which fails it.
pub fn ebpf_or_skip(test: &str) -> bool {
    let why = match peregrine_ebpf::Probe::load(1) {
        Ok(_) => return true,
        Err(error) => ErrorChain(&error).to_string(),
    };
    assert!(
        env::var("PEREGRINE_REQUIRE_EBPF").map_or(true, |v| v != "1"),
        "{test}: PEREGRINE_REQUIRE_EBPF=1 but the eBPF sampler cannot load: {why}"
    );
    crate::skip(test, format!("the eBPF sampler cannot load here: {why}"));
    false
}

/// A TCP port on 127.0.0.1 (and `::1`) that was free a moment ago, chosen *below* the kernel's ephemeral
/// range.
///
/// A port the kernel handed out for port 0 could be handed out again, to a worker binding
/// `localhost:0`, before the test binds it; ports below the ephemeral range are never handed out that
/// way, so only another test picking the same port at random could take it. Each call in a process
/// moves on to a different port.
pub fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    let span = low.saturating_sub(FIRST).max(1);
    // Different test processes start at different places.
    let seed = (std::process::id() as u16).wrapping_mul(7919);
    let _ = NEXT.compare_exchange(0, seed % span, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let port = FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        // A host without IPv6 loopback cannot bind `::1` at all; that does not make the port taken.
        let v6_free = match TcpListener::bind((std::net::Ipv6Addr::LOCALHOST, port)) {
            Ok(_) => true,
            Err(error) => error.kind() == std::io::ErrorKind::AddrNotAvailable,
        };
        let free = v6_free && TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok();
        if free {
            return port;
        }
    }
    panic!("no free port between {FIRST} and {low}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable() {
        let port = free_port();
        assert_ne!(port, 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("the port is free");
    }

    #[test]
    fn finds_the_app_servers() {
        let Some(servers) = app_servers_or_skip("paths::tests::finds_the_app_servers") else {
            return;
        };
        for program in [&servers.gunicorn, &servers.uvicorn, &servers.node] {
            assert!(program.is_file(), "{}", program.display());
        }
    }

    #[test]
    fn test_apps_are_in_the_tests_crate() {
        for app in ["wsgi_app.py", "asgi_app.py", "node_app.js"] {
            let path = test_app(app);
            assert!(path.is_absolute() && path.is_file(), "{}", path.display());
        }
    }
}
