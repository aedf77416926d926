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

/// A small figure (a cost per unit) to three significant digits.
pub(super) fn sig(v: f64) -> String {
    if v == 0.0 || v.abs() >= 100.0 {
        return num(v);
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.decimals$}")
}

/// [`fmt_stats`] with [`sig`]'s digits.
pub(super) fn fmt_stats_sig(s: &Stats) -> String {
    if s.samples.len() == 1 {
        sig(s.median)
    } else {
        format!("{} [{}-{}]", sig(s.median), sig(s.min), sig(s.max))
    }
}

pub(super) fn fmt_stats(s: &Stats) -> String {
    if s.samples.len() == 1 {
        num(s.median)
    } else {
        format!("{} [{}-{}]", num(s.median), num(s.min), num(s.max))
    }
}

#[cfg(test)]
mod tests {
    use super::sig;

    #[test]
    fn small_figures_keep_three_significant_digits() {
        assert_eq!(sig(0.004123), "0.00412");
        assert_eq!(sig(0.17), "0.170");
        assert_eq!(sig(3.531), "3.53");
        assert_eq!(sig(42.56), "42.6");
        assert_eq!(sig(1234.0), "1234");
        assert_eq!(sig(0.0), "0.00");
    }
}
