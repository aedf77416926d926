//! `cargo xtask setup`: makes a fresh machine ready, idempotently.
//!
//! * Debian packages the data path, the test bed and the benchmark use.
//! * The nightly toolchain's `rust-src` component (the eBPF crate builds `core`).
//! * `bpf-linker` 0.13, built against the nightly's own LLVM into `.tools/`.
//! * `kubernetes-validate` (PyPI), in a Python venv under `.tools/`, for
//!   `validate-deploy` (installed by the commands that validate: `setup`,
//!   `validate-deploy` and `test`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{project_root, run, tools_dir};

/// Debian packages and a file each one installs (to check without dpkg's locks).
const PACKAGES: &[(&str, &str)] = &[
    ("iproute2", "/usr/sbin/ip"),
    ("bpftool", "/usr/sbin/bpftool"),
    ("containernetworking-plugins", "/usr/lib/cni/ptp"),
    ("iperf3", "/usr/bin/iperf3"),
    ("tcpdump", "/usr/bin/tcpdump"),
    // `strip`: the guest tests' binaries go into the initramfs without debug
    // information.
    ("binutils", "/usr/bin/strip"),
    // The upstream resolver of the DNS tests and bench rows; the -base package
    // starts no system service.
    ("dnsmasq-base", "/usr/sbin/dnsmasq"),
    // `python3 -m venv` of Debian's python3 (for kubernetes-validate).
    ("python3-venv", "/usr/share/doc/python3-venv"),
];

/// The bpf-linker release line that builds with the installed toolchains.
const BPF_LINKER_VERSION: &str = "~0.13";

/// The kubernetes-validate release installed (it bundles the Kubernetes JSON
/// schemas, 1.25 to 1.37, so validating needs no network).
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

/// The Python that gets the venv: Debian's, which python3-venv completes.
const PYTHON: &str = "/usr/bin/python3";

/// What a command needs besides the build tools.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Validator {
    /// `kubernetes-validate` too (the commands that validate the manifests).
    Install,
    /// Only the packages and the eBPF toolchain (the demo, the bench, builds).
    Skip,
}

/// Installs what is missing: the Debian packages, `rust-src`, `bpf-linker`, and
/// `kubernetes-validate` when `validator` asks for it.
pub fn setup(validator: Validator) -> Result<()> {
    install(PACKAGES)?;
    install_rust_src()?;
    install_bpf_linker()?;
    if validator == Validator::Install {
        install_kubernetes_validate()?;
    }
    Ok(())
}

/// Installs those of `packages` (name, a file it installs) whose file is missing.
pub fn install(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: installing Debian packages: {}", missing.join(" "));
    let mut update = Command::new("apt-get");
    update.args(["update", "-qq"]);
    run(&mut update).context("apt-get update (setup needs root and the Debian mirror)")?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    run(&mut install).context("apt-get install")?;
    Ok(())
}

fn install_rust_src() -> Result<()> {
    let out = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .context("running rustup")?;
    if !out.status.success() {
        bail!(
            "the nightly toolchain is missing (rustup said: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with("rust-src"))
    {
        return Ok(());
    }
    eprintln!("setup: adding rust-src to the nightly toolchain");
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

/// Path of the project-local bpf-linker.
pub fn bpf_linker_bin() -> PathBuf {
    tools_dir().join("bpf-linker/bin/bpf-linker")
}

fn install_bpf_linker() -> Result<()> {
    let bin = bpf_linker_bin();
    if let Ok(out) = Command::new(&bin).arg("--version").output()
        && out.status.success()
        && String::from_utf8_lossy(&out.stdout).contains("bpf-linker 0.13")
    {
        return Ok(());
    }
    let (llvm_major, libllvm) = nightly_llvm()?;
    // bpf-linker links `libLLVM.so`; give it the nightly's own library under both
    // the plain name and its soname (also found at run time through the rpath).
    let prefix = tools_dir().join("llvm");
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib)?;
    let soname = libllvm
        .file_name()
        .context("libLLVM path has no file name")?
        .to_owned();
    for name in [std::ffi::OsString::from("libLLVM.so"), soname] {
        let link = lib.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("symlinking {}", link.display()))?;
    }
    eprintln!(
        "setup: building bpf-linker {BPF_LINKER_VERSION} against the nightly's LLVM {llvm_major} (one to three minutes)"
    );
    let mut cmd = Command::new("cargo");
    // --locked: the dependency versions bpf-linker was released with, not newer
    // ones that may want a newer toolchain than this machine's.
    cmd.args([
        "install",
        "bpf-linker",
        "--version",
        BPF_LINKER_VERSION,
        "--locked",
    ])
    .args(["--no-default-features", "--features"])
    .arg(format!("llvm-{llvm_major}"))
    .arg("--root")
    .arg(tools_dir().join("bpf-linker"))
    .env("LLVM_PREFIX", &prefix)
    .current_dir(project_root());
    run(&mut cmd)
}

/// The nightly's LLVM major version and the path of its `libLLVM.so.*`.
fn nightly_llvm() -> Result<(String, PathBuf)> {
    let vv = Command::new("rustup")
        .args(["run", "nightly", "rustc", "-vV"])
        .output()
        .context("running the nightly rustc")?;
    let text = String::from_utf8_lossy(&vv.stdout);
    let major = text
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("the nightly rustc does not print its LLVM version")?
        .to_string();
    let sysroot = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .context("asking the nightly rustc for its sysroot")?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
    let lib = fs::read_dir(sysroot.join("lib"))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .with_context(|| format!("no libLLVM.so.* in {}/lib", sysroot.display()))?;
    Ok((major, lib))
}

/// The venv holding kubernetes-validate.
fn kubernetes_validate_venv() -> PathBuf {
    tools_dir().join("kubernetes-validate")
}

/// Path of the project-local kubernetes-validate.
pub fn kubernetes_validate_bin() -> PathBuf {
    kubernetes_validate_venv().join("bin/kubernetes-validate")
}

fn install_kubernetes_validate() -> Result<()> {
    if let Ok(out) = Command::new(kubernetes_validate_bin())
        .arg("--version")
        .output()
        && out.status.success()
        && String::from_utf8_lossy(&out.stdout).trim() == KUBERNETES_VALIDATE_VERSION
    {
        return Ok(());
    }
    let venv = kubernetes_validate_venv();
    eprintln!(
        "setup: installing kubernetes-validate {KUBERNETES_VALIDATE_VERSION} into {}",
        venv.display()
    );
    // --clear: a venv left half made, or of an earlier version, starts afresh.
    run(Command::new(PYTHON)
        .args(["-m", "venv", "--clear"])
        .arg(&venv))
    .context("making the kubernetes-validate venv")?;
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(format!(
            "kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}"
        )))
    .context("pip install kubernetes-validate")
}
