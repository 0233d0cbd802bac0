//! Builds the kernel program with clang (see `build/compile.rs`) and writes `object.rs`, which embeds
//! it, or records why it could not be built. Without clang the crate still builds and the supervisor
//! falls back to procfs with a warning naming the missing tool; with `PEREGRINE_REQUIRE_EBPF=1` a
//! missing tool fails the build.

#[path = "build/compile.rs"]
#[allow(
    dead_code,
    reason = "shared with the crate's unit tests, which use helpers the build does not"
)]
mod compile;

use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    for source in compile::SOURCES {
        println!("cargo::rerun-if-changed={source}");
    }
    println!("cargo::rerun-if-changed=build/compile.rs");
    println!("cargo::rerun-if-env-changed=CLANG");
    println!("cargo::rerun-if-env-changed=PEREGRINE_REQUIRE_EBPF");
    println!("cargo::rerun-if-env-changed=PATH");
    let required = std::env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1");
    let object = out_dir.join("sampler.bpf.o");
    let generated = match compile::build(&crate_dir, &object) {
        Ok(_) => "/// The kernel program, built by clang.\n\
             pub(crate) static OBJECT: Result<&[u8], &str> = \
             Ok(aya::include_bytes_aligned!(concat!(env!(\"OUT_DIR\"), \"/sampler.bpf.o\")));\n"
            .to_string(),
        Err(error) => {
            if required {
                panic!("PEREGRINE_REQUIRE_EBPF=1 and the eBPF program cannot be built: {error}");
            }
            let first_line = error
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            println!("cargo::warning=eBPF sampler not built (procfs fallback only): {first_line}");
            format!(
                "/// Why the kernel program was not built.\n\
                 pub(crate) static OBJECT: Result<&[u8], &str> = Err({:?});\n",
                error.to_string()
            )
        }
    };
    std::fs::write(out_dir.join("object.rs"), generated).expect("write object.rs");
}
