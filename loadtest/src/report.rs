//! Results: the parameters of a run and its measured rows, printed as a table and written as
//! JSON. Also the machine description that goes with every report.

use serde_json::{json, Map, Value};

/// One run of one mode.
#[derive(Clone, Debug, Default)]
pub struct Results {
    pub name: String,
    pub params: Vec<(String, Value)>,
    /// Measured rows (one per step); every row has the same keys, in order.
    pub rows: Vec<Vec<(String, Value)>>,
}

/// A row under construction.
#[derive(Default)]
pub struct Row(pub Vec<(String, Value)>);

impl Row {
    pub fn put(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        self.0.push((key.to_string(), value.into()));
        self
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl Results {
    pub fn new(name: &str) -> Self {
        Self { name: name.to_string(), ..Default::default() }
    }

    pub fn param(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        self.params.push((key.to_string(), value.into()));
        self
    }

    pub fn row(&mut self, row: Row) {
        self.rows.push(row.0);
    }

    /// A value of the last row.
    pub fn last(&self, key: &str) -> Option<f64> {
        self.rows.last()?.iter().find(|(k, _)| k == key)?.1.as_f64()
    }

    pub fn to_json(&self) -> Value {
        let obj = |items: &[(String, Value)]| Value::Object(items.iter().cloned().collect::<Map<_, _>>());
        json!({
            "name": self.name,
            "params": obj(&self.params),
            "rows": self.rows.iter().map(|r| obj(r)).collect::<Vec<_>>(),
        })
    }

    pub fn table(&self) -> String {
        let mut out = format!("== {} ==\n", self.name);
        if !self.params.is_empty() {
            let p: Vec<String> = self.params.iter().map(|(k, v)| format!("{k}={}", show(v))).collect();
            out.push_str(&p.join("  "));
            out.push('\n');
        }
        let Some(first) = self.rows.first() else { return out };
        let headers: Vec<&str> = first.iter().map(|(k, _)| k.as_str()).collect();
        let cells: Vec<Vec<String>> = self.rows.iter().map(|r| r.iter().map(|(_, v)| show(v)).collect()).collect();
        let widths: Vec<usize> = headers
            .iter()
            .enumerate()
            .map(|(i, h)| cells.iter().map(|r| r.get(i).map_or(0, String::len)).max().unwrap_or(0).max(h.len()))
            .collect();
        let line = |items: Vec<&str>| -> String {
            items.iter().zip(&widths).map(|(s, w)| format!("{s:>w$}")).collect::<Vec<_>>().join("  ")
        };
        out.push_str(&line(headers.clone()));
        out.push('\n');
        for r in &cells {
            out.push_str(&line(r.iter().map(String::as_str).collect()));
            out.push('\n');
        }
        out
    }
}

/// A number for people: thousands grouped, few decimals.
pub fn show(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(0.0);
            if f.abs() >= 1000.0 {
                group(f.round() as i64)
            } else if f.abs() >= 10.0 {
                format!("{f:.1}")
            } else {
                format!("{f:.3}")
            }
        }
        Value::Number(n) => n.as_i64().map_or_else(|| n.to_string(), group),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn group(n: i64) -> String {
    let s = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// nproc, CPU model, kernel, memory: the machine the figures belong to.
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, m)| m.trim().to_string()))
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    json!({
        "nproc": nproc,
        "cpu": model,
        "kernel": kernel,
        "memory_gib": (mem_kb as f64 / 1024.0 / 1024.0 * 10.0).round() / 10.0,
        "nofile_hard_limit": limit.rlim_max,
    })
}

/// Raises this process's open-file soft limit to its hard limit; returns the new soft limit.
pub fn raise_file_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 0;
        }
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
            return raised.rlim_cur;
        }
    }
    limit.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_grouped_and_rounded_for_the_table() {
        assert_eq!(show(&json!(1234567)), "1,234,567");
        assert_eq!(show(&json!(1234567.8)), "1,234,568");
        assert_eq!(show(&json!(12.345)), "12.3");
        assert_eq!(show(&json!(0.5)), "0.500");
        assert_eq!(show(&json!(-1000)), "-1,000");
    }

    #[test]
    fn a_table_has_a_header_and_a_line_per_row() {
        let mut r = Results::new("x");
        r.param("clients", 10);
        let mut row = Row::default();
        row.put("rate", 1000).put("p99_ms", 1.5);
        r.row(row);
        let t = r.table();
        assert!(t.contains("clients=10"));
        assert!(t.contains("rate  p99_ms"));
        assert!(t.contains("1,000   1.500"));
    }
}
