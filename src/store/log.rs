//! The embedded engine: per-core append logs and snapshots in the data dir.
//!
//! Files (`E` epoch, `C` core, `G` generation):
//! - `LOCK`: held with `flock` for the life of the process (one owner per data dir);
//! - `MANIFEST`: `hubcast-store 1`, the epoch and the core count the files belong to, and each
//!   core's current snapshot (`snap C G`: a snapshot it names must be there);
//! - `eE-cC-G.log`: core C's commits, one CRC-checked frame each, written with one `pwrite`;
//! - `eE-cC-G.snap`: core C's whole state when log `G` was started (logs before `G` are replaced);
//! - `eE-cC.spare`: the newest log core C's last snapshot replaced, kept to be written over.
//!
//! **Durability.** A commit is one `write` of one frame: once it returns, the commit survives
//! a crash of the process (`kill -9`); the `hubcast-store-sync` thread `fdatasync`s every
//! core's log every `--fsync-interval` ms, so a power loss costs at most that much.
//!
//! **Snapshots** replace the logs when they have grown past `--snapshot-log-bytes`
//! ([`SNAPSHOT_MIN_LOG`]) and twice the last snapshot. The core starts a new log (the finished
//! log's sync is left to the sync or snapshot thread, [`SyncSlot::retired`]), encodes its state
//! into memory a slice per turn (src/app/durable.rs), then a helper thread syncs the finished
//! log (unless the sync thread did) and the new log (it holds what changed while the slices
//! were written), writes `…snap.tmp`, syncs it, renames it, names it in the manifest, makes the
//! newest log it replaced the core's spare and deletes the older files. A crash at any step
//! leaves either the old snapshot and logs or the new ones; logs older than the snapshot the
//! manifest names are not read.
//!
//! **Logs used again.** Under a steady ingest load a core fills a 64 MiB log about every
//! second; deleting it freed 16 k page-cache pages and their blocks each time, and every commit
//! was written into new pages (issue 25 item 4: 2.1–2.3 % and ~5 % of the CPU). Now the next
//! snapshot point writes its log over the spare from the start (its header and an end mark of
//! the new generation first, then its new name): the pages are allocated and cached, and
//! nothing is freed. Frames of a log of format version 6 carry its generation and a commit
//! written before older bytes ends with an end mark ([`format`]'s docs), so a start reads a
//! used-again log to its end mark and never takes an older log's frame for one of its own. A
//! start deletes the spares an earlier run left (their frames' generations are not known).
//!
//! **Recovery.** Damage at rest is never silently survived. The one damage a start expects is a
//! log whose last commit a crash cut off (a bad frame with no valid frame of its own after it,
//! see [`format::scan_framed`]): the commits before it are loaded, a WARN line says so. Since the
//! core leaves a finished log's sync to another thread, a power loss may also keep a newer
//! log's commits while losing the finished log's tail (the kernel wrote the new pages back
//! first): each log's first commit names where the log before it ended, and a start that finds
//! that log shorter (or missing) loads it to where it ends and not the logs after it (kept
//! aside as `<name>.damaged-<ms>`, logged at `error`): those commits were never synced either,
//! so the loss stays within `--fsync-interval`, and no later commit (an AMQP position mark
//! among them) is loaded over the hole ([`load_core`]). Anything else (a
//! bad frame followed by valid ones, in a log or a snapshot; a cut-off snapshot; a bad or
//! missing manifest; a snapshot the manifest names missing; a bad header) stops the start
//! naming the file, the offset and what to do, unless `--store-start-damaged`
//! ([`Options::start_damaged`]): then the damaged files are renamed aside
//! (`<name>.damaged-<ms>`), the valid frames loaded, each damaged core's state written as a new
//! snapshot, and the loss logged and counted ([`STATS`]). Writing always goes on in a new log.
//! A file of another format version is refused by name, never guessed at.
//!
//! **Re-sharding.** When `--cores` differs from the manifest, every core's files are read,
//! their records are routed to the new cores by the routing hash, written as snapshots of a
//! new epoch, and the manifest is switched atomically (rename) before the old files are removed.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::format::{self, Change, Tail, KIND_LOG, KIND_SNAPSHOT};
use super::{Loaded, Opened, Options, StateStore};
use crate::ids::{core_of_device, core_of_session};

/// A turn of writing a snapshot longer than this is counted as slow.
pub const SLOW_SLICE: Duration = Duration::from_millis(10);

/// Logs smaller than this are never compacted.
pub const SNAPSHOT_MIN_LOG: u64 = 64 << 20;

/// Disk space a log reserves ahead of its end (`fallocate` with `FALLOC_FL_KEEP_SIZE`), a step
/// at a time. A commit appended into reserved blocks costs the kernel about a third less than
/// one that makes ext4 reserve and later allocate its blocks (delayed allocation), per write
/// and again at the sync (issue 25 item 4, docs/benchmarks/2026-11-28-ingest-store.md). The
/// file's size is still its last whole commit (what a start reads); the reserved blocks past it
/// are given back when the log is deleted after a snapshot, or cut off by a failed write's
/// truncation. At most this much disk per core beyond the logs' bytes.
pub const LOG_RESERVE: u64 = 8 << 20;
const MANIFEST: &str = "MANIFEST";
const MANIFEST_HEAD: &str = "hubcast-store 1";

/// Process-wide store counters (read by `/metrics` and by tests).
pub static STATS: StoreStats = StoreStats {
    commits: AtomicU64::new(0),
    bytes: AtomicU64::new(0),
    synced_commits: AtomicU64::new(0),
    write_errors: AtomicU64::new(0),
    snapshots: AtomicU64::new(0),
    snapshot_slices: AtomicU64::new(0),
    snapshot_slow_slices: AtomicU64::new(0),
    damaged_files: AtomicU64::new(0),
    dropped_bytes: AtomicU64::new(0),
    dropped_devices: AtomicU64::new(0),
};

pub struct StoreStats {
    /// Commits written to the OS.
    pub commits: AtomicU64,
    pub bytes: AtomicU64,
    /// Commits known to be on disk (fsync done after them).
    pub synced_commits: AtomicU64,
    pub write_errors: AtomicU64,
    pub snapshots: AtomicU64,
    /// Turns of a core spent writing a snapshot, and those that took over [`SLOW_SLICE`] (the
    /// longest of each snapshot is in its "store snapshot encoded" log line).
    pub snapshot_slices: AtomicU64,
    pub snapshot_slow_slices: AtomicU64,
    /// Damage the start found and went past (`--store-start-damaged`): files kept aside, bytes
    /// left out, devices a damaged snapshot announced and did not yield.
    pub damaged_files: AtomicU64,
    pub dropped_bytes: AtomicU64,
    pub dropped_devices: AtomicU64,
}

impl StoreStats {
    /// A core spent `took` in one turn of writing a snapshot.
    pub fn snapshot_slice(&self, took: Duration) {
        self.snapshot_slices.fetch_add(1, Ordering::Relaxed);
        if took > SLOW_SLICE {
            self.snapshot_slow_slices.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn series(&self) -> crate::metrics::ExternalSeries {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("hubcast_store_commits_total", "Units of state committed to the store logs (written to the OS).", get(&self.commits)),
            ("hubcast_store_bytes_written_total", "Bytes appended to the store logs.", get(&self.bytes)),
            ("hubcast_store_synced_commits", "Commits known to be on disk (synced after them).", get(&self.synced_commits)),
            ("hubcast_store_write_errors_total", "Failed writes or syncs of the store.", get(&self.write_errors)),
            ("hubcast_store_snapshots_total", "Store snapshots written.", get(&self.snapshots)),
            ("hubcast_store_snapshot_slices_total", "Turns of a core spent writing a snapshot (a slice of its devices each).", get(&self.snapshot_slices)),
            (
                "hubcast_store_snapshot_slow_slices_total",
                "Turns of writing a snapshot that kept a core from its other work for over 10 ms.",
                get(&self.snapshot_slow_slices),
            ),
            (
                "hubcast_store_damaged_files",
                "Damaged or missing store files this start went past (--store-start-damaged), and logs it did not load after a hole a power loss left; each kept aside as <name>.damaged-<time>.",
                get(&self.damaged_files),
            ),
            ("hubcast_store_dropped_bytes", "Bytes of damaged store files left out at this start.", get(&self.dropped_bytes)),
            (
                "hubcast_store_dropped_devices",
                "Devices damaged snapshots announced but did not yield at this start (newer log records may have restored some).",
                get(&self.dropped_devices),
            ),
        ]
        .into_iter()
        .map(|(name, help, v)| (name.to_string(), help.to_string(), String::new(), v))
        .collect()
    }
}

/// The `flock` on `LOCK`; released when the last store of the process is dropped.
pub struct DirLock {
    _file: File,
}

/// Creates `dir` if needed and takes its lock (one owner per data dir).
pub fn lock_dir(dir: &Path) -> Result<DirLock, String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create data dir {}: {e}", dir.display()))?;
    let path = dir.join("LOCK");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| format!("data dir {}: cannot open {}: {e}", dir.display(), path.display()))?;
    // Safety: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = fs::read_to_string(&path).unwrap_or_default();
        let holder = holder.trim();
        return Err(format!(
            "data dir {} is in use by another hubcast{}: one data dir has one owner (give this instance its own --data-dir)",
            dir.display(),
            if holder.is_empty() { String::new() } else { format!(" (pid {holder})") }
        ));
    }
    let _ = file.set_len(0);
    let _ = write!(file, "{}", std::process::id());
    Ok(DirLock { _file: file })
}

fn file_name(epoch: u64, core: usize, gen: u64, ext: &str) -> String {
    format!("e{epoch}-c{core}-{gen:010}.{ext}")
}

/// `eE-cC-G.ext` → (E, C, G, ext)
fn parse_name(name: &str) -> Option<(u64, usize, u64, &str)> {
    let (stem, ext) = name.rsplit_once('.')?;
    let mut parts = stem.splitn(3, '-');
    let epoch = parts.next()?.strip_prefix('e')?.parse().ok()?;
    let core = parts.next()?.strip_prefix('c')?.parse().ok()?;
    let gen = parts.next()?.parse().ok()?;
    Some((epoch, core, gen, ext))
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// What `MANIFEST` says: the epoch and core count the files belong to and, per core, the
/// snapshot it was last switched to (`snap C G` lines, written once the snapshot is in place
/// and before the files it replaces are removed, so a snapshot it names must be there).
/// Readers that predate the `snap` lines ignore them.
#[derive(Clone, Debug)]
pub(crate) struct Manifest {
    epoch: u64,
    cores: usize,
    snaps: Vec<Option<u64>>,
}

enum ManifestRead {
    Missing,
    Good(Manifest),
    /// Unreadable as a manifest of this format: why.
    Damaged(String),
}

fn read_manifest(dir: &Path) -> Result<ManifestRead, String> {
    let path = dir.join(MANIFEST);
    let bytes = match fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ManifestRead::Missing),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let Ok(text) = String::from_utf8(bytes) else { return Ok(ManifestRead::Damaged("not UTF-8 text".into())) };
    let mut lines = text.lines();
    let head = lines.next().unwrap_or("");
    if head != MANIFEST_HEAD {
        if head.starts_with("hubcast-store ") {
            return Err(format!(
                "{}: format {head:?}, this hubcast reads {MANIFEST_HEAD:?} only; move the data dir away or run the hubcast that wrote it",
                path.display()
            ));
        }
        return Ok(ManifestRead::Damaged(format!("first line {head:?} where {MANIFEST_HEAD:?} was expected")));
    }
    let mut epoch = None;
    let mut cores = None;
    let mut snaps = Vec::new();
    for line in lines {
        match line.split_once(' ') {
            Some(("epoch", v)) => epoch = v.trim().parse().ok(),
            Some(("cores", v)) => cores = v.trim().parse().ok(),
            Some(("snap", v)) => match v.split_once(' ').and_then(|(c, g)| Some((c.parse::<usize>().ok()?, g.trim().parse::<u64>().ok()?))) {
                Some(cg) => snaps.push(cg),
                None => return Ok(ManifestRead::Damaged(format!("a bad line {line:?}"))),
            },
            _ => {}
        }
    }
    match (epoch, cores) {
        (Some(epoch), Some(cores)) if cores > 0 && snaps.iter().all(|&(c, _)| c < cores) => {
            let mut m = Manifest { epoch, cores, snaps: vec![None; cores] };
            for (c, g) in snaps {
                m.snaps[c] = Some(g);
            }
            Ok(ManifestRead::Good(m))
        }
        _ => Ok(ManifestRead::Damaged("no valid epoch and cores lines".into())),
    }
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), String> {
    let tmp = dir.join("MANIFEST.tmp");
    let mut text = format!("{MANIFEST_HEAD}\nepoch {}\ncores {}\n", m.epoch, m.cores);
    for (c, g) in m.snaps.iter().enumerate() {
        if let Some(g) = g {
            text.push_str(&format!("snap {c} {g}\n"));
        }
    }
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, dir.join(MANIFEST))?;
        sync_dir(dir);
        Ok(())
    };
    write().map_err(|e| format!("data dir {}: cannot write the manifest: {e}", dir.display()))
}

/// Damage found at start in one file (or a file missing): see the module docs, "Recovery".
#[derive(Debug)]
struct Damage {
    path: PathBuf,
    /// Where the first damaged span starts.
    offset: usize,
    /// Bytes left out (every damaged span and a snapshot's cut-off end).
    bytes: u64,
    why: String,
    /// Devices the file's header announced that were not read (snapshots).
    devices: u64,
    missing: bool,
}

impl Damage {
    /// `spans`: (offset, bytes, why) of each damaged span, in file order (at least one).
    fn new(path: &Path, spans: &[(usize, usize, String)], devices: usize) -> Damage {
        let more = match spans.len() {
            1 => String::new(),
            n => format!(", and {} more damaged spans", n - 1),
        };
        Damage {
            path: path.to_path_buf(),
            offset: spans[0].0,
            bytes: spans.iter().map(|s| s.1 as u64).sum(),
            why: format!("{}{more}", spans[0].2),
            devices: devices as u64,
            missing: false,
        }
    }

    fn describe(&self) -> String {
        if self.missing {
            format!("store file {} is missing ({})", self.path.display(), self.why)
        } else {
            format!("store file {} is damaged at byte {} ({})", self.path.display(), self.offset, self.why)
        }
    }
}

/// Start-up refuses damaged state unless told otherwise: what it says.
fn refusal(damages: &[Damage]) -> String {
    let more = match damages.len() {
        1 => String::new(),
        n => format!(" (and {} more damaged or missing store files, listed in the log)", n - 1),
    };
    for d in &damages[1..] {
        tracing::error!("{}", d.describe());
    }
    format!(
        "{}{more}. hubcast does not start on damaged state: what it cannot read would be lost for good at the next \
         snapshot. Restore the data dir from a backup, or start with --store-start-damaged to keep each damaged file \
         aside (renamed <name>.damaged-<time>, never overwritten), load what is valid, and log and count what was \
         dropped (hubcast_store_dropped_bytes in /metrics)",
        damages[0].describe()
    )
}

/// Renames a damaged file aside (`<name>.damaged-<unix ms>`); returns the new name.
fn keep_aside(path: &Path) -> Option<PathBuf> {
    if !path.exists() {
        return None;
    }
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let mut name = path.file_name()?.to_os_string();
    name.push(format!(".damaged-{ms}"));
    let aside = path.with_file_name(name);
    match fs::rename(path, &aside) {
        Ok(()) => Some(aside),
        Err(e) => {
            tracing::error!(file = %path.display(), error = %e, "cannot rename a damaged store file aside");
            None
        }
    }
}

/// Reads one store file whole and checks its header: another format version is refused by
/// name (`Err`); any other bad header is damage.
fn read_file(path: &Path, kind: u8) -> Result<Result<Vec<u8>, Damage>, String> {
    let bytes = fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    match format::check_header(&bytes, kind) {
        Ok(()) => Ok(Ok(bytes)),
        Err(e) if bytes.len() >= format::HEADER_LEN && &bytes[..8] == format::MAGIC && !format::READS.iter().any(|v| bytes[8..12] == v.to_le_bytes()) => {
            Err(format!("{}: {e}", path.display()))
        }
        Err(e) => Ok(Err(Damage::new(path, &[(0, bytes.len(), e)], 0))),
    }
}

/// What a start read of one core ([`load_core`]).
struct CoreLoad {
    loaded: Loaded,
    /// The highest generation seen (the next log is the one after it).
    top: u64,
    damages: Vec<Damage>,
    /// The newest log loaded that held commits, `(generation, end)` (0: none): what the
    /// core's next log names.
    prev: (u64, u64),
    /// Logs not loaded because a log before them lost commits they follow: (file, why).
    cut: Vec<(PathBuf, String)>,
}

/// Every file of one core of one epoch: the logs newest first, then the snapshot
/// ([`format::NewestFirst`]: each key's newest record wins, each device is built once).
/// Returns the state, the highest generation seen and the damage found (what is valid is
/// loaded either way; a log's cut-off end is no damage).
///
/// Before any log is applied, each one's start record is checked against the log it names
/// (the one before it that held commits): that log must be there and end where it ended when
/// the next one began. Otherwise the finished log lost commits that later ones follow (a power
/// loss after its sync was left to another thread, the kernel writing the new log's pages
/// first): that log is loaded to where it ends, the logs after it are not, and they are kept
/// aside by the caller, logged at `error` (the commits after the lost ones were never synced
/// either, so a power loss still costs at most `--fsync-interval`, and no later commit, an AMQP
/// position mark among them, is loaded over a hole).
fn load_core(files: &[(usize, u64, String, PathBuf)], core: usize, stream_cap: usize) -> Result<CoreLoad, String> {
    let mine: Vec<_> = files.iter().filter(|f| f.0 == core).collect();
    let snap = mine.iter().filter(|f| f.2 == "snap").map(|f| f.1).max();
    let mut loaded = Loaded { stream_cap, ..Loaded::default() };
    let mut damages = Vec::new();
    let mut top = snap.unwrap_or(0);
    let mut logs: Vec<_> = mine.iter().filter(|f| f.2 == "log" && snap.is_none_or(|s| f.1 >= s)).collect();
    logs.sort_by_key(|f| f.1);
    // The listed path already includes the directory (joining it again breaks a relative one).
    let snapshot = match snap {
        Some(g) => {
            let path = file_name_of(&mine, g, "snap");
            match read_file(&path, KIND_SNAPSHOT)? {
                Ok(bytes) => {
                    // Sized once, before the logs add to it.
                    let hint = format::device_hint(&bytes).min(bytes.len() / 16);
                    loaded.devices.reserve(hint);
                    Some((path, bytes))
                }
                Err(damage) => {
                    damages.push(damage);
                    None
                }
            }
        }
        None => None,
    };
    // Every log checked whole, oldest first, before any is applied.
    let mut checked = Vec::new();
    let mut unreadable = Vec::new();
    for f in &logs {
        top = top.max(f.1);
        match read_file(&f.3, KIND_LOG)? {
            Ok(bytes) => {
                let c = format::NewestFirst::check_log(&bytes, format::Framing::of(&bytes, f.1));
                checked.push((f, bytes, c));
            }
            Err(damage) => {
                damages.push(damage);
                unreadable.push(f.1);
            }
        }
    }
    // The order check (see above).
    let floor = snap.unwrap_or(0);
    let mut cut = Vec::new();
    if let Some(i) = (0..checked.len()).find(|&i| {
        let Some((gen, end)) = checked[i].2.start else { return false };
        if gen == 0 || gen < floor || unreadable.contains(&gen) {
            return false;
        }
        checked[..i].iter().find(|c| c.0 .1 == gen).is_none_or(|c| c.2.end as u64 != end)
    }) {
        let (gen, end) = checked[i].2.start.expect("found");
        let found = checked[..i].iter().find(|c| c.0 .1 == gen);
        let why = match found {
            Some(c) => format!(
                "it follows log {gen} ending at byte {end}, and that log ends at byte {} ({}): commits it held are lost",
                c.2.end,
                c.0 .3.display()
            ),
            None => format!("it follows log {gen} ending at byte {end}, and that log is missing"),
        };
        for (f, _, _) in checked.drain(i..) {
            cut.push((f.3.clone(), why.clone()));
        }
    }
    let prev = checked.iter().rev().find(|c| c.2.commits > 0).map_or((0, 0), |c| (c.0 .1, c.2.end as u64));
    let mut newest = format::NewestFirst::default();
    for (f, bytes, c) in checked.into_iter().rev() {
        let scan = newest.apply_checked(&bytes, c, &mut loaded);
        if let Tail::Bad { offset, why } = &scan.tail {
            tracing::warn!(
                file = %f.3.display(),
                offset,
                why = %why,
                "store log ends in a cut-off commit (a crash while it was written): the whole commits before it are loaded"
            );
        }
        if !scan.damaged.is_empty() {
            let spans: Vec<_> = scan.damaged.into_iter().map(|d| (d.offset, d.len, d.why)).collect();
            damages.push(Damage::new(&f.3, &spans, 0));
        }
    }
    if let Some((path, bytes)) = snapshot {
        let (scan, ended, devices) = newest.apply_snapshot(&bytes, &mut loaded);
        // A snapshot is written whole (temporary file, sync, rename): any bad frame, and a
        // missing end, is damage.
        let mut spans: Vec<_> = scan.damaged.into_iter().map(|d| (d.offset, d.len, d.why)).collect();
        match scan.tail {
            Tail::Bad { offset, why } => spans.push((offset, bytes.len() - offset, format!("{why}; the snapshot is cut off there"))),
            Tail::Clean if !ended => spans.push((bytes.len(), 0, "no end mark: the snapshot is cut off after a whole frame".into())),
            Tail::Clean => {}
        }
        if !spans.is_empty() {
            damages.push(Damage::new(&path, &spans, format::device_hint(&bytes).saturating_sub(devices)));
        }
    }
    newest.finish(&mut loaded);
    Ok(CoreLoad { loaded, top, damages, prev, cut })
}

fn file_name_of(files: &[&(usize, u64, String, PathBuf)], gen: u64, ext: &str) -> PathBuf {
    files.iter().find(|f| f.1 == gen && f.2 == ext).map(|f| f.3.clone()).expect("listed")
}

/// The crash rule of the recovery streams (docs/design/recovery.md, step 7e). A device's core
/// commits a unit of work, with how many deliveries it posts to each session core in all
/// (`Posted`), before the deliveries leave; a session core commits how many it has taken in
/// (`Received`) with the frames it appended for them. Every delivery taken in was counted
/// as posted in a commit before, so `Received[j] <= sum over k of Posted[k][j]`, equal only
/// when every delivery of a committed unit reached core j's streams. When they differ (a
/// `kill -9` between a commit and the append; a delivery conflated on the way, which is
/// counted once where two were posted), core j's streams may lack frames their clients never
/// got: each gets a new epoch, so its clients fail with `history_lost` instead of a replay
/// with a hole. Then the counts are made equal again for the run that starts.
fn crash_rule(loaded: &mut [Loaded]) {
    let cores = loaded.len();
    for j in 0..cores {
        let posted: u64 = loaded.iter().map(|l| l.posted.get(&(j as u32)).copied().unwrap_or(0)).sum();
        let l = &mut loaded[j];
        if posted != l.received && !l.streams.is_empty() {
            tracing::warn!(
                core = j,
                posted,
                received = l.received,
                streams = l.streams.len(),
                "recovery streams may lack deliveries posted before a crash: their history is dropped (clients get recovered false, history_lost)"
            );
            for stream in l.streams.values_mut() {
                stream.lose_history();
            }
        }
        l.received_reset = l.received != posted;
        l.received = posted;
        l.stream_held.clear();
    }
}

/// Routes every record to its owner among `cores` new cores (sessions by session, the rest
/// by device); position marks become the lowest over the old cores, everywhere.
fn reshard(old: Vec<Loaded>, cores: usize) -> Vec<Loaded> {
    let marks = super::resume_positions(&old);
    let mut out: Vec<Loaded> = (0..cores).map(|_| Loaded::default()).collect();
    for l in old {
        for id in l.connected {
            let o = &mut out[core_of_device(&id, cores)];
            o.heard = o.heard.or(l.heard);
            o.connected.push(id);
        }
        for (id, d) in l.devices {
            out[core_of_device(&id, cores)].devices.insert(id, d);
        }
        for ((device, session), a) in l.access {
            out[core_of_device(&device, cores)].access.insert((device, session), a);
        }
        for (id, devices) in l.sessions {
            out[core_of_session(id, cores)].sessions.insert(id, devices);
        }
        for (id, stream) in l.streams {
            out[core_of_session(id, cores)].streams.insert(id, stream);
        }
    }
    // Delivery counts belong to the old layout (checked before): the new one starts at zero.
    for o in &mut out {
        o.applied = marks.clone();
    }
    out
}

/// Writes `loaded` as the snapshot `path` (tmp, sync, rename).
fn write_loaded_snapshot(path: &Path, loaded: &Loaded) -> io::Result<u64> {
    let mut buf = Vec::from(format::header(KIND_SNAPSHOT));
    format::set_device_hint(&mut buf, loaded.devices.len());
    let mut frame = format::begin_frame(&mut buf);
    let split = |buf: &mut Vec<u8>, frame: &mut usize| {
        if buf.len() - *frame > format::SNAPSHOT_FRAME {
            format::end_frame(buf, *frame);
            *frame = format::begin_frame(buf);
        }
    };
    for (id, device) in &loaded.devices {
        format::encode(&mut buf, Change::Device { id, device: Some(device) });
        split(&mut buf, &mut frame);
    }
    for ((device, session), (grants, subs)) in &loaded.access {
        let access = crate::shard::access::Access::new(grants.clone(), subs.clone());
        format::encode(&mut buf, Change::Access { device, session: *session, access: Some(&access) });
        split(&mut buf, &mut frame);
    }
    for (id, devices) in &loaded.sessions {
        let set: crate::shard::sessions::DeviceSet = devices.iter().collect();
        format::encode(&mut buf, Change::Session { id: *id, devices: Some(&set) });
        split(&mut buf, &mut frame);
    }
    for (id, stream) in &loaded.streams {
        format::encode(&mut buf, Change::Stream { id: *id, recovery: Some(stream) });
        split(&mut buf, &mut frame);
    }
    for (key, seq) in &loaded.applied {
        format::encode(&mut buf, Change::Applied { key, seq: *seq });
    }
    for (to, n) in &loaded.posted {
        format::encode(&mut buf, Change::Posted { to: *to as usize, n: *n });
    }
    format::encode(&mut buf, Change::Received { n: loaded.received });
    format::end_frame(&mut buf, frame);
    let end = format::begin_frame(&mut buf);
    buf.push(format::TAG_END);
    format::end_frame(&mut buf, end);
    write_file_synced(path, &buf)?;
    Ok(buf.len() as u64)
}

fn write_file_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("snap.tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        sync_dir(dir);
    }
    Ok(())
}

/// Opens the data dir (see the module docs).
pub fn open(dir: &Path, cores: usize, options: Options) -> Result<Opened, String> {
    open_locked(dir, lock_dir(dir)?, cores, options)
}

/// [`open`] with the data dir's lock already taken ([`lock_dir`]).
pub fn open_locked(dir: &Path, lock: DirLock, cores: usize, options: Options) -> Result<Opened, String> {
    let fsync_interval = options.fsync_interval;
    let lock = Arc::new(lock);
    // Every store file of every epoch ( .tmp left-overs of a crash are removed).
    let mut listed = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| format!("cannot list data dir {}: {e}", dir.display()))? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            let _ = fs::remove_file(entry.path());
            continue;
        }
        // Spares of an earlier run go: a spare holds older logs' frames, and only a spare
        // this run made is known to hold none of a generation it will write (its logs'
        // generations follow the highest one listed here).
        if name.ends_with(".spare") {
            let _ = fs::remove_file(entry.path());
            continue;
        }
        let Some((e, core, gen, ext)) = parse_name(&name) else { continue };
        if ext == "log" || ext == "snap" {
            let len = entry.metadata().map_or(0, |m| m.len());
            listed.push((e, core, gen, ext.to_string(), entry.path(), len));
        }
    }
    let mut damages = Vec::new();
    let manifest = match read_manifest(dir)? {
        ManifestRead::Good(m) => Some(m),
        ManifestRead::Missing if listed.is_empty() => None,
        damaged => {
            let why = match damaged {
                ManifestRead::Damaged(why) => why,
                _ => "the data dir holds store files but no manifest".into(),
            };
            let len = fs::metadata(dir.join(MANIFEST)).map_or(0, |m| m.len() as usize);
            let mut d = Damage::new(&dir.join(MANIFEST), &[(0, len, why)], 0);
            d.missing = len == 0 && !dir.join(MANIFEST).exists();
            if !options.start_damaged {
                return Err(refusal(&[d]));
            }
            // Started anyway: the newest epoch's files, as many cores as they name.
            let epoch = listed.iter().map(|f| f.0).max().unwrap_or(1);
            let cores_seen = listed.iter().filter(|f| f.0 == epoch).map(|f| f.1 + 1).max().unwrap_or(cores);
            let aside = keep_aside(&d.path);
            tracing::error!(
                file = %d.path.display(),
                kept_as = %aside.as_ref().map_or_else(|| "-".to_string(), |p| p.display().to_string()),
                epoch,
                cores = cores_seen,
                "{}; started anyway (--store-start-damaged): taking the newest files' epoch and core count",
                d.describe()
            );
            damages.push(d);
            Some(Manifest { epoch, cores: cores_seen, snaps: vec![None; cores_seen] })
        }
    };
    let (epoch, old_cores) = manifest.as_ref().map_or((1, cores), |m| (m.epoch, m.cores));
    // Files of other epochs are left-overs of a re-shard.
    let mut files = Vec::new();
    for (e, core, gen, ext, path, len) in listed {
        if e != epoch || core >= old_cores {
            tracing::info!(file = %path.display(), "removing a store file of an earlier layout");
            let _ = fs::remove_file(&path);
            continue;
        }
        // A log holding only its header has no commit (each start begins a log): gone, so
        // restarts do not pile up empty files until the next snapshot.
        if ext == "log" && (len == format::HEADER_LEN as u64 || holds_no_commit(&path, gen)) {
            let _ = fs::remove_file(&path);
            continue;
        }
        files.push((core, gen, ext, path));
    }
    // A snapshot the manifest names must be there (it is named once in place, and the files it
    // replaces are removed only after that).
    if let Some(m) = &manifest {
        for (core, gen) in m.snaps.iter().enumerate() {
            let Some(gen) = *gen else { continue };
            if !files.iter().any(|f| f.0 == core && f.1 == gen && f.2 == "snap") {
                let path = dir.join(file_name(epoch, core, gen, "snap"));
                let mut d = Damage::new(&path, &[(0, 0, format!("MANIFEST names it as core {core}'s snapshot"))], 0);
                d.missing = true;
                damages.push(d);
            }
        }
    }
    let started = std::time::Instant::now();
    // Per old core: what it loaded, its next log number, the damage found; or why it stopped.
    let results: Vec<Result<CoreLoad, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..old_cores).map(|c| s.spawn({
            let files = &files;
            move || load_core(files, c, options.stream_bytes)
        })).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a loader thread panicked".into()))).collect()
    });
    let mut loaded = Vec::new();
    let mut gens = Vec::new();
    let mut prevs = Vec::new();
    let mut cut = Vec::new();
    let mut damaged_cores = Vec::new();
    for (core, r) in results.into_iter().enumerate() {
        let r = r.map_err(|e| format!("data dir {}: {e}", dir.display()))?;
        loaded.push(r.loaded);
        gens.push(r.top);
        prevs.push(r.prev);
        if !r.damages.is_empty() {
            damaged_cores.push(core);
        }
        damages.extend(r.damages);
        cut.extend(r.cut);
    }
    // A missing snapshot damages its core too.
    for d in damages.iter().filter(|d| d.missing) {
        if let Some((_, core, _, _)) = d.path.file_name().and_then(|n| n.to_str()).and_then(parse_name) {
            if !damaged_cores.contains(&core) {
                damaged_cores.push(core);
            }
        }
    }
    if !damages.is_empty() && !options.start_damaged {
        return Err(refusal(&damages));
    }
    // With a sync per commit no power loss leaves a hole: it is damage like any other.
    if !cut.is_empty() && fsync_interval.is_zero() && !options.start_damaged {
        let d: Vec<Damage> = cut.iter().map(|(p, why)| Damage::new(p, &[(0, fs::metadata(p).map_or(0, |m| m.len() as usize), why.clone())], 0)).collect();
        return Err(refusal(&d));
    }
    // Logs after a hole ([`load_core`]): kept aside, never read again, counted.
    for (path, why) in &cut {
        STATS.damaged_files.fetch_add(1, Ordering::Relaxed);
        STATS.dropped_bytes.fetch_add(fs::metadata(path).map_or(0, |m| m.len()), Ordering::Relaxed);
        let aside = keep_aside(path);
        tracing::error!(
            file = %path.display(),
            kept_as = %aside.as_ref().map_or_else(|| "-".to_string(), |p| p.display().to_string()),
            "store log not loaded: {why} (a power loss before they were synced, the later commits written back first). \
             What came after the lost commits is dropped with them, as a power loss drops what was not synced: the state \
             is the one at the hole, never later commits over it"
        );
    }
    crash_rule(&mut loaded);
    let devices: usize = loaded.iter().map(|l| l.devices.len()).sum();
    let sessions: usize = loaded.iter().map(|l| l.sessions.len()).sum();
    let mut manifest = manifest.unwrap_or(Manifest { epoch, cores, snaps: vec![None; cores] });
    let (loaded, gens, prevs) = if old_cores != cores {
        tracing::info!(from = old_cores, to = cores, "the core count changed: re-sharding the stored state");
        let new_epoch = epoch + 1;
        let loaded = reshard(loaded, cores);
        for (c, l) in loaded.iter().enumerate() {
            write_loaded_snapshot(&dir.join(file_name(new_epoch, c, 1, "snap")), l)
                .map_err(|e| format!("data dir {}: cannot write a re-sharded snapshot: {e}", dir.display()))?;
        }
        manifest = Manifest { epoch: new_epoch, cores, snaps: vec![Some(1); cores] };
        write_manifest(dir, &manifest)?;
        keep_damaged_aside(&damages);
        for f in &files {
            let _ = fs::remove_file(&f.3);
        }
        (loaded, vec![1; cores], vec![(0, 0); cores])
    } else {
        manifest.cores = cores;
        manifest.snaps.resize(cores, None);
        let (mut gens, mut prevs) = (gens, prevs);
        // A damaged core's valid state becomes a new snapshot before its damaged files are
        // renamed aside, so the next start finds it without them.
        for &c in &damaged_cores {
            let gen = gens[c] + 1;
            write_loaded_snapshot(&dir.join(file_name(epoch, c, gen, "snap")), &loaded[c])
                .map_err(|e| format!("data dir {}: cannot write the valid state of a damaged core: {e}", dir.display()))?;
            manifest.snaps[c] = Some(gen);
            gens[c] = gen;
            // The snapshot holds every log before it: the next log follows none.
            prevs[c] = (0, 0);
        }
        write_manifest(dir, &manifest)?;
        keep_damaged_aside(&damages);
        for f in files.iter().filter(|f| damaged_cores.contains(&f.0) && f.1 < gens[f.0]) {
            let _ = fs::remove_file(&f.3);
        }
        (loaded, gens, prevs)
    };
    tracing::info!(
        dir = %dir.display(),
        devices,
        sessions,
        ms = started.elapsed().as_millis() as u64,
        "stored state loaded"
    );
    // The logs read are on disk before a new log names where they end: after a kill -9 their
    // last commits may be in the page cache only, and a power loss after the new log's commits
    // were synced would otherwise cut those (a hole the next start would cut at).
    for f in files.iter().filter(|f| f.2 == "log" && f.3.exists()) {
        if let Err(e) = File::open(&f.3).and_then(|l| l.sync_data()) {
            return Err(format!("data dir {}: cannot sync {} to disk: {e}", dir.display(), f.3.display()));
        }
    }
    sync_dir(dir);
    let epoch = manifest.epoch;
    let manifest = Arc::new(Mutex::new(manifest));
    let slots: Vec<Arc<SyncSlot>> = (0..cores).map(|_| Arc::new(SyncSlot::default())).collect();
    let mut stores: Vec<Box<dyn StateStore + Send>> = Vec::new();
    for (core, gen) in gens.into_iter().enumerate() {
        let snapshot_size = newest_snapshot_size(dir, epoch, core);
        let mut store = LogStore::create(dir, epoch, core, gen + 1, prevs[core], slots[core].clone(), lock.clone(), fsync_interval, snapshot_size)
            .map_err(|e| format!("data dir {}: cannot start a log: {e}", dir.display()))?;
        store.snapshot_min_log = options.snapshot_log_bytes;
        store.manifest = Some(manifest.clone());
        stores.push(Box::new(store));
    }
    if !fsync_interval.is_zero() {
        start_syncer(dir.to_path_buf(), slots, fsync_interval);
    }
    Ok(Opened { stores, loaded })
}

/// Whether the log `path` of generation `gen` holds no commit: a used-again file whose first
/// frame is its end mark (a new file without commits is just its header).
fn holds_no_commit(path: &Path, gen: u64) -> bool {
    use std::io::Read;
    let mut head = [0u8; format::HEADER_LEN + format::LOG_FRAME_HEAD];
    let Ok(mut f) = File::open(path) else { return false };
    if f.read_exact(&mut head).is_err() || format::check_header(&head, KIND_LOG).is_err() {
        return false;
    }
    format::Framing::of(&head, gen) != format::Framing::Plain && head[format::HEADER_LEN..] == format::log_end_mark(gen)
}

/// Whether `path` is a log of the framing with generations (format 6 on): only such a log is
/// written over, so that whatever header a power loss keeps, an older log's frames in it are
/// never read as the new log's (their generations differ).
fn is_log_framed(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; format::HEADER_LEN];
    File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok()
        && format::check_header(&head, KIND_LOG).is_ok()
        && format::Framing::of(&head, 0) != format::Framing::Plain
}

/// The size of a core's newest snapshot (0: none).
fn newest_snapshot_size(dir: &Path, epoch: u64, core: usize) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let (e2, c, g, ext) = parse_name(&name)?;
            (e2 == epoch && c == core && ext == "snap").then(|| (g, e.metadata().map_or(0, |m| m.len())))
        })
        .max()
        .map_or(0, |(_, len)| len)
}

/// Started with `--store-start-damaged`: every damaged file renamed aside, its loss logged and
/// counted (`/metrics`).
fn keep_damaged_aside(damages: &[Damage]) {
    for d in damages {
        STATS.damaged_files.fetch_add(1, Ordering::Relaxed);
        STATS.dropped_bytes.fetch_add(d.bytes, Ordering::Relaxed);
        STATS.dropped_devices.fetch_add(d.devices, Ordering::Relaxed);
        // The manifest is renamed aside (and logged) before a new one is written.
        if d.path.file_name().is_some_and(|n| n == MANIFEST) {
            continue;
        }
        let aside = if d.missing { None } else { keep_aside(&d.path) };
        tracing::error!(
            file = %d.path.display(),
            kept_as = %aside.as_ref().map_or_else(|| "-".to_string(), |p| p.display().to_string()),
            offset = d.offset,
            dropped_bytes = d.bytes,
            dropped_devices = d.devices,
            "{}; started anyway (--store-start-damaged): what is valid is loaded, the damaged file is kept aside",
            d.describe()
        );
    }
}

/// A core's current log as the sync thread sees it.
#[derive(Default)]
struct SyncSlot {
    file: Mutex<Option<File>>,
    /// Written since the last sync.
    dirty: AtomicBool,
    /// Commits written when `dirty` was last set (counted as synced once the sync is done).
    written: AtomicU64,
    synced: AtomicU64,
    /// The log a snapshot point finished, until it is synced (and with it the directory: the
    /// name of the log begun there). The core hands it over instead of syncing both itself
    /// (a 10–45 ms `fdatasync` and a 10–40 ms directory `fsync` at each snapshot point under
    /// load, issue 25).
    /// Bound and policy: one file per core. The next snapshot point of the core comes only
    /// after the snapshot thread of this one synced it; if the slot is still taken (or its lock
    /// held by a thread syncing it), the core syncs its finished log inline, as before.
    /// Order: whoever syncs a core's current log first syncs this one (the sync thread each
    /// round, the snapshot thread before the new log and the snapshot, [`LogStore::flush`]),
    /// holding the lock until it is on disk, so a commit counted as synced never reaches the
    /// disk ahead of the finished log before it, and a power loss still costs at most
    /// `--fsync-interval`. What the kernel writes back on its own may still reach the disk in
    /// another order: the new log's start record names where the finished one ended, and a
    /// start checks it (see the module docs, "Recovery").
    retired: Mutex<Option<File>>,
}

/// Test hook: the logs of these data dirs are written with the device records of format
/// versions 5 and 6 ([`format::encode`]), as an older hubcast wrote them.
#[cfg(test)]
static COMPACT_RECORDS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Test hook: the next [`LogStore::open_log`] in each of these data dirs fails once its file
/// is in place under the new log's name (as a refused `dup` or `fstat` would).
#[cfg(test)]
static FAIL_NEXT_OPEN: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Test hook: the data dir of each finished log synced and the name of the thread that did it.
#[cfg(test)]
static FINISHED_LOG_SYNCS: Mutex<Vec<(PathBuf, String)>> = Mutex::new(Vec::new());

/// Syncs `file`, a finished log of `dir` (a snapshot point's), then `dir` (the name of the log
/// begun there), logging the thread that does it.
fn sync_finished_log(dir: &Path, core: usize, file: &File) -> io::Result<()> {
    let started = std::time::Instant::now();
    file.sync_data()?;
    sync_dir(dir);
    let thread = std::thread::current();
    tracing::trace!(core, thread = thread.name().unwrap_or("-"), us = started.elapsed().as_micros() as u64, "store finished log synced");
    #[cfg(test)]
    FINISHED_LOG_SYNCS.lock().unwrap_or_else(|e| e.into_inner()).push((dir.to_path_buf(), thread.name().unwrap_or("-").to_string()));
    #[cfg(not(test))]
    let _ = dir;
    Ok(())
}

impl SyncSlot {
    /// Syncs the finished log handed over by the core, if any. A failure keeps it (tried again).
    fn sync_retired(&self, dir: &Path, core: usize) -> io::Result<()> {
        let mut retired = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = retired.as_ref() {
            sync_finished_log(dir, core, f)?;
            *retired = None;
        }
        Ok(())
    }
}

fn start_syncer(dir: PathBuf, slots: Vec<Arc<SyncSlot>>, every: Duration) {
    let spawned = std::thread::Builder::new().name("hubcast-store-sync".into()).spawn(move || loop {
        std::thread::sleep(every);
        for (core, slot) in slots.iter().enumerate() {
            // The finished log first: the current one must not reach the disk ahead of it.
            if let Err(e) = slot.sync_retired(&dir, core) {
                tracing::error!(core, error = %e, "cannot sync a finished store log to disk");
                continue;
            }
            if slot.dirty.swap(false, Ordering::AcqRel) {
                let written = slot.written.load(Ordering::Acquire);
                let file = slot.file.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(f) = file.as_ref() {
                    if let Err(e) = f.sync_data() {
                        tracing::error!(error = %e, "cannot sync the store log to disk");
                        continue;
                    }
                }
                let before = slot.synced.swap(written, Ordering::AcqRel);
                STATS.synced_commits.fetch_add(written.saturating_sub(before), Ordering::Relaxed);
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the store sync thread: logs reach the disk when the OS writes them");
    }
}

/// The name of core C's spare: a log a snapshot replaced, kept to be written over as a later
/// log (see the module docs, "Logs used again"). Never read.
fn spare_name(epoch: u64, core: usize) -> String {
    format!("e{epoch}-c{core}.spare")
}

/// Per-core append log with snapshots.
pub struct LogStore {
    dir: PathBuf,
    epoch: u64,
    core: usize,
    gen: u64,
    file: Option<File>,
    /// The unit being built: a frame header and records.
    pending: Vec<u8>,
    /// The keys and base time the device records of the frame being built share.
    keys: format::FrameKeys,
    frame_at: Option<usize>,
    log_bytes: u64,
    /// Length of the current log up to its last whole frame: where the next commit is written.
    /// A write that fails part-way is cut back to it, so the torn frame does not hide the
    /// commits written after it.
    file_len: u64,
    /// The file's size: past `file_len` up to here are an older log's bytes (a spare used
    /// again), so a commit that ends before it is followed by an end mark.
    file_size: u64,
    /// Commits written to the current log (its first begins with the start record).
    log_commits: u64,
    /// The last log of this core that held commits, `(generation, end)` (0: none): what the
    /// next log's start record names.
    prev: (u64, u64),
    /// The file's blocks are reserved up to here ([`LOG_RESERVE`]); `u64::MAX` when the file
    /// system cannot reserve (then ext4's delayed allocation, or the file system's own, is used).
    reserved_to: u64,
    /// Test hook: the next commit writes only this many bytes, then fails.
    #[cfg(test)]
    tear_next: Option<usize>,
    snapshot_size: u64,
    /// Logs smaller than this are never compacted (`--snapshot-log-bytes`).
    snapshot_min_log: u64,
    snapshot: Option<(Vec<u8>, usize, u64)>,
    snapshot_running: Arc<AtomicBool>,
    /// Told of each snapshot once it is in place, before the files it replaces are removed.
    manifest: Option<Arc<Mutex<Manifest>>>,
    slot: Arc<SyncSlot>,
    commits: u64,
    fsync_each: bool,
    _lock: Arc<DirLock>,
}

impl LogStore {
    #[allow(clippy::too_many_arguments)]
    fn create(
        dir: &Path,
        epoch: u64,
        core: usize,
        gen: u64,
        prev: (u64, u64),
        slot: Arc<SyncSlot>,
        lock: Arc<DirLock>,
        fsync_interval: Duration,
        snapshot_size: u64,
    ) -> io::Result<Self> {
        let mut s = LogStore {
            dir: dir.to_path_buf(),
            epoch,
            core,
            gen,
            file: None,
            pending: Vec::with_capacity(64 << 10),
            keys: format::FrameKeys::default(),
            frame_at: None,
            log_bytes: 0,
            file_len: 0,
            file_size: 0,
            log_commits: 0,
            prev,
            reserved_to: 0,
            #[cfg(test)]
            tear_next: None,
            snapshot_size,
            snapshot_min_log: SNAPSHOT_MIN_LOG,
            snapshot: None,
            snapshot_running: Arc::new(AtomicBool::new(false)),
            manifest: None,
            slot,
            commits: 0,
            fsync_each: fsync_interval.is_zero(),
            _lock: lock,
        };
        s.open_log(true)?;
        Ok(s)
    }

    /// Starts log `gen`: core C's spare written over when there is one (its header and an end
    /// mark of this generation are written before it takes the log's name, so under that
    /// name it never reads as anything but this log), else a new file. `sync_dir_now`: syncs
    /// the directory (the log's name) here, else the caller has it synced before the log's
    /// commits are (a snapshot point: [`SyncSlot::retired`]).
    fn open_log(&mut self, sync_dir_now: bool) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let path = self.dir.join(file_name(self.epoch, self.core, self.gen, "log"));
        let spare = self.dir.join(spare_name(self.epoch, self.core));
        let reused = match OpenOptions::new().read(true).write(true).open(&spare) {
            Ok(_) if !is_log_framed(&spare) => {
                let _ = fs::remove_file(&spare);
                None
            }
            Ok(f) => {
                let mut start = format::header(KIND_LOG).to_vec();
                start.extend_from_slice(&format::log_end_mark(self.gen));
                match f.write_all_at(&start, 0).and_then(|()| fs::rename(&spare, &path)) {
                    Ok(()) => {
                        tracing::debug!(core = self.core, log = self.gen, "store log written over the spare");
                        Some(f)
                    }
                    Err(e) => {
                        // Not used: it goes, and the log is a new file.
                        tracing::warn!(core = self.core, error = %e, "cannot use the store's spare log again; starting a new file");
                        let _ = fs::remove_file(&spare);
                        None
                    }
                }
            }
            Err(_) => None,
        };
        let was_spare = reused.is_some();
        let f = match reused {
            Some(f) => f,
            None => {
                // No commit was ever written under this generation: a start opens the one
                // after every log it listed, a snapshot point the one after the current log.
                // A file already there is what a failed open of the same generation left (a
                // snapshot point rolled back and retried): a header, or the spare's older
                // frames behind this generation's end mark, where commits appended after the
                // mark would never be read. So it is cut and begun anew, never appended to.
                let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
                f.write_all_at(&format::header(KIND_LOG), 0)?;
                f
            }
        };
        #[cfg(test)]
        {
            let mut fail = FAIL_NEXT_OPEN.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = fail.iter().position(|d| *d == self.dir) {
                fail.remove(i);
                return Err(io::Error::other("the new log's descriptor cannot be cloned (test)"));
            }
        }
        self.file_size = f.metadata()?.len();
        // A new file's commits are appended; a spare's are written from its start.
        self.file_len = if !was_spare { self.file_size } else { format::HEADER_LEN as u64 };
        self.log_commits = 0;
        // A new log reserves its first step at its first commit; a spare's blocks are there.
        if self.reserved_to != u64::MAX {
            self.reserved_to = self.file_size;
        }
        if sync_dir_now {
            sync_dir(&self.dir);
        }
        *self.slot.file.lock().unwrap_or_else(|e| e.into_inner()) = Some(f.try_clone()?);
        self.file = Some(f);
        Ok(())
    }

    /// Leaves the current log for the next generation: what it held is named by the next
    /// log's start record.
    fn finish_log(&mut self) -> Option<File> {
        if self.log_commits > 0 {
            self.prev = (self.gen, self.file_len);
        }
        self.file.take()
    }

    /// Hands a log finished at a snapshot point to the thread that syncs it; when the one slot
    /// is taken (see [`SyncSlot::retired`] for the bound), syncs it here.
    fn retire(&self, old: File) {
        let old = match self.slot.retired.try_lock() {
            Ok(mut slot) if slot.is_none() => {
                *slot = Some(old);
                return;
            }
            _ => old,
        };
        if let Err(e) = sync_finished_log(&self.dir, self.core, &old) {
            self.write_error("cannot sync the finished log", &e);
        }
    }

    /// Reserves the log's blocks past `end` (the end of the commit about to be written) a
    /// [`LOG_RESERVE`] step ahead, when not done yet. A failure is not an error: the write
    /// then takes its blocks the usual way (and reports a full disk itself).
    fn reserve(&mut self, end: u64) {
        if end <= self.reserved_to {
            return;
        }
        let Some(f) = self.file.as_ref() else { return };
        let to = end.saturating_add(LOG_RESERVE);
        // Safety: fallocate on a descriptor this store owns; KEEP_SIZE leaves the file's size
        // (what a start reads) as it is.
        let r = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, self.file_len as libc::off_t, (to - self.file_len) as libc::off_t) };
        self.reserved_to = if r == 0 {
            to
        } else if matches!(io::Error::last_os_error().raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)) {
            u64::MAX
        } else {
            // ENOSPC and the like: tried again a step later.
            to
        };
    }

    fn write_error(&self, what: &str, e: &io::Error) {
        let n = STATS.write_errors.fetch_add(1, Ordering::Relaxed);
        if n.is_power_of_two() || n == 0 {
            tracing::error!(core = self.core, error = %e, errors = n + 1, "store: {what}; state is served from memory but may not survive a restart");
        }
    }
}

impl StateStore for LogStore {
    fn put(&mut self, change: Change<'_>) {
        if self.frame_at.is_none() {
            self.frame_at = Some(format::begin_log_frame(&mut self.pending));
            self.keys.clear();
            // A log's first commit names the log before it (checked at start).
            if self.log_commits == 0 {
                format::encode_log_start(&mut self.pending, self.prev.0, self.prev.1);
            }
        }
        #[cfg(test)]
        if COMPACT_RECORDS.lock().unwrap_or_else(|e| e.into_inner()).contains(&self.dir) {
            return format::encode(&mut self.pending, change);
        }
        format::encode_framed(&mut self.pending, change, &mut self.keys);
    }

    fn commit(&mut self) {
        use std::os::unix::fs::FileExt;
        let Some(at) = self.frame_at.take() else { return };
        format::end_log_frame(&mut self.pending, at, self.gen);
        let frame = self.pending.len() as u64;
        // Older bytes after this commit (a spare written over): its end mark follows it, in
        // the same write, and the next commit writes over the mark.
        if self.file_len + frame < self.file_size {
            self.pending.extend_from_slice(&format::log_end_mark(self.gen));
        }
        #[cfg(test)]
        let tear = self.tear_next.take();
        #[cfg(not(test))]
        let tear: Option<usize> = None;
        let mut torn = false;
        self.reserve(self.file_len + self.pending.len() as u64);
        if let Some(f) = self.file.as_mut() {
            let written = match tear {
                Some(n) => f.write_all_at(&self.pending[..n], self.file_len).and(Err(io::Error::other("torn write (test)"))),
                None => f.write_all_at(&self.pending, self.file_len),
            };
            match written {
                Ok(()) => {
                    self.file_size = self.file_size.max(self.file_len + self.pending.len() as u64);
                    self.file_len += frame;
                    self.commits += 1;
                    self.log_commits += 1;
                    self.log_bytes += frame;
                    STATS.commits.fetch_add(1, Ordering::Relaxed);
                    STATS.bytes.fetch_add(frame, Ordering::Relaxed);
                    if self.fsync_each {
                        if let Err(e) = f.sync_data() {
                            self.write_error("cannot sync the log", &e);
                        } else {
                            STATS.synced_commits.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        self.slot.written.store(self.commits, Ordering::Release);
                        self.slot.dirty.store(true, Ordering::Release);
                    }
                }
                Err(e) => {
                    // Part of the frame may be in the file (ENOSPC half-way): recovery stops
                    // reading a log at its first bad frame, so cut it off, or later commits
                    // would be written behind it and lost at the next start. (In a spare the
                    // older bytes after it go too: the file ends at the last commit.)
                    torn = f.set_len(self.file_len).is_err();
                    self.file_size = self.file_len;
                    // The cut gives back the blocks reserved past it too.
                    self.reserved_to = self.reserved_to.min(self.file_len);
                    self.write_error("cannot write the log", &e);
                }
            }
        }
        if torn {
            // Cannot cut it off: go on in a new log (a start reads every log in order), once
            // the finished one is on disk (its end is named by the new one).
            if let Some(old) = self.finish_log() {
                let _ = old.sync_data();
            }
            self.gen += 1;
            if let Err(e) = self.open_log(true) {
                self.file = None;
                self.write_error("cannot start a new log after a failed write", &e);
            }
        }
        self.pending.clear();
        if self.pending.capacity() > (16 << 20) {
            self.pending.shrink_to(64 << 10);
        }
    }

    fn snapshot_due(&self) -> bool {
        self.snapshot.is_none()
            && !self.snapshot_running.load(Ordering::Acquire)
            && self.log_bytes > self.snapshot_min_log.max(self.snapshot_size.saturating_mul(2))
    }

    fn begin_snapshot(&mut self) {
        self.commit();
        let (prev, size, len, commits) = (self.prev, self.file_size, self.file_len, self.log_commits);
        let old = self.finish_log();
        // The old log must be on disk before anything that replaces it is: the sync thread or
        // the snapshot thread syncs it, whichever comes first ([`SyncSlot::retired`]). Handed
        // over before the new log takes the sync slot, so that no sync round counts the old
        // log's commits as synced without it. With a sync per commit it is on disk already.
        if let Some(old) = old.as_ref().filter(|_| !self.fsync_each).and_then(|f| f.try_clone().ok()) {
            self.retire(old);
        }
        self.gen += 1;
        // The new log's name is synced with the finished log, by whoever syncs that.
        if let Err(e) = self.open_log(old.is_none() || self.fsync_each) {
            self.write_error("cannot start a new log", &e);
            self.file = old;
            self.gen -= 1;
            (self.prev, self.file_size, self.file_len, self.log_commits) = (prev, size, len, commits);
            return;
        }
        drop(old);
        self.log_bytes = 0;
        tracing::debug!(core = self.core, log = self.gen, "store snapshot point: a new log begun");
        let mut buf = Vec::from(format::header(KIND_SNAPSHOT));
        let frame = format::begin_frame(&mut buf);
        self.snapshot = Some((buf, frame, self.gen));
    }

    fn put_snapshot(&mut self, change: Change<'_>) {
        let Some((buf, frame, _)) = self.snapshot.as_mut() else { return };
        format::encode(buf, change);
        if buf.len() - *frame > format::SNAPSHOT_FRAME {
            format::end_frame(buf, *frame);
            *frame = format::begin_frame(buf);
        }
    }

    fn snapshot_devices(&mut self, devices: usize) {
        if let Some((buf, _, _)) = self.snapshot.as_mut() {
            format::set_device_hint(buf, devices);
            // Room for the whole snapshot at once (pages are touched only as it is written):
            // growing a 60 MB buffer by doubling copied it inside a slice (measured: 185 ms).
            let estimate = (self.snapshot_size as usize).max(devices.saturating_mul(160)).min(1 << 30);
            buf.reserve(estimate.saturating_sub(buf.len()));
        }
    }

    fn end_snapshot(&mut self) {
        let Some((mut buf, frame, gen)) = self.snapshot.take() else { return };
        format::end_frame(&mut buf, frame);
        let end = format::begin_frame(&mut buf);
        buf.push(format::TAG_END);
        format::end_frame(&mut buf, end);
        self.snapshot_size = buf.len() as u64;
        let running = self.snapshot_running.clone();
        running.store(true, Ordering::Release);
        let (dir, epoch, core, manifest) = (self.dir.clone(), self.epoch, self.core, self.manifest.clone());
        // The log since the snapshot point holds what changed while the snapshot was built:
        // it must be on disk before the snapshot replaces anything (see `end_snapshot`'s docs).
        // And before it, the log the snapshot point finished (unless the sync thread synced it).
        let log = self.file.as_ref().and_then(|f| f.try_clone().ok());
        let slot = self.slot.clone();
        let spawned = std::thread::Builder::new().name(format!("hubcast-snapshot-{core}")).spawn(move || {
            let path = dir.join(file_name(epoch, core, gen, "snap"));
            let written = match slot.sync_retired(&dir, core).and_then(|()| log.as_ref().map_or(Ok(()), File::sync_data)) {
                Err(e) => Err(e),
                Ok(()) => write_file_synced(&path, &buf),
            };
            match written {
                Ok(()) => {
                    STATS.snapshots.fetch_add(1, Ordering::Relaxed);
                    // Named in the manifest before what it replaces goes: a named snapshot
                    // must be there at the next start.
                    let named = match &manifest {
                        Some(m) => {
                            let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
                            m.snaps[core] = Some(gen);
                            write_manifest(&dir, &m)
                        }
                        None => Ok(()),
                    };
                    if let Err(e) = &named {
                        tracing::error!(core, error = %e, "cannot name the new snapshot in the manifest; the older store files are kept");
                    }
                    // Everything older than this snapshot is replaced by it. The newest log
                    // it replaced becomes the core's spare (written over as a later log: its
                    // pages are allocated and cached, so nothing is freed here and a commit
                    // written over them costs the kernel about half of an append).
                    if let Some(entries) = named.ok().and_then(|()| fs::read_dir(&dir).ok()) {
                        let mut replaced_logs = Vec::new();
                        for entry in entries.flatten() {
                            let name = entry.file_name().to_string_lossy().into_owned();
                            if let Some((e, c, g, ext)) = parse_name(&name) {
                                if e == epoch && c == core && (g < gen || (g == gen && name.ends_with(".snap.tmp"))) {
                                    if ext == "log" {
                                        replaced_logs.push((g, entry.path()));
                                    } else {
                                        let _ = fs::remove_file(entry.path());
                                    }
                                }
                            }
                        }
                        replaced_logs.sort();
                        if let Some((_, newest)) = replaced_logs.pop() {
                            // Only a log of the framing with generations: an older log's frames
                            // would read as commits under a header a power loss kept.
                            if !is_log_framed(&newest) || fs::rename(&newest, dir.join(spare_name(epoch, core))).is_err() {
                                let _ = fs::remove_file(&newest);
                            }
                        }
                        for (_, path) in replaced_logs {
                            let _ = fs::remove_file(path);
                        }
                    }
                    tracing::debug!(core, bytes = buf.len(), "store snapshot written");
                }
                Err(e) => tracing::error!(core, error = %e, "cannot write a store snapshot; the logs are kept"),
            }
            running.store(false, Ordering::Release);
        });
        if let Err(e) = spawned {
            self.snapshot_running.store(false, Ordering::Release);
            self.write_error("cannot start the snapshot writer", &e);
        }
    }

    fn abort_snapshot(&mut self) {
        self.snapshot = None;
    }

    fn flush(&mut self) -> io::Result<()> {
        self.commit();
        self.slot.sync_retired(&self.dir, self.core)?;
        if let Some(f) = self.file.as_ref() {
            f.sync_data()?;
            let before = self.slot.synced.swap(self.commits, Ordering::AcqRel);
            STATS.synced_commits.fetch_add(self.commits.saturating_sub(before), Ordering::Relaxed);
        }
        Ok(())
    }

    fn close(&mut self) -> io::Result<()> {
        self.abort_snapshot();
        let r = self.flush();
        self.file = None;
        *self.slot.file.lock().unwrap_or_else(|e| e.into_inner()) = None;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SessionId;
    use crate::shard::access::Access;
    use crate::shard::devices::{ConnectionState, Device};
    use crate::store::DeviceData;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hubcast-store-unit-{name}-{}-{}", std::process::id(), fastrand::u64(..)));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn device(temp: f64, seq: &str) -> Device {
        let mut d = Device::default();
        d.telemetry.set(0, "t", &temp.to_string(), 1000);
        d.connection = Some(ConnectionState { connected: true, at: 5, sequence: Some(seq.into()) });
        d
    }

    fn write_some(dir: &Path, cores: usize) {
        let mut opened = open(dir, cores, Options::new(Duration::from_millis(50))).unwrap();
        for (i, store) in opened.stores.iter_mut().enumerate() {
            for n in 0..3 {
                let id = format!("dev-{i}-{n}");
                let d = device(n as f64, "01");
                store.put(Change::Device { id: &id, device: Some(&d) });
                store.put(Change::Applied { key: "p0", seq: n });
                store.commit();
            }
        }
        let twin = crate::shard::Grants { device_twin: true, ..Default::default() };
        let access = Access::new(twin, crate::shard::Subscriptions { device_twin: true, ..Default::default() });
        opened.stores[0].put(Change::Access { device: "dev-0-0", session: SessionId(7), access: Some(&access) });
        let set: crate::shard::sessions::DeviceSet = ["dev-0-0"].into_iter().collect();
        opened.stores[0].put(Change::Session { id: SessionId(7), devices: Some(&set) });
        opened.stores[0].commit();
        opened.stores[1 % cores].put(Change::Device { id: "dev-x", device: Some(&device(9.0, "02")) });
        opened.stores[1 % cores].commit();
        opened.stores[1 % cores].put(Change::Device { id: "dev-x", device: None });
        opened.stores[1 % cores].commit();
        for s in &mut opened.stores {
            s.close().unwrap();
        }
    }

    fn all_devices(o: &Opened) -> Vec<(Box<str>, DeviceData)> {
        let mut v: Vec<_> =
            o.loaded.iter().flat_map(|l| l.devices.iter().map(|(k, d)| (Box::<str>::from(k), crate::store::data_of_device(d)))).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    #[test]
    fn what_is_committed_comes_back() {
        let dir = temp_dir("roundtrip");
        write_some(&dir, 2);
        let o = open(&dir, 2, Options::new(Duration::from_millis(50))).unwrap();
        let devices = all_devices(&o);
        assert_eq!(devices.len(), 6, "{devices:?}");
        assert_eq!(&*devices[2].1.telemetry[0].1, "2");
        assert_eq!(devices[0].1.connection, Some((true, 5, Some("01".into()))));
        assert_eq!(o.loaded[0].sessions.get(&SessionId(7)).unwrap(), &vec![Box::<str>::from("dev-0-0")]);
        let (grants, subs) = o.loaded[0].access.get(&(Box::from("dev-0-0"), SessionId(7))).unwrap();
        assert!(grants.device_twin && subs.device_twin);
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// Whether the file system of `dir` reserves blocks with `fallocate` (`FALLOC_FL_KEEP_SIZE`):
    /// `Err` with the reason when it does not (tmpfs before 3.5, some overlay and network file
    /// systems: `EOPNOTSUPP`).
    fn fallocate_supported(dir: &Path) -> Result<(), String> {
        let probe = dir.join("fallocate-probe");
        let f = File::create(&probe).unwrap();
        // Safety: fallocate on a descriptor this test owns.
        let r = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 4096) };
        let e = io::Error::last_os_error();
        let _ = fs::remove_file(&probe);
        match r {
            0 => Ok(()),
            _ if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)) => Err(format!("{} cannot reserve blocks: {e}", dir.display())),
            _ => panic!("fallocate failed otherwise: {e}"),
        }
    }

    /// A log reserves its blocks a step ahead of its end, its size staying its last commit's
    /// end; on a file system without `fallocate` the store notices (`EOPNOTSUPP`) and leaves
    /// the blocks to it. Either way what was committed reads back.
    #[test]
    fn a_log_reserves_its_blocks_ahead_of_its_end_and_reads_back_as_written() {
        use std::os::unix::fs::MetadataExt;
        let dir = temp_dir("reserve");
        fs::create_dir_all(&dir).unwrap();
        let supported = fallocate_supported(&dir);
        let lock = Arc::new(lock_dir(&dir).unwrap());
        write_manifest(&dir, &Manifest { epoch: 1, cores: 1, snaps: vec![None] }).unwrap();
        let mut store = LogStore::create(&dir, 1, 0, 1, (0, 0), Arc::default(), lock, Duration::from_secs(60), 0).unwrap();
        let d = device(1.0, "01");
        store.put(Change::Device { id: "dev", device: Some(&d) });
        store.commit();
        let log = log_files(&dir).pop().expect("a log with a commit");
        let meta = fs::metadata(&log).unwrap();
        // The size is the commit's end (what a start reads).
        assert!(meta.len() < 4096, "{}", meta.len());
        match &supported {
            // The blocks reach a step past it.
            Ok(()) => assert!(meta.blocks() * 512 >= LOG_RESERVE, "{} bytes of blocks for a {}-byte log", meta.blocks() * 512, meta.len()),
            Err(why) => {
                eprintln!("skipped the reserved blocks' check: {why}");
                assert_eq!(store.reserved_to, u64::MAX, "the store saw that the file system cannot reserve");
            }
        }
        let d2 = device(2.0, "02");
        store.put(Change::Device { id: "dev2", device: Some(&d2) });
        store.commit();
        // Not closed: what a kill -9 leaves (the reserved blocks past the size are not read).
        let written = fs::metadata(&log).unwrap().len();
        drop(store);
        assert_eq!(fs::metadata(&log).unwrap().len(), written);
        let o = open(&dir, 1, Options::new(Duration::from_secs(60))).unwrap();
        let devices = all_devices(&o);
        assert_eq!(devices.len(), 2, "{devices:?}");
        assert_eq!(&*devices[1].1.telemetry[0].1, "2");
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_commit_written_half_way_does_not_hide_the_commits_after_it() {
        let dir = temp_dir("torn");
        fs::create_dir_all(&dir).unwrap();
        let lock = Arc::new(lock_dir(&dir).unwrap());
        write_manifest(&dir, &Manifest { epoch: 1, cores: 1, snaps: vec![None] }).unwrap();
        let mut store = LogStore::create(&dir, 1, 0, 1, (0, 0), Arc::default(), lock, Duration::ZERO, 0).unwrap();
        store.put(Change::Device { id: "before", device: Some(&device(1.0, "01")) });
        store.commit();
        // The disk fills up half-way through a commit: that commit is lost (and reported)...
        store.tear_next = Some(11);
        store.put(Change::Device { id: "torn", device: Some(&device(2.0, "02")) });
        store.commit();
        // ...but once there is room again, what is committed survives a restart.
        store.put(Change::Device { id: "after", device: Some(&device(3.0, "03")) });
        store.commit();
        drop(store);
        let o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let ids: Vec<Box<str>> = all_devices(&o).into_iter().map(|(k, _)| k).collect();
        assert_eq!(ids, vec![Box::<str>::from("after"), "before".into()]);
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_owner_is_refused() {
        let dir = temp_dir("lock");
        let first = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let err = open(&dir, 1, Options::new(Duration::ZERO)).err().expect("refused");
        assert!(err.contains("in use by another hubcast"), "{err}");
        drop(first);
        assert!(open(&dir, 1, Options::new(Duration::ZERO)).is_ok(), "free again once the owner is gone");
        let _ = fs::remove_dir_all(&dir);
    }

    fn log_files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<_> = fs::read_dir(dir).unwrap().flatten().map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "log") && fs::metadata(p).unwrap().len() > HEADER_LEN_U64)
            .collect();
        v.sort();
        v
    }
    const HEADER_LEN_U64: u64 = format::HEADER_LEN as u64;

    #[test]
    fn a_truncated_tail_keeps_what_precedes_it() {
        let dir = temp_dir("truncated");
        write_some(&dir, 1);
        let log = log_files(&dir).pop().unwrap();
        let len = fs::metadata(&log).unwrap().len();
        OpenOptions::new().write(true).open(&log).unwrap().set_len(len - 3).unwrap();
        let o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        // The last commit (dev-x gone) is cut off: dev-x is back, everything before it is there.
        let devices = all_devices(&o);
        assert_eq!(devices.len(), 4, "{devices:?}");
        assert!(devices.iter().any(|(k, _)| &**k == "dev-x"));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_corrupted_byte_inside_a_log_stops_the_start_unless_told_to_start_damaged() {
        let dir = temp_dir("corrupt");
        write_some(&dir, 1);
        let log = log_files(&dir).pop().unwrap();
        let mut bytes = fs::read(&log).unwrap();
        // Inside the payload of the second frame (valid frames follow: damage, not a cut-off end).
        let head = format::LOG_FRAME_HEAD;
        let first_len = u32::from_le_bytes(bytes[16..20].try_into().unwrap()) as usize;
        bytes[16 + head + first_len + head + 2] ^= 0x55;
        fs::write(&log, bytes).unwrap();
        let err = open(&dir, 1, Options::new(Duration::ZERO)).err().expect("refused");
        let name = log.file_name().unwrap().to_string_lossy().into_owned();
        assert!(err.contains(&name) && err.contains(&format!("at byte {}", 16 + head + first_len)) && err.contains("--store-start-damaged"), "{err}");
        let mut options = Options::new(Duration::ZERO);
        options.start_damaged = true;
        let o = open(&dir, 1, options).unwrap();
        let ids: Vec<Box<str>> = all_devices(&o).into_iter().map(|(k, _)| k).collect();
        assert_eq!(ids, vec![Box::<str>::from("dev-0-0"), "dev-0-2".into()], "only the damaged commit is lost");
        drop(o);
        assert!(!log.exists(), "renamed aside");
        let aside = fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&format!("{name}.damaged-"))).count();
        assert_eq!(aside, 1);
        // The valid state was written anew: the next start needs no flag and finds the same.
        let again = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(all_devices(&again).len(), 2);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_manifest_stops_the_start_unless_told_to_start_damaged() {
        let dir = temp_dir("manifest");
        write_some(&dir, 2);
        fs::write(dir.join(MANIFEST), "hubcast-store 1\nepoch x\n").unwrap();
        let err = open(&dir, 2, Options::new(Duration::ZERO)).err().expect("refused");
        assert!(err.contains("MANIFEST is damaged at byte 0") && err.contains("--store-start-damaged"), "{err}");
        let mut options = Options::new(Duration::ZERO);
        options.start_damaged = true;
        let o = open(&dir, 2, options).unwrap();
        assert_eq!(all_devices(&o).len(), 6, "the files' epoch and core count are taken");
        drop(o);
        let aside = fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("MANIFEST.damaged-")).count();
        assert_eq!(aside, 1, "kept aside");
        assert_eq!(all_devices(&open(&dir, 2, Options::new(Duration::ZERO)).unwrap()).len(), 6, "a good manifest written anew");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn another_format_version_is_refused_by_name() {
        let dir = temp_dir("version");
        write_some(&dir, 1);
        let log = log_files(&dir).pop().unwrap();
        let mut bytes = fs::read(&log).unwrap();
        bytes[8..12].copy_from_slice(&8u32.to_le_bytes());
        fs::write(&log, bytes).unwrap();
        let err = open(&dir, 1, Options::new(Duration::ZERO)).err().expect("refused");
        assert!(err.contains("store format version 8") && err.contains("versions [1, 2, 3, 4, 5, 6, 7]"), "{err}");
        let _ = fs::remove_dir_all(&dir);
    }

    /// Every file of `dir` as an older hubcast wrote it: the same records under a `version`
    /// header; a log's frames as versions before 6 wrote them (no generation, no start record).
    fn as_written_by_version(dir: &Path, version: u32) {
        for e in fs::read_dir(dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.ends_with(".log") || name.ends_with(".snap") {
                let mut bytes = fs::read(e.path()).unwrap();
                assert_eq!(bytes[8..12], format::VERSION.to_le_bytes());
                let gen = parse_name(&name).unwrap().2;
                if let format::Framing::Log { .. } = format::Framing::of(&bytes, gen) {
                    if version < format::LOG_FRAMING_SINCE {
                        bytes = log_as_version(&bytes, gen, version);
                    }
                }
                bytes[8..12].copy_from_slice(&version.to_le_bytes());
                fs::write(e.path(), bytes).unwrap();
            }
        }
    }

    /// A log of generation `gen` as a hubcast of format `version` (before 6) wrote it: each
    /// commit a plain frame, without the start record.
    fn log_as_version(bytes: &[u8], gen: u64, version: u32) -> Vec<u8> {
        let mut payloads = Vec::new();
        let (scan, _) = format::scan_framed(bytes, format::Framing::of(bytes, gen), &mut |p| {
            payloads.push(p.to_vec());
            Ok(())
        });
        assert!(scan.is_clean());
        let mut out = format::header_of(KIND_LOG, version).to_vec();
        for (i, mut p) in payloads.into_iter().enumerate() {
            if i == 0 {
                assert_eq!(p[0], 16, "a log's first commit begins with its start record");
                p.drain(..17);
            }
            let at = format::begin_frame(&mut out);
            out.extend_from_slice(&p);
            format::end_frame(&mut out, at);
        }
        out
    }

    /// A data dir written by [`write_some`] on 2 cores, its files then put back to format
    /// `version` ([`as_written_by_version`]), opened again: the same six devices come back.
    /// Returns the dir, what was opened, and the devices as written.
    fn read_as_written_by_version(name: &str, version: u32) -> (PathBuf, Opened, Vec<(Box<str>, DeviceData)>) {
        let dir = temp_dir(name);
        // The device records those versions wrote (no frame's keys shared).
        COMPACT_RECORDS.lock().unwrap().push(dir.clone());
        write_some(&dir, 2);
        COMPACT_RECORDS.lock().unwrap().retain(|d| *d != dir);
        let expected = all_devices(&open(&dir, 2, Options::new(Duration::ZERO)).unwrap());
        as_written_by_version(&dir, version);
        let o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(all_devices(&o), expected);
        assert_eq!(expected.len(), 6);
        (dir, o, expected)
    }

    #[test]
    fn a_data_dir_of_format_version_1_is_read_as_before() {
        // Every file as the previous hubcast wrote it: the same records under a version 1 header.
        let (dir, o, _) = read_as_written_by_version("version-1", 1);
        assert_eq!(o.loaded[0].sessions.get(&SessionId(7)).unwrap(), &vec![Box::<str>::from("dev-0-0")]);
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        assert!(o.loaded.iter().all(|l| l.streams.is_empty()));
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// Design step 9: a device's read mark (the partition keys it applied) is stored with its
    /// last values (format version 4) and comes back from a log and from a snapshot (a
    /// re-shard writes one); files of version 3, which hold no marks, read as before.
    #[test]
    fn read_marks_come_back_and_a_data_dir_of_format_version_3_is_read_as_before() {
        use crate::ingest::{MsgKey, ReadMark};
        let (dir, o, expected) = read_as_written_by_version("version-3", 3);
        assert!(expected.iter().all(|(_, d)| d.mark.is_none()), "no marks in a version 3 file");
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        drop(o);
        // A device that applied partition keys: its mark comes back with its values.
        let mut d = device(4.0, "03");
        assert!(!d.mark.take(MsgKey::partition(1, 1_700_000_000_000, 41)));
        assert!(!d.mark.take(MsgKey::partition(1, 1_699_999_999_990, 42)));
        let mark = d.mark;
        {
            let mut o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
            let home = core_of_device("marked", 2);
            o.stores[home].put(Change::Device { id: "marked", device: Some(&d) });
            o.stores[home].commit();
            o.stores.iter_mut().for_each(|s| s.close().unwrap());
        }
        let marked = |o: &Opened| all_devices(o).into_iter().find(|(id, _)| &**id == "marked").map(|(_, d)| d);
        let o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
        let back = marked(&o).expect("stored");
        assert_eq!(back.mark, MsgKey::partition(1, 1_700_000_000_000, 42));
        assert_eq!(ReadMark::from_key(back.mark), mark);
        assert_eq!(back.telemetry, crate::store::data_of_device(&d).telemetry);
        drop(o);
        let o = open(&dir, 3, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(marked(&o).expect("re-sharded").mark, mark.key(), "through a snapshot");
        assert_eq!(all_devices(&o).len(), 7);
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_recovery_stream_comes_back_until_marked_gone_and_follows_a_reshard() {
        use crate::push::stream::{StoredPid, StoredRecovery};
        let dir = temp_dir("streams");
        let stream = StoredRecovery {
            epoch: 77,
            next_seq: 4,
            first_seq: 2,
            cut_by: 2,
            lost_epoch: 5,
            entries: vec![(2, 1_000, "{\"a\":1}".into()), (3, 1_001, "{\"b\":\"é\"}".into())],
            pids: vec![StoredPid { pid: "p".into(), sid: "s".into(), away_ms: 999, epoch: 77, start_seq: 1 }],
        };
        let id = SessionId(0xfeed_f00d_1234);
        let home = core_of_session(id, 2);
        {
            let mut o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
            o.stores[home].put(Change::Stream { id, recovery: Some(&stream) });
            o.stores[home].commit();
            o.stores.iter_mut().for_each(|s| s.close().unwrap());
        }
        let o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(o.loaded[home].streams.get(&id), Some(&stream));
        drop(o);
        // Three cores: re-sharded into a snapshot, on the session's new core.
        let mut o = open(&dir, 3, Options::new(Duration::ZERO)).unwrap();
        let home = core_of_session(id, 3);
        assert_eq!(o.loaded[home].streams.get(&id), Some(&stream));
        o.stores[home].put(Change::Stream { id, recovery: None });
        o.stores[home].commit();
        o.stores.iter_mut().for_each(|s| s.close().unwrap());
        drop(o);
        let o = open(&dir, 3, Options::new(Duration::ZERO)).unwrap();
        assert!(o.loaded.iter().all(|l| l.streams.is_empty()), "marked gone");
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// Design step 7: a stream's base (tag 8), its appends (tag 10) and pids (tag 11) come
    /// back after a crash (the store dropped unclosed) in the order written; a snapshot's base
    /// that already holds appends committed after its snapshot point gets each frame once.
    #[test]
    fn a_streams_write_ahead_comes_back_over_its_base_and_a_snapshot_once_each() {
        use crate::push::stream::{AppendBatch, StoredPid, StoredRecovery};
        let dir = temp_dir("append");
        let id = SessionId(0xabc);
        let pid = |away_ms| StoredPid { pid: "p".into(), sid: "s".into(), away_ms, epoch: 9, start_seq: 0 };
        let base = StoredRecovery { epoch: 9, next_seq: 1, first_seq: 1, pids: vec![pid(i64::MIN)], ..Default::default() };
        let frames: Vec<std::sync::Arc<str>> = (1..=7).map(|i| format!("f{i}").into()).collect();
        let append = |store: &mut Box<dyn StateStore + Send>, seqs: std::ops::Range<u64>| {
            let mut batch = AppendBatch::default();
            batch.at_ms = 5;
            for seq in seqs {
                batch.add(id, 9, seq, &frames[seq as usize - 1]);
                // Another epoch's append (an older stream) is ignored.
                batch.add(SessionId(0xdef), 3, seq, &frames[0]);
            }
            store.put(Change::StreamAppend(&batch));
            store.commit();
        };
        let seqs = |o: &Opened| o.loaded[0].streams[&id].entries.iter().map(|e| (e.0, e.2.to_string())).collect::<Vec<_>>();
        let want = |n: u64| (1..=n).map(|i| (i, format!("f{i}"))).collect::<Vec<_>>();
        {
            let mut o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
            let store = &mut o.stores[0];
            store.put(Change::Stream { id, recovery: Some(&base) });
            store.commit();
            append(store, 1..4);
            store.put(Change::StreamPids { id, pids: &[pid(1234)] });
            store.commit();
        }
        let mut o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(seqs(&o), want(3));
        let got = &o.loaded[0].streams[&id];
        assert_eq!((got.next_seq, got.first_seq, got.pids.clone()), (4, 1, vec![pid(1234)]));
        // A snapshot whose base is read after two more appends were committed past its point.
        let mut whole = o.loaded[0].streams[&id].clone();
        let store = &mut o.stores[0];
        store.begin_snapshot();
        append(store, 4..6);
        for seq in 4..6 {
            whole.entries.push((seq, 5, frames[seq as usize - 1].clone()));
        }
        whole.next_seq = 6;
        store.put_snapshot(Change::Stream { id, recovery: Some(&whole) });
        store.end_snapshot();
        append(store, 6..8);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while log_files(&dir).len() > 1 || !fs::read_dir(&dir).unwrap().flatten().any(|e| e.file_name().to_string_lossy().ends_with(".snap")) {
            assert!(std::time::Instant::now() < deadline, "snapshot in place");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(o);
        let o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(seqs(&o), want(7), "each frame once, in order");
        assert!(!o.loaded[0].streams.contains_key(&SessionId(0xdef)));
        drop(o);
        // Read back with a bound of about two entries: the oldest go, counted as cut.
        let o = open(&dir, 1, Options { stream_bytes: 2 * (2 + crate::push::stream::ENTRY_OVERHEAD), ..Options::new(Duration::ZERO) }).unwrap();
        let got = &o.loaded[0].streams[&id];
        assert!(got.entries.len() < 7 && got.entries.last().map(|e| e.0) == Some(7), "{:?}", got.entries);
        assert_eq!(got.first_seq, got.entries[0].0);
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// The crash rule (design step 7e): a session core that took in fewer deliveries than
    /// the cores committed as posted to it loses its streams' history (a new epoch, nothing
    /// held), so no client is told it recovered what never reached the stream; equal counts
    /// keep it. Either way the counts are equal for the run that starts.
    #[test]
    fn a_core_that_took_in_fewer_deliveries_than_were_posted_to_it_drops_its_histories() {
        use crate::push::stream::StoredRecovery;
        for (posted, kept) in [(5u64, true), (6, false)] {
            let dir = temp_dir("crash-rule");
            let id = (0u128..).map(SessionId).find(|id| core_of_session(*id, 2) == 1).unwrap();
            let stream = StoredRecovery { epoch: 9, next_seq: 3, first_seq: 1, entries: vec![(1, 5, "a".into()), (2, 5, "b".into())], ..Default::default() };
            {
                let mut o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
                o.stores[0].put(Change::Posted { to: 1, n: 2 });
                o.stores[0].commit();
                o.stores[1].put(Change::Posted { to: 1, n: 3 });
                o.stores[1].put(Change::Stream { id, recovery: Some(&stream) });
                o.stores[1].put(Change::Received { n: 5 });
                o.stores[1].commit();
                o.stores[0].put(Change::Posted { to: 1, n: posted - 3 });
                o.stores[0].commit();
            }
            let o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
            let got = &o.loaded[1].streams[&id];
            assert_eq!(got == &stream, kept, "posted {posted}: {got:?}");
            if !kept {
                assert_ne!(got.epoch, 9);
                assert!(got.entries.is_empty() && got.first_seq == got.next_seq);
            }
            assert_eq!(o.loaded[1].received, posted);
            drop(o);
            let _ = fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn a_changed_core_count_reshards() {
        let dir = temp_dir("reshard");
        write_some(&dir, 2);
        let o = open(&dir, 3, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(o.loaded.len(), 3);
        for (c, l) in o.loaded.iter().enumerate() {
            for id in l.devices.keys() {
                assert_eq!(core_of_device(id, 3), c);
            }
            assert_eq!(l.applied.get("p0"), Some(&2));
        }
        let before = all_devices(&o);
        assert_eq!(before.len(), 6);
        drop(o);
        let again = open(&dir, 3, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(all_devices(&again), before, "the re-sharded state is what the next start finds");
        drop(again);
        let back = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(all_devices(&back), before);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn snapshots_replace_the_logs() {
        let dir = temp_dir("snapshot");
        write_some(&dir, 1);
        let mut o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let state = o.loaded.pop().unwrap();
        let store = &mut o.stores[0];
        store.begin_snapshot();
        for (id, device) in &state.devices {
            store.put_snapshot(Change::Device { id, device: Some(device) });
        }
        store.put_snapshot(Change::Applied { key: "p0", seq: 2 });
        store.end_snapshot();
        store.put(Change::Device { id: "after", device: Some(&device(1.0, "03")) });
        store.commit();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while fs::read_dir(&dir).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().ends_with(".snap")) {
            assert!(std::time::Instant::now() < deadline, "snapshot written");
            std::thread::sleep(Duration::from_millis(10));
        }
        while log_files(&dir).len() > 1 {
            assert!(std::time::Instant::now() < deadline, "old logs removed");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Named in the manifest before the logs it replaces went.
        let snap = fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).find(|n| n.ends_with(".snap")).unwrap();
        let (_, _, gen, _) = parse_name(&snap).unwrap();
        let manifest = fs::read_to_string(dir.join(MANIFEST)).unwrap();
        assert!(manifest.contains(&format!("snap 0 {gen}\n")), "{manifest}");
        o.stores[0].close().unwrap();
        drop(o);
        let again = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let devices = all_devices(&again);
        assert_eq!(devices.len(), 4, "{devices:?}");
        assert!(!devices.iter().any(|(k, _)| &**k == "dev-x"));
        assert_eq!(again.resume_positions().get("p0"), Some(&2));
        let _ = fs::remove_dir_all(&dir);
    }

    /// A crash after a snapshot was named in the manifest, before its replaced logs were
    /// unlinked: a start reads the snapshot, not the logs it replaced (no damage, no older value).
    #[test]
    fn logs_a_snapshot_replaced_but_a_crash_left_are_not_read() {
        let dir = temp_dir("left-logs");
        write_some(&dir, 1);
        let mut o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let state = o.loaded.pop().unwrap();
        let kept: Vec<(PathBuf, Vec<u8>)> = log_files(&dir).into_iter().map(|p| (p.clone(), fs::read(&p).unwrap())).collect();
        assert_eq!(kept.len(), 1, "the log write_some committed to");
        let store = &mut o.stores[0];
        store.put(Change::Device { id: "dev-0-0", device: Some(&device(7.0, "05")) });
        store.commit();
        store.begin_snapshot();
        store.put(Change::Device { id: "dev-0-1", device: None });
        store.commit();
        for (id, device) in state.devices.iter().filter(|(id, _)| id.as_str() != "dev-0-0") {
            store.put_snapshot(Change::Device { id, device: Some(device) });
        }
        store.put_snapshot(Change::Device { id: "dev-0-0", device: Some(&device(7.0, "05")) });
        store.end_snapshot();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while log_files(&dir).len() > 1 {
            assert!(std::time::Instant::now() < deadline, "old logs removed");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(o); // a crash: nothing closed
        // The unlink had not happened: the replaced logs are back (one with the older dev-0-0).
        for (p, b) in &kept {
            fs::write(p, b).unwrap();
        }
        // No damage (a damaged store refuses to start).
        let again = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let devices = all_devices(&again);
        let names: Vec<_> = devices.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(names, ["dev-0-0", "dev-0-2"], "{devices:?}");
        assert_eq!(devices[0].1, crate::store::data_of_device(&device(7.0, "05")), "the snapshot's, not the left log's");
        drop(again);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn restarts_do_not_pile_up_empty_logs() {
        let dir = temp_dir("empty-logs");
        write_some(&dir, 1);
        for _ in 0..3 {
            drop(open(&dir, 1, Options::new(Duration::ZERO)).unwrap());
        }
        let logs = fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".log")).count();
        assert_eq!(logs, 2, "the log with commits and the one the last start began");
        assert_eq!(all_devices(&open(&dir, 1, Options::new(Duration::ZERO)).unwrap()).len(), 3);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A data dir of format version 5 (what main's hubcast wrote before logs were used
    /// again): read as before, and writing goes on in logs of this version after it; the
    /// next start reads both, and a snapshot replaces them.
    #[test]
    fn a_data_dir_of_format_version_5_is_read_and_written_on() {
        read_and_written_on(5);
    }

    /// The same for version 6 (logs written over again, device records not sharing their
    /// frame's keys): what main's hubcast wrote before version 7.
    #[test]
    fn a_data_dir_of_format_version_6_is_read_and_written_on() {
        read_and_written_on(6);
    }

    fn read_and_written_on(version: u32) {
        let (dir, mut o, mut expected) = read_as_written_by_version(&format!("version-{version}"), version);
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        let home = core_of_device("later", 2);
        o.stores[home].put(Change::Device { id: "later", device: Some(&device(5.0, "09")) });
        o.stores[home].commit();
        drop(o); // a crash: nothing closed
        expected.push(("later".into(), crate::store::data_of_device(&device(5.0, "09"))));
        expected.sort_by(|a, b| a.0.cmp(&b.0));
        let versions = |dir: &Path| {
            let mut v: Vec<u32> = log_files(dir).iter().map(|p| u32::from_le_bytes(fs::read(p).unwrap()[8..12].try_into().unwrap())).collect();
            v.sort();
            v
        };
        assert_eq!(versions(&dir), [version, version, format::VERSION], "the old logs and the new one");
        let mut o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(all_devices(&o), expected);
        // A snapshot of the core with both kinds of logs replaces them.
        let state: Vec<_> = o.loaded[home].devices.iter().map(|(k, d)| (k.to_string(), crate::store::data_of_device(d))).collect();
        let store = &mut o.stores[home];
        store.begin_snapshot();
        for (id, d) in &o.loaded[home].devices {
            store.put_snapshot(Change::Device { id, device: Some(d) });
        }
        store.put_snapshot(Change::Applied { key: "p0", seq: 2 });
        store.end_snapshot();
        wait_for(|| dir.join(spare_name(1, home)).exists(), "the replaced log kept as the spare");
        assert!(!state.is_empty());
        o.stores.iter_mut().for_each(|s| s.close().unwrap());
        drop(o);
        let o = open(&dir, 2, Options::new(Duration::ZERO)).unwrap();
        assert_eq!(all_devices(&o), expected);
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Takes a snapshot of `ids` (the state committed so far) and waits until the log it
    /// replaced is the core's spare.
    fn snapshot_and_wait_for_the_spare(dir: &Path, store: &mut Box<dyn StateStore + Send>, ids: &[String]) {
        store.begin_snapshot();
        for (n, id) in ids.iter().enumerate() {
            store.put_snapshot(Change::Device { id, device: Some(&device(n as f64, "01")) });
        }
        store.end_snapshot();
        wait_for(|| dir.join(spare_name(1, 0)).exists(), "the replaced log kept as the spare");
    }

    fn log_of(dir: &Path, gen: u64) -> PathBuf {
        dir.join(file_name(1, 0, gen, "log"))
    }

    /// One core: log 1 with 300 commits; a snapshot point (log 2, one commit) whose snapshot
    /// makes log 1 the spare; a second snapshot point that writes log 3 over the spare, with
    /// three commits; then a crash. Returns the dir and log 3's path.
    fn a_used_again_log() -> (PathBuf, PathBuf, Vec<String>) {
        use std::os::unix::fs::MetadataExt;
        let dir = temp_dir("reuse");
        let mut o = open(&dir, 1, Options::new(Duration::from_secs(3600))).unwrap();
        let store = &mut o.stores[0];
        let ids: Vec<String> = (0..300).map(|n| format!("old-{n}")).collect();
        for (n, id) in ids.iter().enumerate() {
            store.put(Change::Device { id, device: Some(&device(n as f64, "01")) });
            store.commit();
        }
        let inode = fs::metadata(log_of(&dir, 1)).unwrap().ino();
        let old_len = fs::metadata(log_of(&dir, 1)).unwrap().len();
        snapshot_and_wait_for_the_spare(&dir, store, &ids);
        assert!(!log_of(&dir, 1).exists());
        store.put(Change::Device { id: "during", device: Some(&device(1.0, "02")) });
        store.commit();
        store.begin_snapshot();
        let log = log_of(&dir, 3);
        assert_eq!(fs::metadata(&log).unwrap().ino(), inode, "log 3 is log 1's file, written over");
        assert!(!dir.join(spare_name(1, 0)).exists());
        for n in 0..3 {
            store.put(Change::Device { id: &format!("new-{n}"), device: Some(&device(n as f64, "03")) });
            store.commit();
        }
        drop(o); // a crash during the snapshot: nothing closed
        assert_eq!(fs::metadata(&log).unwrap().len(), old_len, "log 1's bytes are still after log 3's commits");
        (dir, log, ids)
    }

    fn checked(log: &Path, gen: u64) -> format::CheckedLog {
        let bytes = fs::read(log).unwrap();
        format::NewestFirst::check_log(&bytes, format::Framing::of(&bytes, gen))
    }

    /// A log a snapshot replaced is kept (not deleted) and written over as a later log; a
    /// start reads that log to its end mark, and not one of the older log's frames after it.
    #[test]
    fn a_log_a_snapshot_replaced_is_written_over_and_read_back_to_its_end_mark() {
        let (dir, log, _) = a_used_again_log();
        let c = checked(&log, 3);
        assert!(c.scan.is_clean(), "{:?}", c.scan);
        assert_eq!(c.commits, 3);
        assert_eq!(c.start, Some((2, c.start.unwrap().1)), "it names log 2");
        let o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let names: Vec<_> = all_devices(&o).into_iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(names.len(), 304, "the snapshot's 300, log 2's and log 3's");
        assert!(names.iter().any(|n| n == "during") && names.iter().any(|n| n == "new-2"));
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A `kill -9` in the middle of a commit's write over an older log's frames: the torn
    /// frame is followed by older frames (valid ones, of another generation), which are not
    /// this log's, so it is the cut-off end a start expects, not damage.
    #[test]
    fn a_torn_write_over_an_older_logs_frames_is_the_cut_off_end() {
        use std::os::unix::fs::FileExt;
        let (dir, log, _) = a_used_again_log();
        let end = checked(&log, 3).end;
        let mut frame = Vec::new();
        let at = format::begin_log_frame(&mut frame);
        format::encode(&mut frame, Change::Device { id: "torn", device: Some(&device(9.0, "09")) });
        format::end_log_frame(&mut frame, at, 3);
        OpenOptions::new().write(true).open(&log).unwrap().write_all_at(&frame[..frame.len() / 2], end as u64).unwrap();
        let c = checked(&log, 3);
        assert_eq!((c.commits, c.end), (3, end));
        assert!(matches!(c.scan.tail, Tail::Bad { offset, .. } if offset == end) && c.scan.damaged.is_empty(), "{:?}", c.scan);
        let o = open(&dir, 1, Options::new(Duration::ZERO)).expect("no damage");
        let names: Vec<_> = all_devices(&o).into_iter().map(|(k, _)| k.to_string()).collect();
        assert!(names.iter().any(|n| n == "new-2") && !names.iter().any(|n| n == "torn"), "{names:?}");
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A snapshot point whose new log fails to open once the spare took its name (a refused
    /// `dup` or `fstat`) goes on in the log it had; the next snapshot point opens the same
    /// generation again, a file now holding the spare's older frames behind that generation's
    /// end mark. It is begun anew: appended after the end mark, its commits were never read
    /// back (the start read the log as holding none and deleted it).
    #[test]
    fn a_snapshot_point_retried_after_a_failed_open_does_not_write_behind_an_end_mark() {
        let dir = temp_dir("retry-open");
        let mut o = open(&dir, 1, Options::new(Duration::from_secs(3600))).unwrap();
        let store = &mut o.stores[0];
        let ids: Vec<String> = (0..50).map(|n| format!("old-{n}")).collect();
        for (n, id) in ids.iter().enumerate() {
            store.put(Change::Device { id, device: Some(&device(n as f64, "01")) });
            store.commit();
        }
        snapshot_and_wait_for_the_spare(&dir, store, &ids);
        store.put(Change::Device { id: "during", device: Some(&device(1.0, "02")) });
        store.commit();
        FAIL_NEXT_OPEN.lock().unwrap().push(dir.clone());
        let failures = STATS.write_errors.load(Ordering::Relaxed);
        store.begin_snapshot();
        assert!(STATS.write_errors.load(Ordering::Relaxed) > failures, "the failed open is counted");
        assert!(!dir.join(spare_name(1, 0)).exists() && log_of(&dir, 3).exists(), "the spare took log 3's name before the open failed");
        store.put(Change::Device { id: "still-in-2", device: Some(&device(2.0, "03")) });
        store.commit();
        // The retry: log 3 again, no spare now.
        store.begin_snapshot();
        store.put(Change::Device { id: "in-3", device: Some(&device(3.0, "04")) });
        store.commit();
        let c = checked(&log_of(&dir, 3), 3);
        assert_eq!(c.commits, 1, "{:?}", c.scan);
        drop(o); // a crash during the snapshot
        let o = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let names: Vec<_> = all_devices(&o).into_iter().map(|(k, _)| k.to_string()).collect();
        for id in ["during", "still-in-2", "in-3", "old-49"] {
            assert!(names.iter().any(|n| n == id), "{id} missing: {names:?}");
        }
        drop(o);
        let _ = fs::remove_dir_all(&dir);
    }

    /// Damage in the middle of a log written over an older one (a bad commit with commits of
    /// its own after it) stops the start, as in any log.
    #[test]
    fn damage_in_the_middle_of_a_used_again_log_stops_the_start() {
        let (dir, log, _) = a_used_again_log();
        let mut bytes = fs::read(&log).unwrap();
        bytes[16 + format::LOG_FRAME_HEAD + 20] ^= 0x40;
        fs::write(&log, bytes).unwrap();
        let err = open(&dir, 1, Options::new(Duration::ZERO)).err().expect("refused");
        let name = log.file_name().unwrap().to_string_lossy().into_owned();
        assert!(err.contains(&name) && err.contains("at byte 16 ") && err.contains("--store-start-damaged"), "{err}");
        let _ = fs::remove_dir_all(&dir);
    }

    /// What a power loss may leave once the core no longer syncs the log it finishes at a
    /// snapshot point: the new log's commits on disk, the finished log's last commits not (the
    /// kernel wrote the pages back in that order). The new log names where the finished one
    /// ended: the start sees the hole, loads the finished log to where it ends, and does not
    /// load the later commits over it (an AMQP position among them would skip the lost
    /// events); the new log is kept aside, and the next start finds the same state.
    #[test]
    fn a_finished_logs_lost_tail_under_a_newer_logs_commits_is_not_loaded_over() {
        let dir = temp_dir("hole");
        let mut o = open(&dir, 1, Options::new(Duration::from_secs(3600))).unwrap();
        let store = &mut o.stores[0];
        for (n, id) in ["a", "b", "c"].into_iter().enumerate() {
            store.put(Change::Device { id, device: Some(&device(n as f64, "01")) });
            store.put(Change::Applied { key: "p0", seq: n as i64 + 1 });
            store.commit();
        }
        store.begin_snapshot();
        store.put(Change::Device { id: "d", device: Some(&device(4.0, "01")) });
        store.put(Change::Applied { key: "p0", seq: 4 });
        store.commit();
        drop(o); // the power loss: the snapshot not written
        let finished = log_of(&dir, 1);
        let len = fs::metadata(&finished).unwrap().len();
        // c's commit did not reach the disk; log 2's did.
        OpenOptions::new().write(true).open(&finished).unwrap().set_len(len - 5).unwrap();
        // With a sync per commit no power loss leaves this: damage, refused without the flag.
        let err = open(&dir, 1, Options::new(Duration::ZERO)).err().expect("refused");
        assert!(err.contains("e1-c0-0000000002.log") && err.contains("--store-start-damaged"), "{err}");
        let interval = || Options::new(Duration::from_secs(3600));
        let damaged_before = STATS.damaged_files.load(Ordering::Relaxed);
        let o = open(&dir, 1, interval()).unwrap();
        assert!(STATS.damaged_files.load(Ordering::Relaxed) > damaged_before, "counted");
        let names: Vec<_> = all_devices(&o).into_iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(names, ["a", "b"], "the state at the hole, no later commit over it");
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        drop(o);
        assert!(!log_of(&dir, 2).exists());
        let aside = fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with("e1-c0-0000000002.log.damaged-")).count();
        assert_eq!(aside, 1, "log 2 kept aside");
        let o = open(&dir, 1, interval()).unwrap();
        assert_eq!(all_devices(&o).len(), 2);
        assert_eq!(o.resume_positions().get("p0"), Some(&2));
        drop(o);
        // A log the next one names missing is the same hole.
        let dir2 = temp_dir("hole-missing");
        let mut o = open(&dir2, 1, Options::new(Duration::from_secs(3600))).unwrap();
        o.stores[0].put(Change::Device { id: "a", device: Some(&device(1.0, "01")) });
        o.stores[0].commit();
        o.stores[0].begin_snapshot();
        o.stores[0].put(Change::Device { id: "b", device: Some(&device(2.0, "01")) });
        o.stores[0].commit();
        drop(o);
        fs::remove_file(log_of(&dir2, 1)).unwrap();
        let o = open(&dir2, 1, interval()).unwrap();
        assert!(all_devices(&o).is_empty());
        drop(o);
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&dir2);
    }

    fn finished_log_syncs(dir: &Path) -> Vec<String> {
        FINISHED_LOG_SYNCS.lock().unwrap().iter().filter(|(d, _)| d == dir).map(|(_, t)| t.clone()).collect()
    }

    /// The core hands the log a snapshot point finished to another thread to sync (issue 25:
    /// a 10–30 ms `fdatasync` on the core); the snapshot thread syncs it before the snapshot
    /// replaces it, and a shutdown during the snapshot syncs it too.
    #[test]
    fn a_snapshot_point_leaves_the_finished_logs_sync_to_another_thread() {
        let dir = temp_dir("finished-sync");
        write_some(&dir, 1);
        // The sync thread sleeps through the test: the snapshot thread is the one.
        let mut o = open(&dir, 1, Options::new(Duration::from_secs(3600))).unwrap();
        let state = o.loaded.pop().unwrap();
        let store = &mut o.stores[0];
        store.put(Change::Device { id: "before", device: Some(&device(1.0, "03")) });
        store.commit();
        store.begin_snapshot();
        assert_eq!(finished_log_syncs(&dir), Vec::<String>::new(), "the core did not sync the finished log");
        store.put(Change::Device { id: "during", device: Some(&device(2.0, "04")) });
        store.commit();
        for (id, device) in &state.devices {
            store.put_snapshot(Change::Device { id, device: Some(device) });
        }
        store.put_snapshot(Change::Device { id: "before", device: Some(&device(1.0, "03")) });
        store.end_snapshot();
        wait_for(|| log_files(&dir).len() <= 1, "old logs replaced");
        assert_eq!(finished_log_syncs(&dir), vec!["hubcast-snapshot-0".to_string()], "synced once, by the snapshot thread, before it is replaced");
        // A shutdown at a snapshot point: the finished log is synced by the flush.
        o.stores[0].begin_snapshot();
        o.stores[0].close().unwrap();
        assert_eq!(finished_log_syncs(&dir).len(), 2);
        drop(o);
        let again = open(&dir, 1, Options::new(Duration::ZERO)).unwrap();
        let names: Vec<_> = all_devices(&again).into_iter().map(|(k, _)| k).collect();
        assert!(names.iter().any(|k| &**k == "before") && names.iter().any(|k| &**k == "during"), "{names:?}");
        let _ = fs::remove_dir_all(&dir);
    }
}
