//! Medians, percentiles and how the bench writes numbers.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub(super) struct Stats {
    pub(super) median: f64,
    pub(super) min: f64,
    pub(super) max: f64,
    pub(super) samples: Vec<f64>,
}

pub(super) fn stats(samples: &[f64]) -> Stats {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Stats {
        median,
        min: v[0],
        max: v[n - 1],
        samples: samples.to_vec(),
    }
}

/// The nearest-rank percentile `q` (0..=1) of sorted values.
pub(super) fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A number with as many decimals as its size deserves.
pub(super) fn num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub(super) fn fmt_stats(s: &Stats) -> String {
    if s.samples.len() == 1 {
        num(s.median)
    } else {
        format!("{} [{}-{}]", num(s.median), num(s.min), num(s.max))
    }
}
