//! `cargo xtask fuzz`: runs the fuzz targets of `fuzz/` (cargo-fuzz, libFuzzer,
//! the nightly toolchain) for a bounded time each; `cargo xtask test` runs them
//! briefly after the other tests.
//!
//! * cargo-fuzz is installed into `.tools/cargo-fuzz/` when missing.
//! * All targets are built by one `cargo fuzz build` (into `target/fuzz/`),
//!   without a sanitizer (the agent denies `unsafe` outside `sys.rs`; panics, overflows,
//!   hangs and memory blow-ups are found all the same), with debug assertions:
//!   optimized for `cargo xtask fuzz`, unoptimized for `cargo xtask test`, whose
//!   build takes a fifth of the time and whose runs only need to replay the
//!   corpus and try a little (docs/development.md, "Fuzzing", has the figures).
//! * Each target runs on a scratch corpus, `target/fuzz/corpus/<target>/`, which
//!   starts from the committed seeds of `fuzz/corpus/<target>/` (read, never
//!   written) and keeps what it finds from run to run.
//! * A crash's input is written to `target/fuzz/artifacts/<target>/`; its path
//!   and the command that reproduces it are printed, and the command fails.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use crate::{project_root, run, tools_dir};

/// Seconds each target runs for by default.
pub const DEFAULT_SECONDS: u64 = 60;

/// Seconds each target runs for in `cargo xtask test` ([`Build::Quick`]):
/// enough to replay their corpus and try a little, short enough for CI.
pub const SECONDS_IN_TEST: u64 = 10;

/// How the targets are built.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// Optimized (`cargo fuzz build`'s default, release with debug assertions):
    /// for fuzzing.
    Optimized,
    /// Unoptimized (`--dev`): builds several times faster, runs tens of times
    /// slower; for `cargo xtask test`.
    Quick,
}

/// The cargo-fuzz release line installed.
const CARGO_FUZZ_VERSION: &str = "0.13";

/// libFuzzer's limit on one input's run, seconds: a slower one is reported as
/// a hang (`timeout-*` artifact).
const INPUT_TIMEOUT: u64 = 30;

/// Path of the project-local cargo-fuzz.
fn cargo_fuzz_bin() -> PathBuf {
    tools_dir().join("cargo-fuzz/bin/cargo-fuzz")
}

fn install_cargo_fuzz() -> Result<()> {
    if let Ok(out) = Command::new(cargo_fuzz_bin()).arg("--version").output()
        && out.status.success()
        && String::from_utf8_lossy(&out.stdout)
            .contains(&format!("cargo-fuzz {CARGO_FUZZ_VERSION}"))
    {
        return Ok(());
    }
    eprintln!("fuzz: installing cargo-fuzz {CARGO_FUZZ_VERSION} into .tools/ (about a minute)");
    let mut cmd = Command::new("cargo");
    // --locked: the dependency versions cargo-fuzz was released with.
    cmd.args(["install", "cargo-fuzz", "--locked", "--version"])
        .arg(format!("~{CARGO_FUZZ_VERSION}"))
        .arg("--root")
        .arg(tools_dir().join("cargo-fuzz"))
        .current_dir(project_root());
    run(&mut cmd).context("installing cargo-fuzz")
}

/// Where the fuzz build, the scratch corpora and the artifacts go.
fn fuzz_target_dir() -> PathBuf {
    project_root().join("target/fuzz")
}

/// The empty file the fuzz build embeds as the eBPF object (the targets load no
/// program): an object that exists keeps `agent/build.rs` from running, and the
/// agent from building, again on every build.
fn no_ebpf_object() -> PathBuf {
    fuzz_target_dir().join("no-ebpf-object")
}

/// The build options, which `build` and `run` must share (or `run` builds again).
fn build_options(build: Build) -> Vec<String> {
    let mut options: Vec<String> = ["--sanitizer", "none", "--target-dir"]
        .map(String::from)
        .into();
    options.push(fuzz_target_dir().display().to_string());
    if build == Build::Quick {
        options.push("--dev".into());
    }
    options
}

/// `cargo fuzz SUBCOMMAND` with the nightly toolchain (and the build options of
/// `build`, but for `list`).
fn cargo_fuzz(subcommand: &str, build: Build) -> Command {
    let mut cmd = Command::new(cargo_fuzz_bin());
    cmd.args(["fuzz", subcommand])
        .current_dir(project_root())
        .env("RUSTUP_TOOLCHAIN", "nightly")
        .env("PODLINK_EBPF_OBJECT", no_ebpf_object())
        .env_remove("RUSTC")
        .env_remove("CARGO_TARGET_DIR");
    if subcommand != "list" {
        cmd.args(build_options(build));
    }
    cmd
}

/// The command that replays `input` on `target`, to print.
fn reproduce_command(target: &str, input: &Path, build: Build) -> String {
    format!(
        "PATH=$PWD/.tools/cargo-fuzz/bin:$PATH PODLINK_EBPF_OBJECT={} cargo +nightly fuzz run {} {target} {}",
        no_ebpf_object().display(),
        build_options(build).join(" "),
        input.display()
    )
}

/// The fuzz targets (`cargo fuzz list`).
fn targets() -> Result<Vec<String>> {
    let out = cargo_fuzz("list", Build::Optimized)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo fuzz list")?;
    if !out.status.success() {
        bail!("cargo fuzz list failed: {}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// Builds the fuzz targets whose name contains `filter` (all without one) and
/// runs each for `seconds`; fails when any crashes (every one runs).
pub fn run_targets(filter: Option<&str>, seconds: u64, build: Build) -> Result<()> {
    install_cargo_fuzz()?;
    let targets: Vec<String> = targets()?
        .into_iter()
        .filter(|t| filter.is_none_or(|f| t.contains(f)))
        .collect();
    if targets.is_empty() {
        eprintln!("fuzz: no target matches {filter:?}");
        return Ok(());
    }
    fs::create_dir_all(fuzz_target_dir())?;
    if !no_ebpf_object().exists() {
        fs::write(no_ebpf_object(), [])?;
    }
    let started = Instant::now();
    let mut cmd = cargo_fuzz("build", build);
    if let [one] = targets.as_slice() {
        cmd.arg(one);
    }
    run(&mut cmd).context("building the fuzz targets")?;
    eprintln!(
        "fuzz: built in {:.0} s; running {} target(s), {seconds} s each",
        started.elapsed().as_secs_f64(),
        targets.len()
    );
    let mut crashed = Vec::new();
    for target in &targets {
        match run_target(target, seconds, build) {
            Ok(()) => {}
            Err(e) => {
                eprintln!("fuzz: {target}: {e:#}");
                crashed.push(target.as_str());
            }
        }
    }
    if !crashed.is_empty() {
        bail!("fuzz targets failed: {}", crashed.join(", "));
    }
    Ok(())
}

/// Runs one target for `seconds` on its scratch corpus; its output goes to
/// `target/fuzz/logs/<target>.log`.
fn run_target(target: &str, seconds: u64, build: Build) -> Result<()> {
    let root = fuzz_target_dir();
    let scratch = root.join("corpus").join(target);
    let artifacts = root.join("artifacts").join(target);
    let logs = root.join("logs");
    for dir in [&scratch, &artifacts, &logs] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let seeds = project_root().join("fuzz/corpus").join(target);
    let log_path = logs.join(format!("{target}.log"));
    let log =
        fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let before = listing(&artifacts)?;
    let started = Instant::now();
    let mut cmd = cargo_fuzz("run", build);
    // New inputs go to the first corpus directory; the seeds are only read.
    cmd.arg(target).arg(&scratch);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    cmd.arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-timeout={INPUT_TIMEOUT}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-print_final_stats=1")
        .stdout(log.try_clone()?)
        .stderr(log);
    let status = cmd
        .status()
        .with_context(|| format!("starting cargo fuzz run {target}"))?;
    let text = fs::read_to_string(&log_path).unwrap_or_default();
    let stat = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
            .map_or("?".to_string(), |v| v.trim().to_string())
    };
    eprintln!(
        "fuzz: {target}: {} executions in {:.0} s, corpus {} inputs ({})",
        stat("number_of_executed_units"),
        started.elapsed().as_secs_f64(),
        listing(&scratch)?.len(),
        if status.success() {
            "nothing found"
        } else {
            "FAILED"
        },
    );
    if status.success() {
        return Ok(());
    }
    let tail: Vec<&str> = text.lines().rev().take(40).collect();
    for line in tail.iter().rev() {
        eprintln!("  | {line}");
    }
    let found: Vec<PathBuf> = listing(&artifacts)?
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    for input in &found {
        eprintln!(
            "fuzz: {target}: input {}\n      reproduce: {}",
            input.display(),
            reproduce_command(target, input, build)
        );
    }
    bail!(
        "{status} ({} new artifact(s); whole output in {})",
        found.len(),
        log_path.display()
    )
}

/// The files of `dir`.
fn listing(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        files.push(entry?.path());
    }
    Ok(files)
}
