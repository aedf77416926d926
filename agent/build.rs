//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! The object is taken from `$PODLINK_EBPF_OBJECT`, else from the default output
//! path of `build-ebpf`. Without it, an empty placeholder is embedded so that host
//! builds, `cargo clippy` and unit tests work on stable alone; such a binary
//! refuses to start the agent and says how to build it properly.
//!
//! On Linux with glibc the binaries are linked with packed relative relocations
//! (`-z pack-relative-relocs`, DT_RELR, glibc 2.36+): the position-independent
//! executable's 37,000 relative relocations take a few kilobytes instead of 900 KB
//! of `.rela.dyn`, which the dynamic loader reads whole at start and which then
//! stays resident.
//!
//! The workload xDS protos under `proto/` (istiod's `Address` and `Authorization`
//! resources, Envoy's delta ADS service) are compiled by `protox` (a protobuf
//! compiler in Rust: no `protoc` binary needed) and turned into Rust, with the gRPC
//! client and server, by `tonic-prost-build`; `src/xds/proto.rs` includes them.

use std::{env, fs, path::PathBuf};

/// The protos compiled, relative to `proto/`; their imports are found there too,
/// and the `google/protobuf` well-known types are built into protox.
const PROTOS: &[&str] = &[
    "istio/workload/workload.proto",
    "istio/security/authorization.proto",
    "envoy/service/discovery/v3/discovery.proto",
];

fn main() {
    compile_protos();
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu")
    {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let default = manifest_dir.join("../ebpf/target/bpfel-unknown-none/release/podlink-ebpf");
    let object = env::var_os("PODLINK_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or(default);
    println!("cargo:rerun-if-env-changed=PODLINK_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("podlink-ebpf");
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).unwrap(),
        Err(e) => {
            println!(
                "cargo:warning=no eBPF object at {} ({e}); run `cargo xtask build` for a working agent",
                object.display()
            );
            fs::write(&out, []).unwrap();
        }
    }
}

/// Generates the protos' Rust into `OUT_DIR`, one file per package
/// (`istio.workload.rs`, …).
fn compile_protos() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.join("proto");
    println!("cargo:rerun-if-changed={}", root.display());
    let descriptors = protox::compile(PROTOS, [&root])
        .unwrap_or_else(|e| panic!("compiling the protos under {}: {e:?}", root.display()));
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .compile_fds(descriptors)
        .unwrap_or_else(|e| panic!("generating Rust from the protos: {e}"));
}
