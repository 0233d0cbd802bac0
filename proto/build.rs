//! Compiles `peregrine/worker/v1/*.proto` with `protox` (pure Rust), so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["peregrine/worker/v1/registration.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
