//! `cargo xtask test --kernel 6.1|6.12`: the end-to-end tests that matter for a
//! kernel, run inside a QEMU guest that boots Debian's kernel package.
//!
//! The guest is made of three parts, all from Debian's package registry or this
//! checkout, kept under `.tools/guest/`:
//! * the kernel: the newest `linux-image-*-cloud-amd64` that the meta-package
//!   `linux-image-cloud-amd64` of a suite depends on (`bookworm` gives 6.1,
//!   `bookworm-backports` 6.12), fetched with `apt-get download` through a private
//!   apt state (the host's sources are not touched), its modules indexed by
//!   `depmod` so that the guest loads them on demand (`veth`, `cls_bpf`, ...);
//! * a root file system made once with `debootstrap --variant=minbase`: what the
//!   test bed runs (iproute2, bpftool, the CNI plugins, tcpdump, kmod, procps);
//! * this run's files at the same absolute paths as on the host: the test
//!   binaries, the agent and CNI plugin (`dist` profile), the eBPF object and the
//!   checkout's tracked files, and `/init`, which mounts the kernel's file
//!   systems, runs the tests and powers the guest off.
//!
//! All three are `newc` cpio archives concatenated into one initramfs: the guest
//! runs from RAM (no disk, no shared file system; Debian's cloud kernels have no
//! 9p). QEMU emulates the CPU (`-accel tcg`): this machine has `/dev/kvm` but no
//! nested virtualisation, so a KVM guest hangs at boot. The guest's serial
//! console is this command's output; `/init`'s last line gives the tests' status.

use std::{
    collections::BTreeSet,
    fs,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;

use crate::{cargo_test, dist_bin, ebpf_object, project_root, run, tools_dir};

/// A kernel the guest tests run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Kernel {
    /// Debian 12's own kernel (bookworm): cls_bpf, no TCX.
    #[value(name = "6.1")]
    V6_1,
    /// Debian 12's backported kernel (bookworm-backports): TCX.
    #[value(name = "6.12")]
    V6_12,
}

impl Kernel {
    /// The name `--kernel` takes.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::V6_1 => "6.1",
            Kernel::V6_12 => "6.12",
        }
    }

    /// The Debian suite whose `linux-image-cloud-amd64` gives this kernel.
    fn suite(self) -> &'static str {
        match self {
            Kernel::V6_1 => "bookworm",
            Kernel::V6_12 => "bookworm-backports",
        }
    }
}

/// The test binaries (of the `podlink-tests` package) run in each guest, and the
/// name filters passed to each (all of its tests when empty): programs load and
/// pass the verifier, capture and HBONE, DNS capture (UDP `bpf_sk_assign`, the
/// answers' port rewrite), fail closed, restart, uninstall, and other programs
/// on the same host veth.
const GUEST_TESTS: &[(&str, &[&str])] = &[
    (
        "programs",
        &["decisions_on_crafted_packets", "dns_queries_and_answers"],
    ),
    (
        "cross_node",
        &["cross_node_traffic_is_tunnelled_with_the_client_address"],
    ),
    ("dns", &[]),
    ("fail_closed", &[]),
    ("restart", &[]),
    ("uninstall", &[]),
    ("coexistence", &[]),
];

/// Debian packages the guest tests need on the host, and a file each installs
/// (QEMU apart: see [`install_qemu`]).
const HOST_PACKAGES: &[(&str, &str)] = &[
    ("debootstrap", "/usr/sbin/debootstrap"),
    ("cpio", "/usr/bin/cpio"),
    ("kmod", "/usr/sbin/depmod"),
];

/// What the guest's root file system holds beyond `minbase`: the tools the test
/// bed runs (`tests/src/lib.rs` checks for them), `kmod` for the kernel's module
/// loading, `procps` for `sysctl`.
const ROOT_PACKAGES: &[&str] = &[
    "iproute2",
    "bpftool",
    "containernetworking-plugins",
    "tcpdump",
    "iperf3",
    "dnsmasq-base",
    "kmod",
    "procps",
];

/// The suite of the root file system: the host's (the test binaries link its glibc).
const ROOT_SUITE: &str = "bookworm";

/// Debian's package registry.
const MIRROR: &str = "http://deb.debian.org/debian";

/// Memory of the guest: the initramfs (about 300 MiB) unpacks into it.
const GUEST_MEMORY_MIB: u32 = 4096;

/// How long a guest may run before it is stopped and the run fails.
const GUEST_TIMEOUT: Duration = Duration::from_secs(40 * 60);

/// The line `/init` ends with, followed by the tests' exit status.
const EXIT_MARKER: &str = "podlink-guest: exit ";

fn guest_dir() -> PathBuf {
    tools_dir().join("guest")
}

/// The oldest QEMU whose software emulation boots the 6.12 guest: Debian 12's
/// own 7.2 crashes it at random while it unpacks the initramfs (double faults,
/// page faults in ACPI; seen with `-cpu max`, `qemu64`, one vCPU or two), where
/// bookworm-backports' 10.0 runs it.
const QEMU_MIN_MAJOR: u32 = 10;

/// Installs the host's packages for the guest tests, if missing.
pub fn setup() -> Result<()> {
    host_is_bookworm()?;
    crate::setup::install(HOST_PACKAGES)?;
    install_qemu()
}

/// Refuses a host other than Debian 12 (bookworm): the guest's root file
/// system is bookworm's, the test binaries run in it with the host's glibc
/// expectations, and QEMU comes from bookworm-backports.
fn host_is_bookworm() -> Result<()> {
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let codename = os
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|c| c.trim_matches('"'));
    if codename != Some("bookworm") || std::env::consts::ARCH != "x86_64" {
        bail!(
            "the guest tests need a Debian 12 (bookworm) x86_64 host, this is {} on {}: run `cargo xtask test --kernel host`",
            codename.unwrap_or("an unknown system"),
            std::env::consts::ARCH
        );
    }
    Ok(())
}

/// Installs `qemu-system-x86` from bookworm-backports unless a QEMU of at least
/// [`QEMU_MIN_MAJOR`] is there. The backports suite is named through the guest's
/// own apt sources, so the host's sources stay as they are.
fn install_qemu() -> Result<()> {
    if let Ok(out) = Command::new("qemu-system-x86_64").arg("--version").output()
        && let Some(major) = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .nth(3)
            .and_then(|v| v.split('.').next()?.parse::<u32>().ok())
        && major >= QEMU_MIN_MAJOR
    {
        return Ok(());
    }
    eprintln!("setup: installing qemu-system-x86 from bookworm-backports");
    let apt = apt_dir()?;
    // Installing needs dpkg's own status, not an empty one.
    let options = apt_options(&apt, Status::Dpkg);
    run(Command::new("apt-get")
        .args(&options)
        .args(["update", "-qq"]))
    .context("apt-get update of bookworm-backports")?;
    run(Command::new("apt-get")
        .args(&options)
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(["-t", "bookworm-backports", "qemu-system-x86"])
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("installing qemu-system-x86 from bookworm-backports")
}

/// The guest's apt state directory, with its sources: bookworm and
/// bookworm-backports.
fn apt_dir() -> Result<PathBuf> {
    let apt = guest_dir().join("apt");
    for sub in ["lists/partial", "cache/archives/partial"] {
        fs::create_dir_all(apt.join(sub))?;
    }
    fs::write(
        apt.join("sources.list"),
        format!("deb {MIRROR} bookworm main\ndeb {MIRROR} bookworm-backports main\n"),
    )?;
    Ok(apt)
}

/// Runs the guest tests on `kernel` with the binaries `cargo xtask build` made;
/// `filter` keeps only the tests whose name contains it (as on the host).
pub fn test(kernel: Kernel, filter: Option<&str>) -> Result<()> {
    let started = Instant::now();
    let kernel_files = fetch_kernel(kernel)?;
    let root = root_archive()?;
    let binaries = test_binaries()?;
    let run_dir = guest_dir().join(format!("run-{}", kernel.name()));
    let initrd = run_archive(&run_dir, &root, &kernel_files, &binaries, filter)?;
    eprintln!(
        "guest {}: booting {} under QEMU (software emulation) after {:.0} s of preparation",
        kernel.name(),
        kernel_files.release,
        started.elapsed().as_secs_f64()
    );
    let status = boot(&kernel_files.vmlinuz, &initrd)?;
    eprintln!(
        "guest {}: tests ended with status {status} after {:.0} s",
        kernel.name(),
        started.elapsed().as_secs_f64()
    );
    if status != 0 {
        bail!(
            "the end-to-end tests failed in the {} guest ({})",
            kernel.name(),
            kernel_files.release
        );
    }
    Ok(())
}

/// A kernel unpacked from its Debian package.
struct KernelFiles {
    /// `uname -r` of the kernel, e.g. `6.1.0-50-cloud-amd64`.
    release: String,
    vmlinuz: PathBuf,
    /// The package's modules (`lib/modules/<release>`, indexed) as a cpio archive.
    modules: PathBuf,
}

/// Which installed packages apt is told of.
#[derive(PartialEq)]
enum Status {
    /// None: only downloads, which must not depend on what the host has.
    Empty,
    /// dpkg's: to install on the host.
    Dpkg,
}

/// apt options that keep its lists and cache under `dir` with its own sources.
fn apt_options(dir: &Path, status: Status) -> Vec<String> {
    let sources = dir.join("sources.list");
    let mut options = vec![
        format!("Dir::Etc::SourceList={}", sources.display()),
        "Dir::Etc::SourceParts=/dev/null".to_string(),
        format!("Dir::State::Lists={}", dir.join("lists").display()),
        format!("Dir::Cache={}", dir.join("cache").display()),
        // The downloads land in a directory of root's; apt's sandbox user could
        // not write there.
        "APT::Sandbox::User=root".to_string(),
    ];
    if status == Status::Empty {
        options.push("Dir::State::status=/dev/null".to_string());
    }
    options
        .into_iter()
        .flat_map(|o| ["-o".to_string(), o])
        .collect()
}

/// Fetches and unpacks `kernel`'s package, unless the newest one is already here.
fn fetch_kernel(kernel: Kernel) -> Result<KernelFiles> {
    let options = apt_options(&apt_dir()?, Status::Empty);
    let package = match refresh_and_resolve(&options, kernel) {
        Ok(package) => package,
        Err(e) => {
            // Offline with a kernel fetched before: use it, and say so.
            let cached = newest_cached(kernel)?.ok_or(e)?;
            eprintln!(
                "guest {}: could not ask Debian's registry for the newest kernel; using {cached}",
                kernel.name()
            );
            cached
        }
    };
    let dir = guest_dir().join("kernels").join(&package);
    let done = dir.join(".unpacked");
    if !done.exists() {
        eprintln!("guest {}: fetching {package}", kernel.name());
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        let download = guest_dir().join("download");
        let _ = fs::remove_dir_all(&download);
        fs::create_dir_all(&download)?;
        run(Command::new("apt-get")
            .args(&options)
            .args(["download", "-qq", &package])
            .current_dir(&download))
        .with_context(|| format!("downloading {package}"))?;
        let deb = fs::read_dir(&download)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .with_context(|| format!("apt-get download left no .deb for {package}"))?;
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))
            .with_context(|| format!("unpacking {}", deb.display()))?;
        fs::remove_dir_all(&download)?;
        let release = only_entry(&dir.join("lib/modules"))?;
        run(Command::new("depmod").arg("-b").arg(&dir).arg(&release))
            .context("indexing the kernel's modules")?;
        // `lib/modules/...` but not `lib` itself: in the root, `lib` is a
        // symlink to `usr/lib`, which an entry named `lib` would replace.
        let list = listing(&dir, "lib/modules")?;
        cpio(&dir, &list, &dir.join("modules.cpio"))?;
        fs::write(&done, &release)?;
    }
    let release = fs::read_to_string(&done)?;
    Ok(KernelFiles {
        vmlinuz: dir.join(format!("boot/vmlinuz-{release}")),
        modules: dir.join("modules.cpio"),
        release,
    })
}

/// Refreshes the private apt lists and names the kernel package that `kernel`'s
/// suite's `linux-image-cloud-amd64` depends on.
fn refresh_and_resolve(options: &[String], kernel: Kernel) -> Result<String> {
    run(Command::new("apt-get")
        .args(options)
        .args(["update", "-qq"]))
    .context("apt-get update of the guest kernels' sources")?;
    let madison = Command::new("apt-cache")
        .args(options)
        .args(["madison", "linux-image-cloud-amd64"])
        .output()
        .context("apt-cache madison")?;
    let text = String::from_utf8_lossy(&madison.stdout);
    let version = text
        .lines()
        .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>())
        .find(|f| {
            // "<mirror> <suite>/<component> <arch> Packages"
            f.len() == 3
                && f[2]
                    .split_whitespace()
                    .nth(1)
                    .and_then(|s| s.split('/').next())
                    == Some(kernel.suite())
        })
        .map(|f| f[1].to_string())
        .with_context(|| {
            format!(
                "linux-image-cloud-amd64 has no version in {}: {text}",
                kernel.suite()
            )
        })?;
    let show = Command::new("apt-cache")
        .args(options)
        .args(["show", &format!("linux-image-cloud-amd64={version}")])
        .output()
        .context("apt-cache show")?;
    let text = String::from_utf8_lossy(&show.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Depends: "))
        .and_then(|d| d.split([',', ' ']).find(|p| p.starts_with("linux-image-")))
        .map(str::to_string)
        .with_context(|| format!("linux-image-cloud-amd64 {version} depends on no linux-image"))
}

/// The newest kernel of `kernel`'s line unpacked before, if any.
fn newest_cached(kernel: Kernel) -> Result<Option<String>> {
    let prefix = format!("linux-image-{}", kernel.name());
    let Ok(entries) = fs::read_dir(guest_dir().join("kernels")) else {
        return Ok(None);
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join(".unpacked").exists())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix(&prefix)
                .is_some_and(|rest| rest.starts_with(['.', '-']))
        })
        .collect();
    names.sort_by_key(|n| natural_key(n));
    Ok(names.pop())
}

/// `name` as runs of digits (compared as numbers) and of other characters, so
/// that `6.1.0-41` sorts after `6.1.0-9`.
fn natural_key(name: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = name;
    while let Some(first) = rest.chars().next() {
        let digits = first.is_ascii_digit();
        let end = rest
            .find(|c: char| c.is_ascii_digit() != digits)
            .unwrap_or(rest.len());
        let (run, tail) = rest.split_at(end);
        key.push(if digits {
            (run.parse().unwrap_or(u64::MAX), String::new())
        } else {
            (0, run.to_string())
        });
        rest = tail;
    }
    key
}

/// The one entry of `dir`, by name.
fn only_entry(dir: &Path) -> Result<String> {
    let entries: Vec<String> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    match entries.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!("{} holds {entries:?}, expected one entry", dir.display()),
    }
}

/// The guest's root file system as a cpio archive, made once per package list.
fn root_archive() -> Result<PathBuf> {
    let dir = guest_dir();
    let archive = dir.join("root.cpio");
    let stamp = dir.join("root.packages");
    let wanted = format!("{ROOT_SUITE} {}", ROOT_PACKAGES.join(","));
    if archive.exists() && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(archive);
    }
    let root = dir.join("root");
    let _ = fs::remove_dir_all(&root);
    let _ = fs::remove_file(&archive);
    eprintln!("guest: making the root file system with debootstrap (about a minute)");
    let log = dir.join("debootstrap.log");
    let out = fs::File::create(&log)?;
    let status = Command::new("debootstrap")
        .args(["--variant=minbase", "--include"])
        .arg(ROOT_PACKAGES.join(","))
        .arg(ROOT_SUITE)
        .arg(&root)
        .arg(MIRROR)
        .stdout(out.try_clone()?)
        .stderr(out)
        .status()
        .context("starting debootstrap")?;
    if !status.success() {
        bail!("debootstrap failed ({status}); its log: {}", log.display());
    }
    // What the guest never reads: a smaller archive boots faster.
    for sub in [
        "usr/share/doc",
        "usr/share/man",
        "usr/share/locale",
        "var/cache/apt",
    ] {
        let _ = fs::remove_dir_all(root.join(sub));
    }
    let list = listing(&root, ".")?;
    cpio(&root, &list, &archive)?;
    fs::remove_dir_all(&root)?;
    fs::write(&stamp, wanted)?;
    Ok(archive)
}

/// A test binary of `podlink-tests`, by its test target's name.
struct TestBinary {
    name: String,
    path: PathBuf,
}

/// Builds the guest's test binaries (as `cargo xtask test` builds them) and names
/// their files.
fn test_binaries() -> Result<Vec<TestBinary>> {
    let mut cmd = cargo_test();
    cmd.args([
        "--no-run",
        "--message-format=json-render-diagnostics",
        // The whole workspace, as the host's run builds it: the same features,
        // so the same artifacts, nothing built again.
        "--workspace",
    ]);
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("building the guest's test binaries")?;
    if !out.status.success() {
        bail!("building the guest's test binaries failed: {}", out.status);
    }
    let mut binaries = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let (Some(name), Some(path)) = (
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) && message["target"]["kind"][0] == "test"
            && GUEST_TESTS.iter().any(|(n, _)| *n == name)
        {
            binaries.push(TestBinary {
                name: name.to_string(),
                path: fs::canonicalize(path)?,
            });
        }
    }
    binaries.sort_by_key(|b| GUEST_TESTS.iter().position(|(n, _)| *n == b.name));
    binaries.dedup_by(|a, b| a.name == b.name);
    if binaries.len() != GUEST_TESTS.len() {
        bail!(
            "cargo built {} of the {} guest test binaries",
            binaries.len(),
            GUEST_TESTS.len()
        );
    }
    Ok(binaries)
}

/// Writes this run's `/init` and archive of host files, and concatenates the
/// initramfs: root, modules, run. Returns its path.
fn run_archive(
    dir: &Path,
    root: &Path,
    kernel: &KernelFiles,
    binaries: &[TestBinary],
    filter: Option<&str>,
) -> Result<PathBuf> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    let project = fs::canonicalize(project_root())?;
    let podlink = fs::canonicalize(dist_bin("podlink"))
        .context("the agent is not built (`cargo xtask build`)")?;
    let cni = fs::canonicalize(dist_bin("podlink-cni"))?;
    let object = fs::canonicalize(ebpf_object())?;
    // The checkout's tracked files (the tests' working directory and anything
    // they read), then the binaries.
    let tracked = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(&project)
        .output()
        .context("git ls-files")?;
    let mut files: Vec<PathBuf> = tracked
        .stdout
        .split(|b| *b == 0)
        .filter(|f| !f.is_empty())
        .map(|f| project.join(String::from_utf8_lossy(f).as_ref()))
        .filter(|p| p.is_file())
        .collect();
    files.extend([podlink.clone(), cni, object.clone()]);
    // The test binaries without their debug information (about a tenth of
    // their size): the initramfs unpacks into the guest's memory.
    let stripped_dir = dir.join("bin");
    fs::create_dir_all(&stripped_dir)?;
    let mut stripped = Vec::with_capacity(binaries.len());
    for b in binaries {
        let path = stripped_dir.join(&b.name);
        run(Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&path)
            .arg(&b.path))
        .with_context(|| format!("stripping {}", b.path.display()))?;
        stripped.push(TestBinary {
            name: b.name.clone(),
            path: fs::canonicalize(&path)?,
        });
    }
    let binaries = &stripped;
    files.extend(binaries.iter().map(|b| b.path.clone()));
    let host_list = with_ancestors(&files)?;
    let host = dir.join("host.cpio");
    cpio(Path::new("/"), &host_list, &host)?;

    fs::write(
        dir.join("init"),
        init_script(&project, &podlink, &object, binaries, filter),
    )?;
    let mut perms = fs::metadata(dir.join("init"))?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    fs::set_permissions(dir.join("init"), perms)?;
    let init = dir.join("init.cpio");
    cpio(dir, "init\n", &init)?;

    let initrd = dir.join("initrd.cpio");
    let mut out = fs::File::create(&initrd)?;
    for part in [root, &kernel.modules, &host, &init] {
        std::io::copy(&mut fs::File::open(part)?, &mut out)
            .with_context(|| format!("writing {}", initrd.display()))?;
    }
    Ok(initrd)
}

/// `files` and their ancestor directories, relative to `/`, one per line
/// (parents first), as cpio reads them. An ancestor that is a symlink in the
/// guest's root (`lib`, `bin`, ...) is left out: an entry would replace it.
fn with_ancestors(files: &[PathBuf]) -> Result<String> {
    let mut entries = BTreeSet::new();
    for file in files {
        let relative = file
            .strip_prefix("/")
            .with_context(|| format!("{} is not absolute", file.display()))?;
        let mut ancestors: Vec<&Path> = relative
            .ancestors()
            .filter(|a| !a.as_os_str().is_empty())
            .collect();
        ancestors.reverse();
        for a in ancestors {
            if Path::new("/").join(a).is_symlink() {
                continue;
            }
            entries.insert(a.to_path_buf());
        }
    }
    // BTreeSet order puts a directory before what it holds.
    Ok(entries
        .iter()
        .map(|p| format!("{}\n", p.display()))
        .collect())
}

/// Every path under `dir/start` (itself included), relative to `dir`, one per line.
fn listing(dir: &Path, start: &str) -> Result<String> {
    let out = Command::new("find")
        .arg(start)
        .current_dir(dir)
        .output()
        .with_context(|| format!("listing {}", dir.display()))?;
    if !out.status.success() {
        bail!("find {start} in {} failed", dir.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| *l != ".")
        .map(|l| format!("{}\n", l.strip_prefix("./").unwrap_or(l)))
        .collect())
}

/// Writes the `newc` cpio archive of `list` (paths relative to `dir`, one per
/// line) to `archive`.
fn cpio(dir: &Path, list: &str, archive: &Path) -> Result<()> {
    let mut child = Command::new("cpio")
        .args(["--create", "--format=newc", "--quiet"])
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(fs::File::create(archive)?)
        .spawn()
        .context("starting cpio")?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(list.as_bytes())?;
    let status = child.wait()?;
    if !status.success() {
        bail!("cpio of {} failed: {status}", dir.display());
    }
    Ok(())
}

/// The guest's `/init`: mounts the kernel's file systems, runs each test binary
/// from the checkout's `tests/` (as cargo would), prints [`EXIT_MARKER`] and the
/// status, and powers off.
fn init_script(
    project: &Path,
    podlink: &Path,
    object: &Path,
    binaries: &[TestBinary],
    filter: Option<&str>,
) -> String {
    let mut s = String::from(
        r#"#!/bin/sh
# Made by `cargo xtask test --kernel`: runs podlink's end-to-end tests in this guest.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root RUST_BACKTRACE=1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
ip link set lo up
echo "podlink-guest: kernel $(uname -r), user space after $(cut -d' ' -f1 /proc/uptime) s"
status=0
"#,
    );
    s.push_str(&format!(
        "export PODLINK_BIN='{}' PODLINK_EBPF_OBJECT='{}'\ncd '{}'\n",
        podlink.display(),
        object.display(),
        project.join("tests").display()
    ));
    for binary in binaries {
        let filters = GUEST_TESTS
            .iter()
            .find(|(n, _)| *n == binary.name)
            .map_or(&[][..], |(_, f)| *f);
        // The command's filter narrows further: a test runs when it matches both.
        let args: Vec<String> = match (filters.is_empty(), filter) {
            (_, None) => filters.iter().map(|f| format!(" '{f}'")).collect(),
            (true, Some(f)) => vec![format!(" '{f}'")],
            (false, Some(f)) => {
                let kept: Vec<String> = filters
                    .iter()
                    .filter(|t| t.contains(f))
                    .map(|t| format!(" '{t}'"))
                    .collect();
                if kept.is_empty() {
                    continue;
                }
                kept
            }
        };
        s.push_str(&format!(
            "echo \"podlink-guest: {name} at $(cut -d' ' -f1 /proc/uptime) s\"\n'{bin}'{args} || status=1\n",
            name = binary.name,
            bin = binary.path.display(),
            args = args.concat()
        ));
    }
    s.push_str(&format!(
        "echo \"podlink-guest: done at $(cut -d' ' -f1 /proc/uptime) s\"\necho \"{EXIT_MARKER}$status\"\necho o > /proc/sysrq-trigger\nsleep 60\n"
    ));
    s
}

/// Boots the guest and echoes its console; returns the status `/init` printed.
fn boot(vmlinuz: &Path, initrd: &Path) -> Result<i32> {
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2"])
        .args(["-m", &GUEST_MEMORY_MIB.to_string()])
        .args([
            "-nographic",
            "-no-reboot",
            "-nodefaults",
            "-serial",
            "stdio",
        ])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            // mitigations=off: the guest is ours, and emulated speculation
            // barriers only cost time.
            "console=ttyS0 rdinit=/init panic=-1 quiet mitigations=off",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + GUEST_TIMEOUT;
    let mut status = None;
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                println!("{line}");
                if let Some(s) = line.trim().strip_prefix(EXIT_MARKER) {
                    status = s.trim().parse::<i32>().ok();
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the guest ran for over {} min and was stopped",
                    GUEST_TIMEOUT.as_secs() / 60
                );
            }
        }
    }
    let _ = child.wait();
    status.context("the guest stopped before its tests ended (a panic? see its console above)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_come_first_and_symlinked_ones_are_left_out() {
        let list = with_ancestors(&[
            PathBuf::from("/work/x/target/dist/podlink"),
            PathBuf::from("/work/x/tests/src/lib.rs"),
            // `/lib` is a symlink on Debian 12 (merged /usr), as in the guest.
            PathBuf::from("/lib/modules/a.ko"),
        ])
        .unwrap();
        let lines: Vec<&str> = list.lines().collect();
        assert_eq!(lines[0], "lib/modules");
        assert!(!lines.contains(&"lib"));
        let pos = |p: &str| lines.iter().position(|l| *l == p).unwrap();
        assert!(pos("work") < pos("work/x"));
        assert!(pos("work/x/target") < pos("work/x/target/dist/podlink"));
        assert!(pos("work/x/tests/src") < pos("work/x/tests/src/lib.rs"));
    }

    #[test]
    fn cached_kernels_sort_by_their_numbers() {
        let mut names = [
            "linux-image-6.1.0-41-cloud-amd64",
            "linux-image-6.1.0-9-cloud-amd64",
            "linux-image-6.1.0-50-cloud-amd64",
        ];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names.last(), Some(&"linux-image-6.1.0-50-cloud-amd64"));
        assert_eq!(names.first(), Some(&"linux-image-6.1.0-9-cloud-amd64"));
    }

    #[test]
    fn the_command_filter_narrows_the_guest_tests() {
        let binaries = vec![
            TestBinary {
                name: "programs".into(),
                path: "/t/programs-1".into(),
            },
            TestBinary {
                name: "restart".into(),
                path: "/t/restart-1".into(),
            },
        ];
        let all = init_script(
            Path::new("/p"),
            Path::new("/b"),
            Path::new("/o"),
            &binaries,
            None,
        );
        assert!(all.contains(
            "'/t/programs-1' 'decisions_on_crafted_packets' 'dns_queries_and_answers' || status=1"
        ));
        assert!(all.contains("'/t/restart-1' || status=1"));
        let some = init_script(
            Path::new("/p"),
            Path::new("/b"),
            Path::new("/o"),
            &binaries,
            Some("server"),
        );
        assert!(!some.contains("/t/programs-1"));
        assert!(some.contains("'/t/restart-1' 'server' || status=1"));
        assert!(some.ends_with("sleep 60\n"));
    }
}
