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
//! With `PODLINK_SYMBOL_ORDER=1` (set by `cargo xtask build`), the `podlink`
//! binary is laid out in the order of `symbol-order.txt` (lld's
//! `--symbol-ordering-file`): the functions and data the agent runs first and
//! together, so that they fill few pages, instead of scattered among code it never
//! runs (the kernel maps code in 64 KiB blocks around each fault). `cargo xtask
//! layout` regenerates the file from what the agent runs on the test bed; names
//! the linker does not find are ignored. The option is only passed where rustc
//! links with its own lld (x86_64-unknown-linux-gnu with `gcc-ld/ld.lld` in the
//! sysroot, Rust 1.90+) and no other linker is configured: GNU ld would refuse it.

use std::{
    env, fs,
    path::{Path, PathBuf},
};

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

/// Hands `order` to lld when asked to (`PODLINK_SYMBOL_ORDER`) and the link uses
/// rustc's own lld.
fn symbol_order(order: &Path) {
    println!("cargo:rerun-if-changed={}", order.display());
    println!("cargo:rerun-if-env-changed=PODLINK_SYMBOL_ORDER");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER");
    if env::var_os("PODLINK_SYMBOL_ORDER").is_none_or(|v| v == "0") || !order.exists() {
        return;
    }
    if !rustc_links_with_lld() {
        println!(
            "cargo:warning=PODLINK_SYMBOL_ORDER is set, but this build does not link with rustc's lld: the code layout of symbol-order.txt is not applied"
        );
        return;
    }
    // `-Wl,` splits at commas.
    let path = order.display().to_string();
    if path.contains(',') {
        println!("cargo:warning=the path {path} has a comma: the code layout is not applied");
        return;
    }
    println!("cargo:rustc-link-arg-bin=podlink=-Wl,--symbol-ordering-file={path}");
    println!("cargo:rustc-link-arg-bin=podlink=-Wl,--no-warn-symbol-ordering");
}

/// Whether rustc links this target with its self-contained lld: the target whose
/// default that is (Rust 1.90+), no linker chosen in the configuration or the flags,
/// and the lld wrapper present in the toolchain.
fn rustc_links_with_lld() -> bool {
    const TARGET: &str = "x86_64-unknown-linux-gnu";
    if env::var("TARGET").as_deref() != Ok(TARGET)
        || env::var_os("RUSTC_LINKER").is_some()
        || env::var("CARGO_ENCODED_RUSTFLAGS")
            .unwrap_or_default()
            .contains("link")
    {
        return false;
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(out) = std::process::Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
    else {
        return false;
    };
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    sysroot
        .join("lib/rustlib")
        .join(TARGET)
        .join("bin/gcc-ld/ld.lld")
        .exists()
}
