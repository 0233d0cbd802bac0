//! `cargo xtask build-ebpf`: the same clang build the `peregrine-ebpf` build script runs, into
//! `target/ebpf/sampler.bpf.o`, then a listing of the object's programs and maps; and ([`tools`]) that
//! build's clang and libbpf headers, installed before `test` and `demo` build.

use std::process::ExitCode;

use anyhow::{Context, anyhow};

use peregrine_testenv::target_dir;

use crate::workspace_root;

#[path = "../../ebpf/build/compile.rs"]
#[allow(
    dead_code,
    reason = "the eBPF build script's own module: this command calls only part of it"
)]
mod compile;
pub mod tools;

/// BPF map type numbers (`enum bpf_map_type` in linux/bpf.h) that the object uses.
fn map_type_name(map_type: u32) -> String {
    match map_type {
        1 => "hash".into(),
        2 => "array".into(),
        6 => "percpu_array".into(),
        9 => "lru_hash".into(),
        other => format!("type {other}"),
    }
}

pub fn run(_args: &[String]) -> anyhow::Result<ExitCode> {
    let out_dir = target_dir().join("ebpf");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let object = out_dir.join("sampler.bpf.o");
    let line =
        compile::build(&workspace_root().join("ebpf"), &object).map_err(|e| anyhow!("{e}"))?;
    println!("built: {line}");
    let bytes = std::fs::read(&object).with_context(|| format!("read {}", object.display()))?;
    let parsed = aya_obj::Object::parse(&bytes).context("parse the object")?;
    println!("\n{} ({} bytes)", object.display(), bytes.len());
    let mut programs: Vec<_> = parsed.programs.iter().collect();
    programs.sort_by(|a, b| a.0.cmp(b.0));
    println!("\nprograms:");
    for (name, program) in programs {
        println!("  {name:<16} {:?}", program.section);
    }
    let mut maps: Vec<_> = parsed.maps.iter().collect();
    maps.sort_by(|a, b| a.0.cmp(b.0));
    println!("\nmaps (max_entries as compiled; the loader resizes them for the configured slots):");
    for (name, map) in maps {
        let flags = if map.map_flags() & (1 << 10) != 0 {
            " mmapable"
        } else {
            ""
        };
        println!(
            "  {name:<12} {:<10} key {} B, value {} B, max_entries {}{flags}",
            map_type_name(map.map_type()),
            map.key_size(),
            map.value_size(),
            map.max_entries()
        );
    }
    Ok(ExitCode::SUCCESS)
}
