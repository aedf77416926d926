//! `cargo xtask <command>`: podlink's development tasks.
//!
//! Every command first runs `setup` (without `kubernetes-validate` where it does not
//! validate), so a fresh machine needs nothing by hand.

mod bench;
mod demo;
mod deploy;
mod fuzz;
mod guest;
mod setup;

use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(about = "podlink development tasks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The soak's echo server in network namespace NETNS on ADDR, until killed
    /// (a process of its own: the soak's sockets exceed one process's
    /// open-file limit).
    #[command(hide = true)]
    SoakServer {
        netns: String,
        addr: std::net::SocketAddr,
    },
    /// Install what building and testing need (Debian packages, nightly rust-src,
    /// bpf-linker, kubernetes-validate). Idempotent.
    Setup,
    /// Build the eBPF object (with BTF) with the nightly toolchain.
    BuildEbpf,
    /// Build everything: the eBPF object, then the agent that embeds it (`dist` profile).
    Build,
    /// Build a two-node cluster of network namespaces and show podlink at work.
    Demo,
    /// Validate the Kubernetes manifests of deploy/: their schemas, the
    /// kustomizations' resources, and the variants they build (deploy/istio).
    ValidateDeploy,
    /// Validate deploy/, run unit tests, then the end-to-end tests (root) on the
    /// network-namespace test bed, on this machine's kernel and then in QEMU
    /// guests booting Debian's 6.12 (TCX) and 6.1 (`cls_bpf`) kernels (see
    /// xtask/src/guest.rs), then each fuzz target for 10 s, unoptimized (with the
    /// host kernel; those whose name contains the filter, when one is given).
    Test {
        /// Only run tests whose name contains this filter.
        filter: Option<String>,
        /// Only on these kernels: `host` (this machine's: every test), `6.1` or
        /// `6.12` (a guest: the end-to-end tests that matter for a kernel).
        /// Repeatable [default: host, 6.12 and 6.1].
        #[arg(long, value_enum)]
        kernel: Vec<TestKernel>,
    },
    /// Run the fuzz targets of fuzz/ (cargo-fuzz, nightly; installed into
    /// .tools/ when missing) for a bounded time each; fails when any crashes,
    /// printing the crashing input's path and the command that replays it
    /// (xtask/src/fuzz.rs).
    Fuzz {
        /// Seconds each target runs for.
        #[arg(long, default_value_t = fuzz::DEFAULT_SECONDS)]
        seconds: u64,
        /// Only the targets whose name contains this [default: all].
        target: Option<String>,
        /// Build them unoptimized, as `cargo xtask test` does (builds several
        /// times faster, runs tens of times slower).
        #[arg(long)]
        dev: bool,
    },
    /// Measure podlink against the direct path on the two-node test bed (the
    /// figures and targets of issue 6, a scaling table, pod enrollment).
    Bench {
        /// Repetitions of each measurement of the main table (interleaved, median
        /// shown) [default: 5, 1 with --quick].
        #[arg(long)]
        repeat: Option<usize>,
        /// Write the tables as JSON to this file as well (with every sample).
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Write the report as a Markdown page to this file as well: the machine
        /// header, the tables, then the ideas tried and not kept (as
        /// docs/benchmarks.md).
        #[arg(long, value_name = "FILE")]
        markdown: Option<PathBuf>,
        /// Shortened runs for development (1 repetition, 2 s throughput runs,
        /// 1,000 round trips, 10 s churn, fewer pods and pairs); the output says so.
        #[arg(long)]
        quick: bool,
        /// Measure only this, on its own bed, and print each run (see
        /// xtask/src/bench/probe.rs); --repeat defaults to 3 (1 for enrollment,
        /// api-watch and xds-watch).
        #[arg(long, value_enum, conflicts_with_all = ["json", "markdown", "quick"])]
        probe: Option<bench::ProbeRow>,
        /// The length of each probe run, in seconds (of the iperf3 runs for
        /// scaling) [default: the full bench's for that row].
        #[arg(long, requires = "probe")]
        seconds: Option<u32>,
        /// Probe podlink only, without the direct path.
        #[arg(long, requires = "probe")]
        podlink_only: bool,
        /// Set kernel.bpf_stats_enabled during the probe and print the programs'
        /// cost per podlink run (the probes of one pod pair).
        #[arg(long, requires = "probe")]
        ebpf: bool,
        /// Pod pairs (--probe scaling, default 100, at most 120), pods (--probe
        /// enrollment, default 200, at most 2,000) or queries (--probe
        /// dns-forwarded, default 2,000).
        #[arg(long, requires = "probe")]
        count: Option<usize>,
        /// A shell command to start before the probe's runs (for xds-watch:
        /// before its changes), with the agents' process ids in $AGENTS
        /// (comma-separated); after the runs its process group gets SIGINT, and
        /// the probe waits for it.
        #[arg(long, requires = "probe")]
        hook: Option<String>,
        /// Run the soak instead (xtask/src/bench/soak.rs): 10,000 idle
        /// connections through the mesh and 1,000 new ones per second; the
        /// agents' memory, descriptors and TIME_WAIT sampled each minute; fails on
        /// any failed connection or growth after warm-up. With --markdown, writes
        /// the page's `## Soak` section.
        #[arg(long, conflicts_with_all = ["probe", "quick", "json", "repeat"])]
        soak: bool,
        /// The soak's length in minutes [default: 10].
        #[arg(long, requires = "soak")]
        minutes: Option<u64>,
    },
}

/// Where `cargo xtask test` runs the tests.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TestKernel {
    /// This machine's kernel.
    Host,
    /// A guest with Debian 12's 6.1.
    #[value(name = "6.1")]
    V6_1,
    /// A guest with Debian 12's backported 6.12.
    #[value(name = "6.12")]
    V6_12,
}

impl TestKernel {
    fn guest(self) -> Option<guest::Kernel> {
        match self {
            TestKernel::Host => None,
            TestKernel::V6_1 => Some(guest::Kernel::V6_1),
            TestKernel::V6_12 => Some(guest::Kernel::V6_12),
        }
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // The bench's flags are refused before setup installs or builds anything.
    let probe = match &cli.command {
        Cmd::Bench {
            repeat: Some(0), ..
        } => bail!("--repeat must be at least 1"),
        Cmd::Bench {
            probe: Some(row),
            repeat,
            seconds,
            podlink_only,
            ebpf,
            count,
            hook,
            ..
        } => {
            let o = bench::ProbeOptions {
                row: *row,
                repeat: repeat.unwrap_or(row.default_repeat()),
                seconds: *seconds,
                podlink_only: *podlink_only,
                ebpf: *ebpf,
                count: *count,
                hook: hook.clone(),
            };
            o.validate()?;
            Some(o)
        }
        _ => None,
    };
    setup::setup(match cli.command {
        Cmd::Setup | Cmd::ValidateDeploy | Cmd::Test { .. } => setup::Validator::Install,
        _ => setup::Validator::Skip,
    })?;
    match cli.command {
        Cmd::Setup => Ok(()),
        Cmd::BuildEbpf => build_ebpf(),
        Cmd::Build => build(),
        Cmd::Demo => {
            build()?;
            demo::run()
        }
        Cmd::ValidateDeploy => deploy::validate(),
        Cmd::Test { filter, kernel } => {
            let kernels = if kernel.is_empty() {
                vec![TestKernel::Host, TestKernel::V6_12, TestKernel::V6_1]
            } else {
                kernel
            };
            let guests: Vec<guest::Kernel> = kernels.iter().filter_map(|k| k.guest()).collect();
            // Installed first; a failure skips the guests, not the rest.
            let guest_setup = if guests.is_empty() {
                Ok(())
            } else {
                guest::setup().context("the guests' setup")
            };
            if let Err(e) = &guest_setup {
                eprintln!("{e:#}");
            }
            // First (seconds), but its failure does not keep the tests from
            // running: all are reported, and any fails the command.
            let deploy = deploy::validate();
            if let Err(e) = &deploy {
                eprintln!("validate-deploy failed: {e:#}");
            }
            build()?;
            let mut result = deploy.context("validate-deploy");
            if kernels.contains(&TestKernel::Host) {
                result = test(filter.as_deref()).and(result);
            }
            let guests = if guest_setup.is_ok() {
                guests
            } else {
                Vec::new()
            };
            result = result.and(guest_setup);
            for kernel in guests {
                let guest = guest::test(kernel, filter.as_deref())
                    .with_context(|| format!("the {} guest", kernel.name()));
                if let Err(e) = &guest {
                    eprintln!("{e:#}");
                }
                result = result.and(guest);
            }
            if kernels.contains(&TestKernel::Host) {
                let fuzzing =
                    fuzz::run_targets(filter.as_deref(), fuzz::SECONDS_IN_TEST, fuzz::Build::Quick)
                        .context("fuzzing");
                if let Err(e) = &fuzzing {
                    eprintln!("{e:#}");
                }
                result = result.and(fuzzing);
            }
            result
        }
        Cmd::Fuzz {
            seconds,
            target,
            dev,
        } => {
            let build = if dev {
                fuzz::Build::Quick
            } else {
                fuzz::Build::Optimized
            };
            fuzz::run_targets(target.as_deref(), seconds, build)
        }
        Cmd::SoakServer { netns, addr } => bench::soak_server(&netns, addr),
        Cmd::Bench {
            soak: true,
            minutes,
            markdown,
            ..
        } => {
            build()?;
            bench::run_soak(minutes, markdown.as_deref())
        }
        Cmd::Bench {
            repeat,
            json,
            markdown,
            quick,
            ..
        } => {
            build()?;
            bench::run(repeat, quick, json.as_deref(), markdown.as_deref(), probe)
        }
    }
}

/// The workspace root (the parent of `xtask/`). `cargo run` (the `xtask` alias)
/// names xtask's directory in `CARGO_MANIFEST_DIR` as it is now; the one built in
/// is used otherwise, and would be stale in a checkout moved since it was built.
pub fn project_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Project-local tools (bpf-linker and its LLVM links); ignored by git.
pub fn tools_dir() -> PathBuf {
    project_root().join(".tools")
}

/// Path of the eBPF object `build-ebpf` produces and the agent embeds.
pub fn ebpf_object() -> PathBuf {
    project_root().join("ebpf/target/bpfel-unknown-none/release/podlink-ebpf")
}

/// Path of a shipped binary of the workspace: built by [`build`] with the `dist`
/// profile (release with whole-program optimisation, see Cargo.toml).
pub fn dist_bin(name: &str) -> PathBuf {
    project_root().join("target/dist").join(name)
}

/// Runs a command, failing with its name and status.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// A `cargo` invocation for the host workspace with the stable toolchain, cleared
/// of the variables the outer `cargo run` set.
fn host_cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(project_root())
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO_TARGET_DIR");
    cmd
}

fn build_ebpf() -> Result<()> {
    let linker_dir = setup::bpf_linker_bin()
        .parent()
        .expect("bpf-linker has a directory")
        .to_path_buf();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![linker_dir];
    paths.extend(std::env::split_paths(&path));
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", "build", "--release"])
        .args(["-Z", "build-std=core", "--target", "bpfel-unknown-none"])
        .current_dir(project_root().join("ebpf"))
        .env("PATH", std::env::join_paths(paths)?)
        // Debug info becomes BTF; the maps' key and value types need it.
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            ["-C", "debuginfo=2", "-C", "link-arg=--btf"].join("\x1f"),
        )
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO_TARGET_DIR");
    run(&mut cmd).context("building the eBPF object")?;
    eprintln!("build-ebpf: {}", ebpf_object().display());
    Ok(())
}

fn build() -> Result<()> {
    build_ebpf()?;
    let mut cmd = host_cargo();
    cmd.args([
        "build",
        "--profile",
        "dist",
        "--package",
        "podlink-agent",
        "--bins",
    ])
    .env("PODLINK_EBPF_OBJECT", ebpf_object());
    run(&mut cmd).context("building the agent")
}

/// `cargo test --release` as `cargo xtask test` runs it: the guest tests build
/// their binaries with the same command, so that nothing is built twice.
fn cargo_test() -> Command {
    let mut cmd = host_cargo();
    cmd.args(["test", "--release"])
        .env("PODLINK_EBPF_OBJECT", ebpf_object())
        .env("PODLINK_BIN", dist_bin("podlink"));
    cmd
}

/// Unit tests of every crate and the end-to-end tests, in one release build (the
/// end-to-end tests run the shipped agent that `build` made, `dist` profile), then
/// the agent's unit tests that need root (`#[ignore = "needs root"]`). All tests
/// run even when one fails.
fn test(filter: Option<&str>) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the end-to-end tests create network namespaces, veths, bpffs mounts and BPF links: run as root"
        );
    }
    let tests = |args: &[&str]| {
        let mut cmd = cargo_test();
        cmd.arg("--no-fail-fast").args(args);
        cmd
    };
    let mut all = tests(&["--workspace"]);
    // The agent's unit tests that need root are ignored by a plain `cargo
    // test`; they run here, after the others.
    let mut root = tests(&["-p", "podlink-agent", "--lib"]);
    if let Some(f) = filter {
        all.arg(f);
        root.arg(f);
    }
    root.args(["--", "--ignored"]);
    let all = run(&mut all).context("tests");
    let root = run(&mut root).context("the agent's unit tests that need root");
    all.and(root)
}
