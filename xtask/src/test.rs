//! `cargo xtask test`: install what the tests use (as root, every system package of the project's
//! list that they need and that is missing: clang and libbpf's headers,
//! python3-venv, etcd, Node, tmux, Prometheus, systemd-analyze, vagrant, ...; see
//! [`packages::TEST`]), Envoy, the strict Python clients, the third-party app servers (gunicorn,
//! uvicorn) and the previous release's binary, build the workspace, run the whole test suite against
//! them.
//!
//! Plain `cargo test --workspace` rather than `--all-targets` (which skips doc tests) or nextest (not
//! installed by the project, and CI reads cargo test's closing lines). Extra arguments go to cargo test.

use std::process::ExitCode;

use peregrine_testenv::{SKIPS_VAR, target_dir};
use xtask::{cargo, ebpf, envoy, packages, previous, pyapps, pyclients, run_checked};

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    packages::ensure(packages::TEST)?;
    ebpf::tools::check_clang_var()?;
    let envoy = envoy::install()?;
    eprintln!("Envoy: {}", envoy.display());
    let python = pyclients::install()?;
    let pyapps = pyapps::install()?;
    let previous = previous::install()?;
    run_checked(cargo().args(["build", "--workspace", "--bins", "--examples"]))?;
    let peregrine = target_dir().join("debug/peregrine");
    // Every test that skips appends why to this file; listed once the run ends.
    let skips = target_dir().join("test-skips.txt");
    let _ = std::fs::remove_file(&skips);
    let status = cargo()
        .args(["test", "--workspace"])
        .args(args)
        .env("ENVOY", &envoy)
        // Built above, so the harness need not run cargo from inside the tests.
        .env("PEREGRINE", &peregrine)
        .env("PEREGRINE_EXAMPLES", target_dir().join("debug/examples"))
        .env("PEREGRINE_PYTHON", &python)
        // gunicorn and uvicorn, the third-party servers the tests run as workers (Node is on PATH).
        .env("PEREGRINE_PYAPPS", &pyapps)
        // The previous release's binary, whose workers this version adopts or refuses with a drain.
        .env("PEREGRINE_PREVIOUS", &previous)
        // Tests that need Envoy or etcd fail instead of skipping if one goes missing.
        .env("PEREGRINE_REQUIRE_ENVOY", "1")
        .env("PEREGRINE_REQUIRE_ETCD", "1")
        .env(SKIPS_VAR, &skips)
        .status()?;
    report_skips(&std::fs::read_to_string(&skips).unwrap_or_default());
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => {
            eprintln!("cargo test was killed: {status}");
            ExitCode::FAILURE
        }
    })
}

/// Lists the tests that skipped (each said why), or says that none did.
fn report_skips(skips: &str) {
    let lines: Vec<&str> = skips.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        eprintln!("No test skipped.");
        return;
    }
    eprintln!("Tests skipped ({}):", lines.len());
    for line in lines {
        eprintln!("  {}", line.strip_prefix("skipping ").unwrap_or(line));
    }
}
