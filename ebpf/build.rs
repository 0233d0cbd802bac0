//! Builds the kernel program with clang (`peregrine-ebpf-build`, in `build/`) and writes `object.rs`, which embeds
//! it, or records why it could not be built. Without clang the crate still builds and the supervisor
//! falls back to procfs with a warning naming the missing tool; with `PEREGRINE_REQUIRE_EBPF=1` a
//! missing tool fails the build.
//!
//! Cargo keeps a build script's result until something it was told to watch changes: besides the
//! sources and the variables, the tools (see `compile::rerun_paths`). A tree built without clang is
//! rebuilt with the eBPF sampler once clang or libbpf's headers appear, and one built with them is not
//! rebuilt until they change.

use peregrine_ebpf_build as compile;

use std::path::{Path, PathBuf};

/// The lines of clang's diagnostics a failed build shows as cargo warnings.
const MAX_WARNING_LINES: usize = 20;

fn main() {
    let crate_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    for source in compile::SOURCES {
        println!("cargo::rerun-if-changed={source}");
    }
    println!("cargo::rerun-if-env-changed=CLANG");
    println!("cargo::rerun-if-env-changed=PEREGRINE_REQUIRE_EBPF");
    println!("cargo::rerun-if-env-changed=PATH");
    let required = std::env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1");
    let clang = compile::find_clang();
    let include = compile::find_libbpf();
    for path in compile::rerun_paths(
        clang.as_ref().ok().map(|(clang, _)| clang.as_path()),
        include.as_ref().ok().copied(),
        std::env::var_os("CLANG").as_deref(),
        std::env::var_os("PATH").as_deref(),
        Path::exists,
    ) {
        println!("cargo::rerun-if-changed={}", path.display());
    }
    let object = out_dir.join("sampler.bpf.o");
    let built =
        clang.and_then(|(clang, _)| compile::compile(&clang, include?, &crate_dir, &object));
    let generated = match built {
        Ok(_) => "/// The kernel program, built by clang.\n\
             pub(crate) static OBJECT: Result<&[u8], &str> = \
             Ok(aya::include_bytes_aligned!(concat!(env!(\"OUT_DIR\"), \"/sampler.bpf.o\")));\n"
            .to_string(),
        Err(error) => {
            if required {
                panic!("PEREGRINE_REQUIRE_EBPF=1 and the eBPF program cannot be built: {error}");
            }
            // A cargo warning is one line: clang's diagnostics (the lines after the first) go out as
            // a warning each, the first of them that say what went wrong.
            let why = error.to_string();
            let mut lines = why.lines().filter(|line| !line.trim().is_empty());
            let first = lines.next().unwrap_or_default();
            println!("cargo::warning=eBPF sampler not built (procfs fallback only): {first}");
            for line in lines.by_ref().take(MAX_WARNING_LINES) {
                println!("cargo::warning=  {line}");
            }
            if lines.next().is_some() {
                println!("cargo::warning=  ... (run `cargo xtask build-ebpf` for all of it)");
            }
            format!(
                "/// Why the kernel program was not built.\n\
                 pub(crate) static OBJECT: Result<&[u8], &str> = Err({:?});\n",
                error.to_string()
            )
        }
    };
    std::fs::write(out_dir.join("object.rs"), generated).expect("write object.rs");
}
