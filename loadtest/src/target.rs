//! The hubcast under test: started by the harness (`--spawn`) or already running (`--url`,
//! `--pid`), always on a loopback address. Also what is read from outside the process: CPU
//! time and RSS from `/proc/<pid>/…`, counters from `GET /metrics`.

use std::io::{self, BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::http::HttpConn;

/// How to reach (or start) hubcast.
#[derive(Clone, Debug)]
pub struct TargetSpec {
    /// `http://127.0.0.1:PORT` of a running hubcast (ignored with `spawn`).
    pub url: Option<String>,
    pub admin_key: String,
    pub pid: Option<u32>,
    /// Path of the hubcast binary to start.
    pub spawn: Option<String>,
    pub cores: Option<usize>,
    /// More arguments for a spawned hubcast.
    pub extra_args: Vec<String>,
    /// CPUs hubcast is pinned to (`--pin`).
    pub cpus: Option<Vec<usize>>,
}

/// A hubcast to drive.
pub struct Target {
    pub addr: SocketAddr,
    pub admin_key: String,
    pub pid: Option<u32>,
    /// Runtimes (cores) hubcast said it runs, when it was spawned here.
    pub cores: Option<usize>,
    /// hubcast's `Cpus_allowed_list` read back from /proc after `--pin` (what it may run on).
    pub cpus_allowed: Option<String>,
    child: Option<Child>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The data dir made for a spawned hubcast (removed on drop).
    data_dir: Option<std::path::PathBuf>,
}

/// Resolves `url` (`http://host:port[/]`) and refuses anything but loopback.
pub fn loopback_addr(url: &str) -> io::Result<SocketAddr> {
    let rest = url.strip_prefix("http://").ok_or_else(|| io::Error::other(format!("{url}: only http:// URLs")))?;
    let hostport = rest.split('/').next().unwrap_or(rest);
    let addr = hostport
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::other(format!("{url}: no address")))?;
    if !is_loopback(addr.ip()) {
        return Err(io::Error::other(format!(
            "{url}: hubcast-load only drives a hubcast on this machine's loopback (127.0.0.0/8, ::1)"
        )));
    }
    Ok(addr)
}

fn is_loopback(ip: IpAddr) -> bool {
    ip.is_loopback()
}

impl Target {
    /// Starts or attaches as `spec` says; `more_args` go to a spawned hubcast (e.g. the AMQP
    /// connection string of the harness's own endpoint).
    pub fn open(spec: &TargetSpec, more_args: &[String]) -> io::Result<Target> {
        match &spec.spawn {
            Some(path) => Self::spawn(path, spec, more_args),
            None => {
                let url = spec.url.as_deref().unwrap_or("http://127.0.0.1:8080");
                let addr = loopback_addr(url)?;
                match (spec.pid, &spec.cpus) {
                    (Some(pid), Some(cpus)) => crate::pin::pin_process(pid, cpus)
                        .map_err(|e| io::Error::other(format!("cannot pin hubcast (pid {pid}): {e}")))?,
                    (None, Some(_)) => return Err(io::Error::other("--pin needs --spawn or --pid")),
                    _ => {}
                }
                Ok(Target {
                    addr,
                    admin_key: spec.admin_key.clone(),
                    pid: spec.pid,
                    cores: spec.cores,
                    cpus_allowed: spec.cpus.as_ref().and(spec.pid).and_then(cpus_allowed),
                    child: None,
                    stderr: Default::default(),
                    data_dir: None,
                })
            }
        }
    }

    fn spawn(path: &str, spec: &TargetSpec, more_args: &[String]) -> io::Result<Target> {
        let mut cmd = Command::new(path);
        cmd.args(["--bind", "127.0.0.1", "--primary-admin-secret", &spec.admin_key]);
        // `warn` unless the arguments name a level (the fleet's `--logs` reads `info`).
        if !spec.extra_args.iter().chain(more_args).any(|a| a == "--log-level" || a.starts_with("--log-level=")) {
            cmd.args(["--log-level", "warn"]);
        }
        // A free port, unless the arguments name one (a restart on the same port).
        if !spec.extra_args.iter().chain(more_args).any(|a| a == "--port" || a.starts_with("--port=")) {
            cmd.args(["--port", "0"]);
        }
        // Every simulated client comes from 127.0.0.1: the per-client rate limit on new
        // sessions and handshakes (hubcast's --client-rate) is off for a spawned target.
        cmd.args(["--client-rate", "0"]);
        if let Some(c) = spec.cores {
            cmd.args(["--cores", &c.to_string()]);
        }
        // Each spawned hubcast gets a fresh data dir of its own (one owner per data dir),
        // unless the arguments name one (`--hubcast-arg=--data-dir=none` measures memory only).
        let names_dir = spec.extra_args.iter().chain(more_args).any(|a| a.starts_with("--data-dir"));
        let data_dir = (!names_dir).then(|| {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
            std::env::temp_dir().join(format!("hubcast-load-{}-{nanos}", std::process::id()))
        });
        if let Some(dir) = &data_dir {
            cmd.arg("--data-dir").arg(dir);
        }
        cmd.args(&spec.extra_args).args(more_args);
        // The environment must not configure the server under test behind our back.
        for (k, _) in std::env::vars() {
            let upper = k.to_ascii_uppercase();
            if upper.contains("EVENT_HUB") || upper.contains("EVENTHUB") || upper.starts_with("MAX_") || upper == "PORT" || upper == "CORES" {
                cmd.env_remove(&k);
            }
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        if let Some(cpus) = spec.cpus.clone() {
            use std::os::unix::process::CommandExt;
            // SAFETY: runs in the child between fork and exec; set_affinity does not allocate.
            unsafe {
                cmd.pre_exec(move || crate::pin::set_affinity(0, &cpus));
            }
        }
        let mut child = cmd.spawn().map_err(|e| io::Error::other(format!("cannot start {path}: {e}")))?;
        let stderr = Arc::new(Mutex::new(Vec::new()));
        {
            let pipe = child.stderr.take().expect("piped");
            let lines = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    let mut all = lines.lock().unwrap();
                    if all.len() >= 5000 {
                        all.remove(0);
                    }
                    all.push(line);
                }
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let pipe = child.stdout.take().expect("piped");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        // Long enough for a restart on a large store (1 M devices) on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(120);
        let (url, cores) = loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    // "hubcast 0.1.0 listening on http://127.0.0.1:PORT (N cores, io_uring)"
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        let url = rest.split_whitespace().next().unwrap_or_default().trim_end_matches('/').to_string();
                        let cores = rest.split('(').nth(1).and_then(|r| r.split_whitespace().next()?.parse().ok());
                        break (url, cores);
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io::Error::other(format!(
                        "{path} did not print its address within 120 s:\n{}",
                        stderr.lock().unwrap().join("\n")
                    )));
                }
            }
        };
        let addr = loopback_addr(&url)?;
        let cpus_allowed = spec.cpus.as_ref().and_then(|_| cpus_allowed(child.id()));
        Ok(Target {
            addr,
            admin_key: spec.admin_key.clone(),
            pid: Some(child.id()),
            cores,
            cpus_allowed,
            child: Some(child),
            stderr,
            data_dir,
        })
    }

    /// `kill -9` of a spawned hubcast, reaped: a crash, no shutdown and no final commit.
    pub fn kill_hard(&mut self) -> io::Result<()> {
        let child = self.child.as_mut().ok_or_else(|| io::Error::other("only a spawned hubcast can be killed"))?;
        child.kill()?;
        child.wait()?;
        self.child = None;
        Ok(())
    }

    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The last lines hubcast wrote to stderr (spawned only).
    pub fn log_tail(&self, n: usize) -> String {
        let lines = self.stderr.lock().unwrap();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Every line hubcast wrote to stderr that is still kept (the last 5,000; spawned only).
    pub fn log_lines(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits until `GET /status` answers 200 (every source connected).
    pub async fn wait_ready(&self, within: Duration) -> io::Result<()> {
        let deadline = Instant::now() + within;
        let mut conn = HttpConn::new(self.addr);
        loop {
            let last = match conn.call("GET", "/status", &[], b"").await {
                Ok(r) if r.status == 200 => return Ok(()),
                Ok(r) => format!("{} {}", r.status, r.text()),
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                return Err(io::Error::other(format!("GET /status still answers {last} after {within:?}\n{}", self.log_tail(20))));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `GET /metrics` parsed into (series with labels, value).
    pub async fn metrics(&self) -> io::Result<Metrics> {
        let mut conn = HttpConn::new(self.addr);
        let r = conn.call("GET", "/metrics", &[("shared-access-key", &self.admin_key)], b"").await?;
        if r.status != 200 {
            return Err(io::Error::other(format!("GET /metrics answered {}: {}", r.status, r.text())));
        }
        Ok(Metrics::parse(&r.text()))
    }

    /// CPU time and memory of the hubcast process, if its pid is known.
    pub fn proc_sample(&self) -> Option<ProcSample> {
        ProcSample::of(self.pid?)
    }
}

/// The CPUs process `pid` may run on, as the kernel lists them (`0`, `0-1`).
pub fn cpus_allowed(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_string())
}

impl Drop for Target {
    fn drop(&mut self) {
        // A spawned hubcast that panicked or logged errors says so in the harness's output.
        let lines = self.stderr.lock().unwrap();
        let bad: Vec<&String> = lines.iter().filter(|l| l.contains("panicked") || l.contains("ERROR")).take(20).collect();
        if !bad.is_empty() {
            eprintln!("hubcast-load: hubcast's log:");
            for l in bad {
                eprintln!("  {l}");
            }
        }
        drop(lines);
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = &self.data_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Prometheus text, kept as (series, value) lines.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub lines: Vec<(String, f64)>,
}

impl Metrics {
    pub fn parse(text: &str) -> Self {
        let lines = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                Some((series.to_string(), value.trim().parse().ok()?))
            })
            .collect();
        Self { lines }
    }

    /// Sum of every series of metric `name` (all label sets).
    pub fn sum(&self, name: &str) -> f64 {
        self.lines
            .iter()
            .filter(|(s, _)| s == name || (s.starts_with(name) && s.as_bytes().get(name.len()) == Some(&b'{')))
            .map(|(_, v)| v)
            .sum()
    }

    /// Value of one series, labels included (`name{label="x"}`).
    pub fn get(&self, series: &str) -> f64 {
        self.lines.iter().find(|(s, _)| s == series).map_or(0.0, |(_, v)| *v)
    }
}

/// CPU time (user + system) and resident memory of a process at one moment.
#[derive(Clone, Debug)]
pub struct ProcSample {
    pub at: Instant,
    pub cpu_secs: f64,
    /// Of `cpu_secs`, the time spent in the kernel.
    pub sys_secs: f64,
    pub rss_kb: u64,
    pub peak_rss_kb: u64,
    /// Voluntary context switches of hubcast's core threads (`hubcast-core-*`): how often a
    /// core went to sleep and was woken again.
    pub core_vcsw: u64,
    /// Involuntary context switches of hubcast's AMQP consumer thread (`hubcast-amqp`): how
    /// often it was preempted (on a shared CPU, by a core it woke).
    pub amqp_nvcsw: u64,
    /// Time each of its threads spent runnable but waiting for a CPU so far, ns
    /// (`task/*/schedstat`), by thread (tid, start time in clock ticks), sorted. Kept per
    /// thread, not summed: the kernel keeps no per-process sum of it (an exited thread's CPU
    /// time is added to the process's `stat`, its run delay to nothing, and
    /// `/proc/PID/schedstat` is the main thread's alone), so a sum over the threads alive at
    /// each sample lost a thread that exited in between, with all it had waited before the
    /// first (the difference could even go below 0). See [`ProcSample::run_queue_ms_per_s`].
    pub run_delay: Vec<((u32, u64), u64)>,
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Per-thread figures of the process in `dir`, from `task/*/status`, `task/*/stat` and
/// `task/*/schedstat`: (voluntary switches summed over the `hubcast-core-*` threads,
/// involuntary switches of the `hubcast-amqp` thread, the time each thread spent runnable but
/// waiting for a CPU, ns, as [`ProcSample::run_delay`]).
fn thread_stats(dir: &str) -> (u64, u64, Vec<((u32, u64), u64)>) {
    let (mut core_vcsw, mut amqp_nvcsw, mut run_delay) = (0, 0, Vec::new());
    let Ok(tasks) = std::fs::read_dir(format!("{dir}/task")) else { return (0, 0, run_delay) };
    for task in tasks.flatten() {
        // schedstat: time on a CPU, time waiting on a run queue (ns), timeslices. The thread
        // is named by its tid and start time (stat's field 22): a tid can be reused.
        let tid: Option<u32> = task.file_name().to_str().and_then(|t| t.parse().ok());
        let started = std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse::<u64>().ok());
        let delay = std::fs::read_to_string(task.path().join("schedstat")).ok().and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok());
        if let (Some(tid), Some(started), Some(delay)) = (tid, started, delay) {
            run_delay.push(((tid, started), delay));
        }
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else { continue };
        let field = |key: &str| -> u64 {
            status.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
        };
        let name = status.lines().find_map(|l| l.strip_prefix("Name:")).unwrap_or("").trim();
        if name.starts_with("hubcast-core") {
            core_vcsw += field("voluntary_ctxt_switches:");
        } else if name.starts_with("hubcast-amqp") {
            amqp_nvcsw += field("nonvoluntary_ctxt_switches:");
        }
    }
    run_delay.sort_unstable();
    (core_vcsw, amqp_nvcsw, run_delay)
}

impl ProcSample {
    pub fn of(pid: u32) -> Option<Self> {
        Self::read(&format!("/proc/{pid}"))
    }

    /// The harness itself (the load generator shares the cores with hubcast).
    pub fn this_process() -> Option<Self> {
        Self::read("/proc/self")
    }

    fn read(dir: &str) -> Option<Self> {
        let at = Instant::now();
        let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
        // Fields after the command name (which may hold spaces), starting at field 3 (state).
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        let status = std::fs::read_to_string(format!("{dir}/status")).ok()?;
        let kb = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        let (core_vcsw, amqp_nvcsw, run_delay) = thread_stats(dir);
        Some(Self {
            at,
            cpu_secs: (utime + stime) as f64 / clock_ticks(),
            sys_secs: stime as f64 / clock_ticks(),
            rss_kb: kb("VmRSS:"),
            peak_rss_kb: kb("VmHWM:"),
            core_vcsw,
            amqp_nvcsw,
            run_delay,
        })
    }

    /// Milliseconds per second (of wall time) the process's threads spent runnable but
    /// waiting for a CPU between two samples, summed over threads: on a machine shared with
    /// other work, what the latency of a pinned server owes to its CPU being taken. Each
    /// thread alive at `later` counts what it waited since `self` (all it waited, if it started
    /// since); a thread that exited in between counts nothing, so its wait between `self` and
    /// its exit is missing (the kernel keeps it nowhere): an undercount by at most that, where
    /// a difference of sums also took off all it had waited before `self`.
    pub fn run_queue_ms_per_s(&self, later: &ProcSample) -> f64 {
        let wall = later.at.duration_since(self.at).as_secs_f64();
        if wall <= 0.0 {
            return 0.0;
        }
        let before = |thread: &(u32, u64)| self.run_delay.binary_search_by(|(t, _)| t.cmp(thread)).map_or(0, |i| self.run_delay[i].1);
        let waited: u64 = later.run_delay.iter().map(|(thread, ns)| ns.saturating_sub(before(thread))).sum();
        waited as f64 / 1e6 / wall
    }

    /// Per-thread context switches between two samples: (core threads' voluntary, the AMQP
    /// thread's involuntary).
    pub fn switches(&self, later: &ProcSample) -> (u64, u64) {
        (later.core_vcsw.saturating_sub(self.core_vcsw), later.amqp_nvcsw.saturating_sub(self.amqp_nvcsw))
    }

    /// CPU use between two samples, in cores (1.0 = one core busy all the time).
    pub fn cores_used(&self, later: &ProcSample) -> f64 {
        let wall = later.at.duration_since(self.at).as_secs_f64();
        if wall <= 0.0 {
            0.0
        } else {
            (later.cpu_secs - self.cpu_secs) / wall
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_cover_every_label_set_and_only_that_metric() {
        let m = Metrics::parse(
            "# HELP x\nhubcast_messages_in_total{source=\"Telemetry\"} 10\nhubcast_messages_in_total{source=\"twinChangeEvents\"} 2\n\
             hubcast_messages_in_total_other 100\nhubcast_sockets 7\n",
        );
        assert_eq!(m.sum("hubcast_messages_in_total"), 12.0);
        assert_eq!(m.sum("hubcast_sockets"), 7.0);
        assert_eq!(m.get("hubcast_messages_in_total{source=\"Telemetry\"}"), 10.0);
    }

    #[test]
    fn only_loopback_targets_are_accepted() {
        assert!(loopback_addr("http://127.0.0.1:8080").is_ok());
        assert!(loopback_addr("http://127.0.0.2:8080/").is_ok());
        assert!(loopback_addr("http://10.0.0.1:8080").is_err());
        assert!(loopback_addr("https://127.0.0.1:8080").is_err());
    }

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let s = ProcSample::this_process().expect("/proc is readable");
        assert!(s.rss_kb > 0);
        assert!(s.cpu_secs >= 0.0);
    }

    /// A thread that exited between two samples takes nothing off the others' wait (a
    /// difference of sums took off all it had waited before: here 0 ms/s); a thread started
    /// since counts all it waited.
    #[test]
    fn a_thread_that_exits_between_two_samples_takes_nothing_off_the_run_queue_wait() {
        let at = Instant::now();
        let sample = |at: Instant, run_delay: Vec<((u32, u64), u64)>| ProcSample {
            at,
            cpu_secs: 0.0,
            sys_secs: 0.0,
            rss_kb: 0,
            peak_rss_kb: 0,
            core_vcsw: 0,
            amqp_nvcsw: 0,
            run_delay,
        };
        let ms = 1_000_000;
        // Thread 10 waits 10 ms more; 11 (had waited 1 s) exits; 12 starts and waits 5 ms; tid
        // 13 is reused by a thread started later (its count starts again).
        let before = sample(at, vec![((10, 1), 10 * ms), ((11, 1), 1000 * ms), ((13, 1), 500 * ms)]);
        let after = sample(at + Duration::from_secs(1), vec![((10, 1), 20 * ms), ((12, 7), 5 * ms), ((13, 9), 2 * ms)]);
        let waited = before.run_queue_ms_per_s(&after);
        assert!((waited - 17.0).abs() < 1e-9, "{waited} ms/s");
    }

    #[test]
    fn threads_sharing_one_cpu_count_their_wait_for_it() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        // Two threads busy on CPU 0: each waits while the other runs. Sampled while they
        // live (a thread's figures leave /proc/self/task with it).
        let stop = Arc::new(AtomicBool::new(false));
        let spin = |stop: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                crate::pin::set_affinity(0, &[0]).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let threads = [spin(stop.clone()), spin(stop.clone())];
        std::thread::sleep(Duration::from_millis(50));
        let before = ProcSample::this_process().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let after = ProcSample::this_process().unwrap();
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        // About 500 ms per second between the two (more on a busy machine).
        let waited = before.run_queue_ms_per_s(&after);
        assert!(waited > 200.0, "{waited} ms/s");
    }
}
