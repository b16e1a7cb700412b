//! Medians and ranges: a result is the median of its rounds with the lowest
//! and highest beside it, never the best run.

use std::fmt;

/// The median of some rounds and their range.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) low: f64,
    pub(crate) high: f64,
}

impl Spread {
    pub(crate) fn of(values: &[f64]) -> Self {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = match n {
            0 => 0.0,
            _ if n % 2 == 1 => sorted[n / 2],
            _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
        };
        Self {
            median,
            low: sorted.first().copied().unwrap_or(0.0),
            high: sorted.last().copied().unwrap_or(0.0),
        }
    }

    /// `median (low – high)` with `decimals` digits.
    pub(crate) fn show(&self, decimals: usize) -> String {
        format!(
            "{} ({} – {})",
            num(self.median, decimals),
            num(self.low, decimals),
            num(self.high, decimals)
        )
    }
}

impl fmt::Display for Spread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.show(0))
    }
}

/// Round by round, `of[i] / to[i]`.
pub(crate) fn ratios(of: &[f64], to: &[f64]) -> Vec<f64> {
    of.iter().zip(to).map(|(a, b)| a / b).collect()
}

/// The `p`-th percentile (0–100) of `values`, nearest rank.
pub(crate) fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// `value` with `decimals` digits and thousands separators on the integer part.
pub(crate) fn num(value: f64, decimals: usize) -> String {
    let text = format!("{value:.decimals$}");
    let (int, frac) = text.split_once('.').unwrap_or((&text, ""));
    let (sign, digits) = int.strip_prefix('-').map_or(("", int), |d| ("-", d));
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    if frac.is_empty() {
        format!("{sign}{grouped}")
    } else {
        format!("{sign}{grouped}.{frac}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_ranges() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.low, s.high), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]).median, 2.5);
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 50.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut v, 100.0), 100.0);
    }

    #[test]
    fn numbers_are_grouped() {
        assert_eq!(num(1_234_567.0, 0), "1,234,567");
        assert_eq!(num(999.0, 0), "999");
        assert_eq!(num(0.456, 2), "0.46");
        assert_eq!(num(-1234.5, 1), "-1,234.5");
    }
}
