//! CPU pinning (`--pin`): hubcast and the harness on separate CPUs, as `taskset -c` would
//! put them, so that a per-core figure is not a share of cores the load generator also uses.
//!
//! Done with `sched_setaffinity(2)` rather than by running `taskset`: the harness pins itself
//! before its runtime starts (every thread it makes inherits the mask), a spawned hubcast is
//! pinned between `fork` and `exec` (so all its threads, the AMQP one too, inherit it), and a
//! hubcast given by `--pid` has each of its threads pinned.

use std::io;

/// Where each side runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinning {
    pub hubcast: Vec<usize>,
    pub harness: Vec<usize>,
}

impl Pinning {
    /// hubcast on `hubcast` (default: the first `cores` CPUs, 1 if not given), the harness
    /// on `harness` (default: every other CPU). Refuses overlapping or missing CPUs.
    pub fn plan(hubcast: Option<&str>, harness: Option<&str>, cores: Option<usize>, online: usize) -> io::Result<Self> {
        let hubcast = match hubcast {
            Some(list) => parse_list(list)?,
            None => (0..cores.unwrap_or(1).max(1)).collect(),
        };
        let harness = match harness {
            Some(list) => parse_list(list)?,
            None => (0..online).filter(|c| !hubcast.contains(c)).collect(),
        };
        if let Some(c) = hubcast.iter().chain(&harness).find(|c| **c >= online) {
            return Err(io::Error::other(format!("--pin: CPU {c} does not exist here ({online} online)")));
        }
        if harness.is_empty() {
            return Err(io::Error::other(format!(
                "--pin: no CPU left for the harness (hubcast has {hubcast:?} of {online}); give fewer --cores or --hubcast-cpus"
            )));
        }
        if let Some(c) = hubcast.iter().find(|c| harness.contains(c)) {
            return Err(io::Error::other(format!("--pin: CPU {c} is given to both hubcast and the harness")));
        }
        Ok(Self { hubcast, harness })
    }

    pub fn describe(&self) -> String {
        format!("hubcast on CPU {}, harness on CPU {}", show(&self.hubcast), show(&self.harness))
    }
}

fn show(cpus: &[usize]) -> String {
    cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// A `taskset -c` list: `0`, `0,2`, `1-3`.
pub fn parse_list(list: &str) -> io::Result<Vec<usize>> {
    let bad = || io::Error::other(format!("{list:?} is not a CPU list (e.g. 0 or 0,2-3)"));
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
        if a > b || b >= libc::CPU_SETSIZE as usize {
            return Err(bad());
        }
        cpus.extend(a..=b);
    }
    cpus.sort_unstable();
    cpus.dedup();
    if cpus.is_empty() {
        return Err(bad());
    }
    Ok(cpus)
}

/// CPUs online on this machine (not `available_parallelism`, which shrinks to the calling
/// thread's mask once the harness has pinned itself).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|n| *n > 0).unwrap_or(1)
}

/// Pins thread or process `tid` (0: the calling thread) to `cpus`. Async-signal-safe (it is
/// called between `fork` and `exec`): no allocation.
pub fn set_affinity(tid: libc::pid_t, cpus: &[usize]) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it (cpus were checked
    // against CPU_SETSIZE); sched_setaffinity reads `size_of` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Pins every thread of a running process (a hubcast given by `--pid`).
pub fn pin_process(pid: u32, cpus: &[usize]) -> io::Result<()> {
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Some(tid) = entry?.file_name().to_str().and_then(|t| t.parse().ok()) {
            set_affinity(tid, cpus)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_taskset() {
        assert_eq!(parse_list("0").unwrap(), vec![0]);
        assert_eq!(parse_list("3,0-1").unwrap(), vec![0, 1, 3]);
        assert!(parse_list("").is_err());
        assert!(parse_list("2-1").is_err());
        assert!(parse_list("a").is_err());
    }

    #[test]
    fn the_default_plan_splits_the_cpus() {
        let p = Pinning::plan(None, None, None, 2).unwrap();
        assert_eq!((p.hubcast, p.harness), (vec![0], vec![1]));
        let p = Pinning::plan(None, None, Some(2), 4).unwrap();
        assert_eq!((p.hubcast, p.harness), (vec![0, 1], vec![2, 3]));
        assert!(Pinning::plan(None, None, Some(2), 2).is_err(), "nothing left for the harness");
        assert!(Pinning::plan(Some("0"), Some("0"), None, 2).is_err(), "overlap");
        assert!(Pinning::plan(Some("5"), None, None, 2).is_err(), "no such CPU");
    }

    #[test]
    fn the_plan_does_not_change_once_the_harness_is_pinned() {
        let online = online_cpus();
        let before = Pinning::plan(None, None, None, online);
        std::thread::spawn(move || {
            set_affinity(0, &[0]).unwrap();
            assert_eq!(online_cpus(), online);
            assert_eq!(Pinning::plan(None, None, None, online_cpus()).ok(), before.ok());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_can_be_pinned_to_a_cpu_it_may_use() {
        // Pin a scratch thread (not the test runner's) to CPU 0 and read the mask back.
        std::thread::spawn(|| {
            set_affinity(0, &[0]).unwrap();
            // SAFETY: as in set_affinity.
            let on_zero = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
                libc::CPU_ISSET(0, &set) && libc::CPU_COUNT(&set) == 1
            };
            assert!(on_zero);
        })
        .join()
        .unwrap();
    }
}
