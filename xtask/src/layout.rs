//! `cargo xtask layout`: regenerates `agent/symbol-order.txt`, the order in which
//! the linker lays out the `podlink` binary's functions and data (lld's
//! `--symbol-ordering-file`, applied by `agent/build.rs`).
//!
//! The kernel maps a binary's code into a process in blocks of up to 64 KiB around
//! each page fault (`fault_around_bytes`), so code the agent runs, scattered among
//! code it never runs, keeps most of the binary resident. Laid out together, what
//! the agent runs fits in far fewer blocks.
//!
//! What the agent runs is read from the test bed, at function granularity:
//!
//! 1. The agent is built with every function aligned to a page of its own
//!    (`-C llvm-args=-align-all-functions=12`, only on the final crate's invocation,
//!    where fat LTO makes all the code: the symbol names stay those of the shipped
//!    build).
//! 2. That binary is run from an ext4 image mounted with read-ahead 0 and an empty
//!    page cache: a page fault then reads one page, and fault-around maps only the
//!    pages already read, so a resident page is a page the agent touched.
//! 3. The bench's test bed carries each kind of its traffic (`bench::exercise`);
//!    the resident pages of both agents (`/proc/<pid>/pagemap`) name the functions
//!    that ran, and the data on the pages read.
//! 4. Those symbols, in their present address order, are written to the order
//!    file, and the agent is built again with it.
//!
//! Run it after a toolchain or dependency update (symbol names change with them;
//! names the linker does not find are ignored, so a stale file only loses the
//! gain) or a large change of the agent. Needs root (mounts, the test bed).

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{bench, build, dist_bin, ebpf_object, host_cargo, project_root, run};

/// Page size of the layout (x86-64).
const PAGE: u64 = 4096;

/// The order file `agent/build.rs` hands to the linker.
pub fn order_file() -> PathBuf {
    project_root().join("agent/symbol-order.txt")
}

/// Profiles the agent on the test bed and writes [`order_file`], then builds the
/// agent with it (see the module documentation).
pub fn layout() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("layout mounts a file system image and runs the test bed: run as root");
    }
    build()?;
    eprintln!("layout: building podlink with every function on a page of its own");
    let mut cmd = host_cargo();
    cmd.args(["rustc", "--profile", "dist", "--package", "podlink-agent"])
        .args(["--bin", "podlink", "--"])
        .args(["-C", "llvm-args=-align-all-functions=12"])
        .env("PODLINK_EBPF_OBJECT", ebpf_object());
    run(&mut cmd).context("building the page-aligned agent")?;
    let aligned = project_root().join("target/layout/podlink");
    fs::create_dir_all(aligned.parent().expect("a directory"))?;
    fs::copy(dist_bin("podlink"), &aligned).context("keeping the page-aligned agent")?;

    let image = ColdImage::new(
        &project_root().join("target/layout/fs.img"),
        &[&aligned, &dist_bin("podlink-cni")],
    )?;
    let bin = image.dir.join("podlink");
    // SAFETY: no other thread of xtask reads the environment while this runs (the
    // test bed's threads start later).
    unsafe { std::env::set_var("PODLINK_BIN", &bin) };
    eprintln!("layout: running the test bed's traffic");
    let pages = bench::exercise(|pids| {
        let mut pages = BTreeSet::new();
        for &pid in pids {
            let mine = resident_pages(pid, &bin)?;
            eprintln!(
                "layout: agent {pid} touched {} pages of the binary",
                mine.len()
            );
            pages.extend(mine);
        }
        Ok(pages)
    })?;
    drop(image);

    let symbols = symbols_on(&aligned, &pages)?;
    let text: u64 = symbols.iter().filter(|s| s.code).map(|s| s.size).sum();
    let data: u64 = symbols.iter().filter(|s| !s.code).map(|s| s.size).sum();
    let order: String = symbols.iter().map(|s| format!("{}\n", s.name)).collect();
    fs::write(order_file(), order)
        .with_context(|| format!("writing {}", order_file().display()))?;
    eprintln!(
        "layout: {} symbols ({} KiB of code, {} KiB of data) written to {}",
        symbols.len(),
        text / 1024,
        data / 1024,
        order_file().display()
    );
    eprintln!("layout: building the agent with the new order");
    build()
}

/// An ext4 image mounted (loop) with read-ahead 0 and nothing of it cached: the
/// files given are copied in, then the image is mounted again, which drops their
/// pages. Unmounted and removed on drop.
struct ColdImage {
    image: PathBuf,
    dir: PathBuf,
}

impl ColdImage {
    fn new(image: &Path, files: &[&Path]) -> Result<Self> {
        let size: u64 = files
            .iter()
            .map(|f| fs::metadata(f).map(|m| m.len()))
            .sum::<std::io::Result<u64>>()?;
        let dir = image.with_extension("mnt");
        fs::create_dir_all(&dir)?;
        let file = fs::File::create(image)?;
        file.set_len(size + (64 << 20))?;
        drop(file);
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image))?;
        let cold = Self {
            image: image.to_path_buf(),
            dir,
        };
        cold.mount()?;
        for f in files {
            let name = f.file_name().context("a file name")?;
            fs::copy(f, cold.dir.join(name)).with_context(|| format!("copying {}", f.display()))?;
        }
        run(Command::new("umount").arg(&cold.dir))?;
        cold.mount()?;
        Ok(cold)
    }

    fn mount(&self) -> Result<()> {
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&self.image)
            .arg(&self.dir))?;
        let out = Command::new("findmnt")
            .args(["-n", "-o", "SOURCE"])
            .arg(&self.dir)
            .output()?;
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let name = Path::new(&device)
            .file_name()
            .with_context(|| format!("no loop device for {}", self.dir.display()))?;
        let knob = Path::new("/sys/block")
            .join(name)
            .join("queue/read_ahead_kb");
        fs::write(&knob, "0").with_context(|| format!("writing {}", knob.display()))
    }
}

impl Drop for ColdImage {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = fs::remove_dir(&self.dir);
        let _ = fs::remove_file(&self.image);
    }
}

/// The link-time addresses of the pages of `exe` resident in process `pid`
/// (`/proc/<pid>/pagemap`: bit 63 present, bit 62 swapped; kernel documentation
/// `admin-guide/mm/pagemap.rst`).
fn resident_pages(pid: u32, exe: &Path) -> Result<BTreeSet<u64>> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let exe = exe.to_string_lossy();
    // (start, end, file offset) of each mapping of the binary.
    let mut mappings = Vec::new();
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 6 || fields[5] != exe {
            continue;
        }
        let (start, end) = fields[0].split_once('-').context("a maps range")?;
        let hex = |v: &str| u64::from_str_radix(v, 16).context("a hex number");
        mappings.push((hex(start)?, hex(end)?, hex(fields[2])?));
    }
    // The first segment is at address 0 of the file and of the image (lld's
    // layout), so the load bias is the smallest start less offset.
    let bias = mappings
        .iter()
        .map(|(start, _, offset)| start - offset)
        .min()
        .with_context(|| format!("process {pid} has no mapping of {exe}"))?;
    let mut file = fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut pages = BTreeSet::new();
    for (start, end, _) in mappings {
        use std::io::{Read, Seek, SeekFrom};
        let count = ((end - start) / PAGE) as usize;
        let mut entries = vec![0u8; count * 8];
        file.seek(SeekFrom::Start(start / PAGE * 8))?;
        file.read_exact(&mut entries)?;
        for (i, entry) in entries.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
            if v >> 62 != 0 {
                pages.insert(start - bias + i as u64 * PAGE);
            }
        }
    }
    Ok(pages)
}

/// A symbol of the binary.
struct Symbol {
    name: String,
    size: u64,
    code: bool,
}

/// The symbols of `binary` (`nm`) on any of `pages`, in address order, each name
/// once.
fn symbols_on(binary: &Path, pages: &BTreeSet<u64>) -> Result<Vec<Symbol>> {
    let out = Command::new("nm")
        .args(["-S", "--defined-only"])
        .arg(binary)
        .output()
        .context("running nm (binutils)")?;
    if !out.status.success() {
        bail!(
            "nm {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(symbols_on_pages(
        &String::from_utf8_lossy(&out.stdout),
        pages,
    ))
}

/// The symbols of `nm -S` output (`address size kind name`, hexadecimal) with a
/// byte on any of `pages`, in address order, each name once. Lines without a size
/// (absolute and undefined symbols) are skipped.
fn symbols_on_pages(nm: &str, pages: &BTreeSet<u64>) -> Vec<Symbol> {
    let mut by_address = BTreeMap::new();
    let mut seen = HashSet::new();
    for line in nm.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [address, size, kind, name] = fields[..] else {
            continue;
        };
        let (Ok(address), Ok(size)) = (
            u64::from_str_radix(address, 16),
            u64::from_str_radix(size, 16),
        ) else {
            continue;
        };
        if size == 0 {
            continue;
        }
        let first = address / PAGE * PAGE;
        let touched = pages.range(first..address + size).next().is_some();
        if touched && seen.insert(name) {
            by_address.insert(
                (address, name),
                Symbol {
                    name: name.to_string(),
                    size,
                    code: matches!(kind, "t" | "T" | "w" | "W"),
                },
            );
        }
    }
    by_address.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_are_those_on_touched_pages_in_address_order() {
        let nm = "\
0000000000003000 0000000000000010 t cold_fn
0000000000002ff0 0000000000000020 t spans_into_page_3
0000000000001000 0000000000000100 T hot_fn
0000000000001800 0000000000000008 r hot_data
0000000000004000 0000000000000000 t no_size
0000000000005000 0000000000000010 t hot_fn
                 w weak_undefined
";
        // Pages 0x1000 and 0x2000 were touched; 0x3000 and 0x4000 were not.
        let pages = BTreeSet::from([0x1000, 0x2000]);
        let symbols = symbols_on_pages(nm, &pages);
        let names: Vec<&str> = symbols.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["hot_fn", "hot_data", "spans_into_page_3"]);
        assert!(symbols[0].code && !symbols[1].code);
        assert_eq!(symbols[2].size, 0x20);
    }
}
