//! `cargo xtask build-ebpf`: the same clang build the `peregrine-ebpf` build script runs, into
//! `target/ebpf/sampler.bpf.o`, then a listing of the object's programs and maps; and ([`tools`]) that
//! build's clang and libbpf headers, installed before `test` and `demo` build.

use std::process::ExitCode;

use anyhow::{Context, anyhow};

use peregrine_testenv::target_dir;

use crate::workspace_root;

pub mod tools;

use peregrine_ebpf_build as compile;

/// Builds the object, then lists it through the eBPF crate's `describe` example (which links
/// `aya-obj`; the xtask does not).
pub fn run(_args: &[String]) -> anyhow::Result<ExitCode> {
    let out_dir = target_dir().join("ebpf");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let object = out_dir.join("sampler.bpf.o");
    let line =
        compile::build(&workspace_root().join("ebpf"), &object).map_err(|e| anyhow!("{e}"))?;
    println!(
        "built: {line}
"
    );
    let mut describe = crate::cargo();
    describe
        .args([
            "run",
            "--quiet",
            "-p",
            "peregrine-ebpf",
            "--example",
            "describe",
            "--",
        ])
        .arg(&object);
    crate::run_checked(&mut describe)?;
    Ok(ExitCode::SUCCESS)
}
