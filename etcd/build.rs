//! Compiles etcd's gRPC API (`proto/etcd/api/...`, vendored from etcd's release; see each file's
//! header) with `protox` (pure Rust), so building needs no system `protoc`. Clients only.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/etcd/api/etcdserverpb/rpc.proto",
        "proto/etcd/api/mvccpb/kv.proto",
        "proto/etcd/api/authpb/auth.proto",
        "proto/etcd/api/versionpb/version.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(["etcd/api/etcdserverpb/rpc.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}
