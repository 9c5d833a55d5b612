//! Latency histogram: log-linear buckets over microseconds (32 sub-buckets per power of
//! two, so a percentile is off by at most ~3%), cheap to record and to merge.
//!
//! Recording happens on the socket reader tasks; they write into one of a few striped
//! histograms behind mutexes ([`Striped`]), taking a lock once per socket read (many
//! messages), not once per message.

use std::sync::Mutex;

const SUB_BITS: u32 = 5;
const SUB: usize = 1 << SUB_BITS;
/// Up to 2^40 µs (12 days): anything above is clamped into the last bucket.
const MAX_POWER: usize = 40;
const BUCKETS: usize = (MAX_POWER + 1) * SUB;

#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Self { counts: vec![0; BUCKETS], total: 0, max: 0, sum: 0 }
    }
}

fn index_of(v: u64) -> usize {
    if v < SUB as u64 {
        return v as usize;
    }
    let power = 63 - v.leading_zeros(); // ≥ SUB_BITS
    let shift = power - SUB_BITS;
    let sub = ((v >> shift) as usize) & (SUB - 1);
    let bucket = (power - SUB_BITS + 1) as usize;
    (bucket * SUB + sub).min(BUCKETS - 1)
}

/// The largest value that falls into bucket `i` (percentiles are reported as upper bounds).
fn upper_of(i: usize) -> u64 {
    if i < SUB {
        return i as u64;
    }
    let bucket = i / SUB;
    let sub = (i % SUB) as u64;
    let shift = (bucket - 1) as u32;
    ((SUB as u64 + sub + 1) << shift) - 1
}

impl Histogram {
    pub fn record(&mut self, micros: u64) {
        self.counts[index_of(micros)] += 1;
        self.total += 1;
        self.max = self.max.max(micros);
        self.sum += u128::from(micros);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
        self.sum += other.sum;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn mean(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum as f64 / self.total as f64
        }
    }

    /// The value at quantile `q` (0..=1), in µs; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper_of(i).min(self.max);
            }
        }
        self.max
    }
}

/// A few histograms behind their own locks, so that concurrent recorders rarely meet.
pub struct Striped {
    stripes: Vec<Mutex<Histogram>>,
}

impl Striped {
    pub fn new(n: usize) -> Self {
        Self { stripes: (0..n.max(1)).map(|_| Mutex::new(Histogram::default())).collect() }
    }

    /// Records a batch of values into stripe `key % n`.
    pub fn record_all(&self, key: usize, values: &[u64]) {
        if values.is_empty() {
            return;
        }
        let mut h = self.stripes[key % self.stripes.len()].lock().unwrap();
        for v in values {
            h.record(*v);
        }
    }

    pub fn merged(&self) -> Histogram {
        let mut all = Histogram::default();
        for s in &self.stripes {
            all.merge(&s.lock().unwrap());
        }
        all
    }

    pub fn reset(&self) {
        for s in &self.stripes {
            *s.lock().unwrap() = Histogram::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_the_bucket_precision() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.record(v);
        }
        for (q, want) in [(0.5, 5_000.0), (0.99, 9_900.0), (0.999, 9_990.0)] {
            let got = h.quantile(q) as f64;
            assert!((got - want).abs() / want < 0.04, "q{q}: {got} vs {want}");
        }
        assert_eq!(h.quantile(1.0), 10_000);
        assert_eq!(h.count(), 10_000);
    }

    #[test]
    fn every_value_lands_in_a_bucket_whose_bound_covers_it() {
        for v in [0u64, 1, 31, 32, 33, 63, 64, 1000, 123_456, 1 << 39, u64::MAX] {
            let i = index_of(v);
            assert!(i < BUCKETS);
            if v < (1 << 40) {
                assert!(upper_of(i) >= v, "{v} → bucket {i} up to {}", upper_of(i));
            }
        }
    }
}
