//! Compiles the protocol definitions with `protox` (pure Rust), so building needs no system `protoc`:
//! `peregrine/worker/v1/*.proto` always, and with the `orca` feature the ORCA service
//! (`third_party/xds/...`) with its tonic server.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["peregrine/worker/v1/registration.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    prost_build::Config::new().compile_fds(descriptors)?;

    if std::env::var_os("CARGO_FEATURE_ORCA").is_some() {
        let orca = [
            "third_party/xds/data/orca/v3/orca_load_report.proto",
            "third_party/xds/service/orca/v3/orca.proto",
        ];
        for file in orca {
            println!("cargo:rerun-if-changed={file}");
        }
        let descriptors = protox::compile(
            [
                "xds/data/orca/v3/orca_load_report.proto",
                "xds/service/orca/v3/orca.proto",
            ],
            ["third_party"],
        )?;
        tonic_prost_build::configure()
            // The well-known types are envoy-types' own, so a Duration is one type across the
            // supervisor's xDS and ORCA code.
            .compile_well_known_types(true)
            .extern_path(".google.protobuf", "::envoy_types::pb::google::protobuf")
            .build_client(true)
            .build_server(true)
            .compile_fds(descriptors)?;
    }
    Ok(())
}
