//! What every benchmark's report is made of: markdown tables, medians and durations.

use std::{fmt::Write as _, time::Duration};

/// A markdown table with padded columns; the first row is the header (every row as wide as it), the
/// first `left` columns are left-aligned and the others right-aligned.
pub(crate) fn markdown<R: AsRef<[String]>>(rows: &[R], left: usize) -> String {
    let columns = rows.first().map_or(0, |row| row.as_ref().len());
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .map(|row| row.as_ref()[c].chars().count())
                .max()
                .unwrap_or(0)
                .max(3)
        })
        .collect();
    let mut out = String::new();
    for (r, row) in rows.iter().enumerate() {
        out.push('|');
        for (c, cell) in row.as_ref().iter().enumerate() {
            if c < left {
                write!(out, " {cell:<w$} |", w = widths[c]).expect("a String");
            } else {
                write!(out, " {cell:>w$} |", w = widths[c]).expect("a String");
            }
        }
        out.push('\n');
        if r == 0 {
            out.push('|');
            for (c, width) in widths.iter().enumerate() {
                let dashes = "-".repeat(*width);
                if c < left {
                    write!(out, " {dashes} |").expect("a String");
                } else {
                    write!(out, " {}: |", &dashes[1..]).expect("a String");
                }
            }
            out.push('\n');
        }
    }
    out
}

/// The median (the mean of the middle two for an even count).
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// `median (low-high)` of `values`, each figure written by `format`.
pub(crate) fn median_and_range(values: Vec<f64>, format: impl Fn(f64) -> String) -> String {
    let (low, high) = values
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    format!(
        "{} ({}-{})",
        format(median(values)),
        format(low),
        format(high)
    )
}

/// A duration with three significant digits in ns, µs, ms or s.
pub(crate) fn format_duration(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    let (value, unit) = if secs >= 1.0 {
        (secs, "s")
    } else if secs >= 1e-3 {
        (secs * 1e3, "ms")
    } else if secs >= 1e-6 {
        (secs * 1e6, "µs")
    } else {
        (secs * 1e9, "ns")
    };
    let decimals = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.decimals$} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_median_and_the_range() {
        let text = median_and_range(vec![3.0, 1.0, 2.0], |v| format!("{v:.1}"));
        assert_eq!(text, "2.0 (1.0-3.0)");
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![7.0]), 7.0);
    }

    #[test]
    fn formats_durations() {
        assert_eq!(format_duration(Duration::from_nanos(1500)), "1.50 µs");
        assert_eq!(format_duration(Duration::from_micros(322)), "322 µs");
        assert_eq!(
            format_duration(Duration::from_secs_f64(52.87e-3)),
            "52.9 ms"
        );
        assert_eq!(format_duration(Duration::from_nanos(850)), "850 ns");
    }
}
