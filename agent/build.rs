//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! The object is taken from `$PODLINK_EBPF_OBJECT`, else from the default output
//! path of `build-ebpf`. Without it, an empty placeholder is embedded so that host
//! builds, `cargo clippy` and unit tests work on stable alone; such a binary
//! refuses to start the agent and says how to build it properly.

use std::{env, fs, path::PathBuf};

fn main() {
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
