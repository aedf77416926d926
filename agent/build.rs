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
//! The `podlink` binary is laid out in the order of `symbol-order.txt` (lld's
//! `--symbol-ordering-file`): the functions and data the agent runs first and
//! together, so that they fill few pages, instead of scattered among code it never
//! runs (the kernel maps code in 64 KiB blocks around each fault). `cargo xtask
//! layout` regenerates the file from what the agent runs on the test bed; names the
//! linker does not find are ignored. It is used where rustc links with lld by
//! default (x86_64-unknown-linux-gnu, Rust 1.90+) and no other linker is
//! configured; `PODLINK_NO_SYMBOL_ORDER=1` turns it off.

use std::{env, fs, path::PathBuf};

fn main() {
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu")
    {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    symbol_order(&manifest_dir.join("symbol-order.txt"));
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

/// Hands `order` to lld when the link uses rustc's default lld.
fn symbol_order(order: &std::path::Path) {
    println!("cargo:rerun-if-changed={}", order.display());
    println!("cargo:rerun-if-env-changed=PODLINK_NO_SYMBOL_ORDER");
    let default_lld = env::var("TARGET").as_deref() == Ok("x86_64-unknown-linux-gnu")
        // A linker configured for the target, or chosen through the flags.
        && env::var_os("RUSTC_LINKER").is_none()
        && !env::var("CARGO_ENCODED_RUSTFLAGS")
            .unwrap_or_default()
            .contains("link");
    if default_lld && env::var_os("PODLINK_NO_SYMBOL_ORDER").is_none() && order.exists() {
        println!(
            "cargo:rustc-link-arg-bin=podlink=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bin=podlink=-Wl,--no-warn-symbol-ordering");
    }
}
