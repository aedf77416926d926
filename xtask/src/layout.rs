//! `cargo xtask layout`: regenerates `agent/symbol-order.txt`, the order in which
//! the linker lays out the `podlink` binary's functions and data (lld's
//! `--symbol-ordering-file`, applied by `agent/build.rs` when `cargo xtask build`
//! asks for it).
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
//!    where fat LTO generates the Rust code: the symbol names stay those of the
//!    shipped build).
//! 2. That binary is run from an ext4 image on a loop device with read-ahead 0 and
//!    an empty page cache: a page fault then reads one page, and fault-around maps
//!    only the pages already read, so a resident page is a page the agent touched.
//! 3. The bench's test bed carries each kind of its traffic (`bench::exercise`,
//!    manifests mode), then a second bed whose agents watch an API server double
//!    (Kubernetes mode, as deployed); the resident pages of every agent
//!    (`/proc/<pid>/pagemap`) name the functions that ran, and the data on the
//!    pages read or relocated.
//! 4. Those symbols, in their present address order, are written to the order
//!    file, and the agent is built again with it.
//!
//! Run it after a toolchain or dependency update (symbol names change with them;
//! names the linker does not find are ignored, so a stale file only loses the
//! gain) or a large change of the agent. Needs root (loop devices, the test bed).

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fs,
    io::{Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use podlink_tests::{
    Cluster, PodSpec,
    api_double::{ApiServer, namespace_object, pod_object},
    app, netns,
};

use crate::{bench, build, dist_bin, ebpf_object, host_cargo, project_root, run};

/// Page size of the layout (x86-64), bytes.
const PAGE_SIZE: u64 = 4096;

/// The order file `agent/build.rs` hands to the linker.
pub fn order_file() -> PathBuf {
    project_root().join("agent/symbol-order.txt")
}

/// The image's mount point and loop device while they exist, for the Ctrl-C
/// handler.
static MOUNTED: Mutex<Option<(PathBuf, String)>> = Mutex::new(None);

/// Profiles the agent on the test bed and writes [`order_file`], then builds the
/// agent with it (see the module documentation). The shipped binaries are built
/// again whatever happened, so that `target/dist/podlink` is never left
/// page-aligned.
pub fn layout() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("layout uses a loop device and runs the test bed: run as root");
    }
    build()?;
    let work = project_root().join("target/layout");
    fs::create_dir_all(&work)?;
    let image = work.join("fs.img");
    let mount_point = work.join("fs.mnt");
    remove_stale_image(&image, &mount_point);
    let aligned = work.join("podlink");
    let cni = dist_bin("podlink-cni");
    let bin = mount_point.join("podlink");
    // SAFETY: xtask is single-threaded here (the Ctrl-C handler's thread starts
    // below, the test bed's later); the test bed runs the agent it names.
    unsafe { std::env::set_var("PODLINK_BIN", &bin) };
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: cleaning up");
        netns::cleanup();
        if let Some((dir, device)) = MOUNTED.lock().ok().and_then(|m| m.clone()) {
            let _ = Command::new("umount").arg("-l").arg(&dir).status();
            let _ = Command::new("losetup").arg("-d").arg(&device).status();
        }
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;

    let profiled = (|| {
        build_page_aligned(&aligned)?;
        let cold = ColdImage::new(&image, &mount_point, &[&aligned, &cni])?;
        let bin = fs::canonicalize(&bin)?;
        let bias = first_load_address(&bin)?;
        let mut pages = BTreeSet::new();
        let mut record = |pids: &[u32]| -> Result<()> {
            for &pid in pids {
                let mine = resident_pages(pid, &bin, bias)?;
                eprintln!(
                    "layout: agent {pid} touched {} pages of the binary",
                    mine.len()
                );
                pages.extend(mine);
            }
            Ok(())
        };
        eprintln!("layout: the bench's traffic, manifests mode");
        bench::exercise(&mut record)?;
        eprintln!("layout: agents watching an API server double (Kubernetes mode)");
        exercise_kubernetes(&mut record)?;
        drop(cold);
        let symbols = symbols_on(&aligned, &pages)?;
        ensure!(
            symbols.iter().any(|s| s.code),
            "no function of {} is on the pages the agents touched: the profile is wrong",
            aligned.display()
        );
        let code: u64 = symbols.iter().filter(|s| s.code).map(|s| s.size).sum();
        let data: u64 = symbols.iter().filter(|s| !s.code).map(|s| s.size).sum();
        let order: String = symbols.iter().map(|s| format!("{}\n", s.name)).collect();
        fs::write(order_file(), order)
            .with_context(|| format!("writing {}", order_file().display()))?;
        eprintln!(
            "layout: {} symbols ({} KiB of code, {} KiB of data) written to {}",
            symbols.len(),
            code / 1024,
            data / 1024,
            order_file().display()
        );
        Ok(())
    })();
    // SAFETY: the test bed's threads are gone (`exercise` joins them); the Ctrl-C
    // handler's thread does not read the environment.
    unsafe { std::env::remove_var("PODLINK_BIN") };
    eprintln!("layout: building the shipped agent with the order file");
    let built = build();
    profiled?;
    built
}

/// Builds `podlink` with every function on a page of its own, without the current
/// order (which would otherwise shape the next one), and keeps it at `to`.
fn build_page_aligned(to: &Path) -> Result<()> {
    eprintln!("layout: building podlink with every function on a page of its own");
    let mut cmd = host_cargo();
    cmd.args(["rustc", "--profile", "dist", "--package", "podlink-agent"])
        .args(["--bin", "podlink", "--"])
        .args(["-C", "llvm-args=-align-all-functions=12"])
        .env("PODLINK_EBPF_OBJECT", ebpf_object())
        .env_remove("PODLINK_SYMBOL_ORDER");
    run(&mut cmd).context("building the page-aligned agent")?;
    fs::copy(dist_bin("podlink"), to).context("keeping the page-aligned agent")?;
    Ok(())
}

/// A two-node bed whose agents watch an API server double: two pods of an ambient
/// namespace talk across the nodes, the metrics are scraped, one pod is deleted;
/// then `inspect` gets the agents' process ids.
fn exercise_kubernetes(inspect: impl FnOnce(&[u32]) -> Result<()>) -> Result<()> {
    let result = (|| {
        let mut c = Cluster::new(2)?;
        let api = ApiServer::start()?;
        for node in 0..2 {
            let addr = api.listen_in(&c.nodes[node].netns)?;
            let kubeconfig = c.dir.join(format!("kubeconfig-{node}"));
            api.write_kubeconfig(addr, &kubeconfig)?;
            c.start_agent_with(node, &["--kubeconfig", &kubeconfig.to_string_lossy()])?;
        }
        api.apply_namespace(namespace_object("mesh", true))?;
        let mut pods = Vec::new();
        for (name, node) in [("client", 0), ("server", 1)] {
            let pod = c.add_pod_unlisted(PodSpec::new(name, "mesh", node))?;
            api.apply_pod(pod_object(&c, &pod))?;
            pods.push(pod);
        }
        let (client, server) = (&pods[0], &pods[1]);
        c.wait_all_captured(&[client, server])?;
        let _echo = app::EchoServer::start(&server.netns, server.addr(8000))?;
        for _ in 0..100 {
            app::exchange(&client.netns, server.addr(8000), b"layout")?;
        }
        for node in 0..2 {
            c.metrics(node)?;
        }
        api.delete_pod("mesh", "client")?;
        c.wait_captured(client, false)?;
        std::thread::sleep(Duration::from_secs(1));
        let pids: Vec<u32> = (0..2).filter_map(|n| c.agent_pid(n)).collect();
        inspect(&pids)
    })();
    netns::cleanup();
    result
}

/// Unmounts and detaches what an interrupted run left of the image.
fn remove_stale_image(image: &Path, mount_point: &Path) {
    let _ = Command::new("umount").arg(mount_point).status();
    if let Ok(out) = Command::new("losetup").arg("-j").arg(image).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some((device, _)) = line.split_once(':') {
                let _ = Command::new("losetup").arg("-d").arg(device).status();
            }
        }
    }
    let _ = fs::remove_file(image);
}

/// An ext4 image on a loop device with read-ahead 0, mounted with nothing of it
/// cached: the files given are copied in, then it is mounted again, which drops
/// their pages. Unmounted, detached and removed on drop.
struct ColdImage {
    /// The image file.
    image: PathBuf,
    /// Its mount point.
    dir: PathBuf,
    /// The loop device (`/dev/loopN`), once attached.
    device: Option<String>,
    /// Whether it is mounted now.
    mounted: bool,
}

impl ColdImage {
    fn new(image: &Path, dir: &Path, files: &[&Path]) -> Result<Self> {
        let mut cold = Self {
            image: image.to_path_buf(),
            dir: dir.to_path_buf(),
            device: None,
            mounted: false,
        };
        let size: u64 = files
            .iter()
            .map(|f| fs::metadata(f).map(|m| m.len()))
            .sum::<std::io::Result<u64>>()?;
        fs::create_dir_all(dir)?;
        fs::File::create(image)?.set_len(size + (64 << 20))?;
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image))?;
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(image)
            .output()
            .context("running losetup")?;
        ensure!(
            out.status.success(),
            "losetup {}: {}",
            image.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        cold.device = Some(device.clone());
        let name = Path::new(&device)
            .file_name()
            .context("a loop device name")?;
        let knob = Path::new("/sys/block")
            .join(name)
            .join("queue/read_ahead_kb");
        fs::write(&knob, "0").with_context(|| format!("writing {}", knob.display()))?;
        cold.mount()?;
        for f in files {
            let name = f.file_name().context("a file name")?;
            fs::copy(f, dir.join(name)).with_context(|| format!("copying {}", f.display()))?;
        }
        cold.unmount()?;
        cold.mount()?;
        Ok(cold)
    }

    fn mount(&mut self) -> Result<()> {
        let device = self.device.as_deref().context("no loop device")?;
        run(Command::new("mount").arg(device).arg(&self.dir))?;
        self.mounted = true;
        *MOUNTED.lock().expect("mount lock") = Some((self.dir.clone(), device.to_string()));
        Ok(())
    }

    fn unmount(&mut self) -> Result<()> {
        run(Command::new("umount").arg(&self.dir))?;
        self.mounted = false;
        Ok(())
    }
}

impl Drop for ColdImage {
    fn drop(&mut self) {
        // A process still holding a file (an agent that did not exit) keeps it
        // busy: detach it lazily then.
        if self.mounted && self.unmount().is_err() {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
        if let Some(device) = &self.device {
            let _ = Command::new("losetup").arg("-d").arg(device).status();
        }
        *MOUNTED.lock().expect("mount lock") = None;
        let _ = fs::remove_dir(&self.dir);
        let _ = fs::remove_file(&self.image);
    }
}

/// The virtual address of the first loadable segment of ELF file `binary`, which
/// must be at file offset 0 (as lld lays out executables): its runtime address
/// less this is the load bias.
fn first_load_address(binary: &Path) -> Result<u64> {
    let mut file = fs::File::open(binary)?;
    let mut header = [0u8; 64];
    file.read_exact(&mut header)?;
    ensure!(
        header[..4] == *b"\x7fELF" && header[4] == 2 && header[5] == 1,
        "{} is not a little-endian 64-bit ELF file",
        binary.display()
    );
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let (phoff, phentsize, phnum) = (
        u64_at(&header, 0x20),
        u16_at(&header, 0x36) as usize,
        u16_at(&header, 0x38) as usize,
    );
    ensure!(phentsize >= 56, "{}: odd program headers", binary.display());
    let mut headers = vec![0u8; phentsize * phnum];
    file.seek(SeekFrom::Start(phoff))?;
    file.read_exact(&mut headers)?;
    const PT_LOAD: u32 = 1;
    let load = headers
        .chunks_exact(phentsize)
        .find(|h| u32::from_le_bytes(h[..4].try_into().unwrap()) == PT_LOAD)
        .with_context(|| format!("{} has no loadable segment", binary.display()))?;
    let (offset, vaddr) = (u64_at(load, 8), u64_at(load, 16));
    ensure!(
        offset == 0,
        "{}: the first loadable segment is not at file offset 0",
        binary.display()
    );
    Ok(vaddr)
}

/// The link-time addresses of the pages of `exe` resident in process `pid`
/// (`/proc/<pid>/pagemap`: bit 63 present, bit 62 swapped; kernel documentation
/// `admin-guide/mm/pagemap.rst`). `first_load` is the address of the segment at
/// file offset 0.
fn resident_pages(pid: u32, exe: &Path, first_load: u64) -> Result<BTreeSet<u64>> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let exe = exe.to_string_lossy();
    // (start, end, file offset) of each mapping of the binary.
    let mut mappings = Vec::new();
    for line in maps.lines() {
        let mut fields = line.splitn(6, ' ');
        let (Some(range), _, Some(offset), _, _, Some(path)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        if path.trim_start() != exe {
            continue;
        }
        let hex = |v: &str| u64::from_str_radix(v, 16).context("a hex number in maps");
        let (start, end) = range.split_once('-').context("a maps range")?;
        mappings.push((hex(start)?, hex(end)?, hex(offset)?));
    }
    let bias = mappings
        .iter()
        .find(|(_, _, offset)| *offset == 0)
        .map(|(start, _, _)| start - first_load)
        .with_context(|| format!("process {pid} has no mapping of {exe} at offset 0"))?;
    let mut pagemap = fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut pages = BTreeSet::new();
    for (start, end, _) in mappings {
        let mut entries = vec![0u8; ((end - start) / PAGE_SIZE) as usize * 8];
        pagemap.seek(SeekFrom::Start(start / PAGE_SIZE * 8))?;
        pagemap.read_exact(&mut entries)?;
        for (i, entry) in entries.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
            if v >> 62 != 0 {
                pages.insert(start - bias + i as u64 * PAGE_SIZE);
            }
        }
    }
    Ok(pages)
}

/// A symbol of the binary.
struct Symbol {
    name: String,
    size: u64,
    /// In a code section (`nm` kinds `t`, `T`).
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
        let first = address / PAGE_SIZE * PAGE_SIZE;
        let touched = pages.range(first..address + size).next().is_some();
        if touched && seen.insert(name) {
            by_address.insert(
                (address, name),
                Symbol {
                    name: name.to_string(),
                    size,
                    code: matches!(kind, "t" | "T"),
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

    #[test]
    fn the_first_load_address_is_read_from_the_program_headers() {
        // This very test binary: an executable whose first PT_LOAD is at offset 0.
        let exe = std::env::current_exe().unwrap();
        let vaddr = first_load_address(&exe).unwrap();
        assert_eq!(vaddr % PAGE_SIZE, 0);
        let not_elf = tempfile_with(b"#!/bin/sh\n");
        let err = first_load_address(&not_elf).unwrap_err();
        assert!(
            err.to_string().contains("not a little-endian 64-bit ELF"),
            "{err}"
        );
        let _ = fs::remove_file(not_elf);
    }

    fn tempfile_with(bytes: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("layout-test-{}", std::process::id()));
        let mut padded = bytes.to_vec();
        padded.resize(64, 0);
        fs::write(&path, padded).unwrap();
        path
    }
}
