//! Lists the programs and maps of a compiled sampler object, as `cargo xtask build-ebpf` shows them:
//! `cargo run -p peregrine-ebpf --example describe -- target/ebpf/sampler.bpf.o`.
//!
//! An example of this crate, not a part of the xtask: it parses the object with `aya-obj`, which
//! the crate's loader links anyway, so that the xtask every newcomer builds first does not.

use std::process::ExitCode;

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

/// `BPF_F_MMAPABLE` in a map's flags.
const MMAPABLE: u32 = 1 << 10;

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: describe OBJECT.o");
        return ExitCode::FAILURE;
    };
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(error) => {
            eprintln!("reading {path}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let parsed = match aya_obj::Object::parse(&bytes) {
        Ok(parsed) => parsed,
        Err(error) => {
            eprintln!("parsing {path}: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!("{path} ({} bytes)", bytes.len());
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
        let flags = if map.map_flags() & MMAPABLE != 0 {
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
    ExitCode::SUCCESS
}
