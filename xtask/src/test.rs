//! `cargo xtask test`: install Envoy (and, with apt-get, etcd and protoc where missing, and clang and
//! libbpf's headers for the eBPF sampler), build the workspace, run the whole test suite against them.
//!
//! Plain `cargo test --workspace` rather than `--all-targets` (which skips doc tests) or nextest (not
//! installed by the project, and CI reads cargo test's closing lines). Extra arguments go to cargo test.

use std::process::ExitCode;

use peregrine_e2e::target_dir;

use crate::{cargo, ebpf, envoy, packages, pyclients, run_checked};

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    packages::ensure(packages::FLEET)?;
    ebpf::tools::ensure()?;
    let envoy = envoy::install()?;
    eprintln!("Envoy: {}", envoy.display());
    let python = pyclients::install()?;
    run_checked(cargo().args(["build", "--workspace", "--bins", "--examples"]))?;
    let peregrine = target_dir().join("debug/peregrine");
    let status = cargo()
        .args(["test", "--workspace"])
        .args(args)
        .env("ENVOY", &envoy)
        // Built above, so the harness need not run cargo from inside the tests.
        .env("PEREGRINE", &peregrine)
        .env("PEREGRINE_EXAMPLES", target_dir().join("debug/examples"))
        .env("PEREGRINE_PYTHON", &python)
        // Tests that need Envoy or etcd fail instead of skipping if one goes missing.
        .env("PEREGRINE_REQUIRE_ENVOY", "1")
        .env("PEREGRINE_REQUIRE_ETCD", "1")
        .status()?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => {
            eprintln!("cargo test was killed: {status}");
            ExitCode::FAILURE
        }
    })
}
