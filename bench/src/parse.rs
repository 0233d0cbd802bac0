//! Parsers of the load generators' text reports (`wrk --latency`, `h2load`).
//!
//! Both tools print a human report, not a machine one; the parsers look for labelled lines anywhere in
//! the output (progress lines and blank lines are skipped), read numbers with their unit suffixes, and
//! fail naming the line they missed, so a format change shows as an error, never as a zero.

use std::time::Duration;

use anyhow::{Context, bail};

/// What one `wrk --latency` run reports.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WrkReport {
    /// Requests completed (`N requests in T`).
    pub(crate) requests: u64,
    /// The run's duration as wrk measured it.
    pub(crate) elapsed: Duration,
    /// `Requests/sec:`.
    pub(crate) requests_per_sec: f64,
    /// The 50th percentile of the latency distribution.
    pub(crate) p50: Duration,
    /// The 99th percentile of the latency distribution.
    pub(crate) p99: Duration,
    /// Socket errors (connect, read, write, timeout) plus non-2xx/3xx responses.
    pub(crate) errors: u64,
}

/// What one `h2load` run reports.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct H2loadReport {
    /// `finished in T`.
    pub(crate) elapsed: Duration,
    /// `finished in T, R req/s`.
    pub(crate) requests_per_sec: f64,
    /// Requests answered with any status (`N succeeded` counts 2xx and 3xx only).
    pub(crate) done: u64,
    /// `N succeeded`.
    pub(crate) succeeded: u64,
    /// `failed` plus `errored` plus `timeout`.
    pub(crate) failed: u64,
    /// The mean of `time for request` (h2load prints no percentiles).
    pub(crate) mean_latency: Duration,
    /// The `Application protocol:` line (`http/1.1`, `h2c`), if printed.
    pub(crate) protocol: Option<String>,
}

/// Parses the report of `wrk --latency`.
pub(crate) fn wrk(output: &str) -> anyhow::Result<WrkReport> {
    let mut requests = None;
    let mut rps = None;
    let mut p50 = None;
    let mut p99 = None;
    let mut errors = 0;
    for line in output.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        if let Some((count, rest)) = line.split_once(" requests in ") {
            // `106086 requests in 2.09s, 10.62MB read`
            let count = count.trim().parse::<u64>().context("wrk request count")?;
            let elapsed = rest.split(',').next().unwrap_or_default();
            requests = Some((count, duration(elapsed)?));
        } else if let Some(value) = line.strip_prefix("Requests/sec:") {
            rps = Some(number(value)?);
        } else if let Some(value) = line.strip_prefix("Socket errors:") {
            // `Socket errors: connect 0, read 3, write 0, timeout 0`
            for part in value.split(',') {
                let count = part.split_whitespace().nth(1).unwrap_or_default();
                errors += count
                    .parse::<u64>()
                    .with_context(|| format!("wrk socket errors {part:?}"))?;
            }
        } else if let Some(value) = line.strip_prefix("Non-2xx or 3xx responses:") {
            errors += value.trim().parse::<u64>().context("wrk non-2xx count")?;
        } else if let (Some(percent), Some(value), None) =
            (words.next(), words.next(), words.next())
        {
            match percent {
                "50%" => p50 = Some(duration(value)?),
                "99%" => p99 = Some(duration(value)?),
                _ => {}
            }
        }
    }
    let (requests, elapsed) = requests.context("no `N requests in T` line in wrk's output")?;
    Ok(WrkReport {
        requests,
        elapsed,
        requests_per_sec: rps.context("no `Requests/sec:` line in wrk's output")?,
        p50: p50.context("no `50%` line in wrk's output (was --latency given?)")?,
        p99: p99.context("no `99%` line in wrk's output (was --latency given?)")?,
        errors,
    })
}

/// Parses the report of `h2load`.
pub(crate) fn h2load(output: &str) -> anyhow::Result<H2loadReport> {
    let mut finished = None;
    let mut counts = None;
    let mut mean_latency = None;
    let mut protocol = None;
    for line in output.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("finished in ") {
            // `finished in 2.00s, 375624.00 req/s, 37.61MB/s`
            let mut parts = rest.split(',').map(str::trim);
            let elapsed = duration(parts.next().unwrap_or_default())?;
            let rps = parts
                .next()
                .and_then(|part| part.strip_suffix("req/s"))
                .with_context(|| format!("no req/s in {line:?}"))?;
            finished = Some((elapsed, number(rps)?));
        } else if let Some(rest) = line.strip_prefix("requests:") {
            // `requests: 751248 total, 751408 started, 751248 done, 751248 succeeded, 0 failed, 0 errored, 0 timeout`
            let count = |label: &str| -> anyhow::Result<u64> {
                rest.split(',')
                    .map(str::trim)
                    .find_map(|part| part.strip_suffix(label))
                    .with_context(|| format!("no `{label}` in {line:?}"))?
                    .trim()
                    .parse()
                    .with_context(|| format!("`{label}` in {line:?}"))
            };
            counts = Some((
                count("done")?,
                count("succeeded")?,
                count("failed")? + count("errored")? + count("timeout")?,
            ));
        } else if let Some(rest) = line.strip_prefix("time for request:") {
            // `time for request:  94us  58.07ms  425us  1.42ms  94.34%`: min, max, mean, sd, +/- sd.
            let mean = rest
                .split_whitespace()
                .nth(2)
                .with_context(|| format!("no mean in {line:?}"))?;
            mean_latency = Some(duration(mean)?);
        } else if let Some(rest) = line.strip_prefix("Application protocol:") {
            protocol = Some(rest.trim().to_owned());
        }
    }
    let (elapsed, requests_per_sec) =
        finished.context("no `finished in` line in h2load's output")?;
    let (done, succeeded, failed) = counts.context("no `requests:` line in h2load's output")?;
    Ok(H2loadReport {
        elapsed,
        requests_per_sec,
        done,
        succeeded,
        failed,
        mean_latency: mean_latency.context("no `time for request:` line in h2load's output")?,
        protocol,
    })
}

/// A plain number, surrounding spaces allowed.
fn number(text: &str) -> anyhow::Result<f64> {
    let text = text.trim();
    match text.parse::<f64>() {
        Ok(value) if value.is_finite() && value >= 0.0 => Ok(value),
        _ => bail!("{text:?} is not a number"),
    }
}

/// A time as both tools print it, or as Rust's `Debug` of a `Duration` does (`12.3µs`): a number
/// with `ns`, `us`, `µs`, `ms`, `s`, `m` or `h`.
pub(crate) fn duration(text: &str) -> anyhow::Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .with_context(|| format!("{text:?} has no time unit"))?;
    let (value, unit) = text.split_at(split);
    let value = number(value).with_context(|| format!("time {text:?}"))?;
    let seconds = match unit {
        "ns" => value / 1e9,
        "us" | "µs" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => bail!("{text:?} has an unknown time unit {unit:?}"),
    };
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from wrk 4.1.0 (Debian) against the hyper baseline.
    const WRK: &str = "\
Running 2s test @ http://127.0.0.1:18555/
  1 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.69ms    9.51ms  73.41ms   93.66%
    Req/Sec    51.90k    15.03k   67.28k    75.00%
  Latency Distribution
     50%  322.00us
     75%    2.67ms
     90%    7.27ms
     99%   52.87ms
  106086 requests in 2.09s, 10.62MB read
Requests/sec:  50804.38
Transfer/sec:      5.09MB
";

    // wrk with errors: its extra lines and a latency in seconds.
    const WRK_ERRORS: &str = "\
Running 5s test @ http://127.0.0.1:1/
  1 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.20s   300.00ms   2.00s    70.00%
    Req/Sec     10.00      5.00    20.00     60.00%
  Latency Distribution
     50%    1.10s
     75%    1.50s
     90%    1.90s
     99%    2.00s
  40 requests in 5.01s, 4.00KB read
  Socket errors: connect 0, read 3, write 0, timeout 7
  Non-2xx or 3xx responses: 2
Requests/sec:      7.98
Transfer/sec:     817.00B
";

    // Captured from h2load 1.52.0 (`--h1 -c10 -m16 -D 2`) against the hyper baseline.
    const H2LOAD_H1: &str = "\
starting benchmark...
spawning thread #0: 10 total client(s). Timing-based test with 0s of warm-up time and 2s of main duration for measurements.
Warm-up started for thread #0.
progress: 10% of clients started
progress: 100% of clients started
Warm-up phase is over for thread #0.
Main benchmark duration is started for thread #0.
Application protocol: http/1.1
Main benchmark duration is over for thread #0. Stopping all clients.
Stopped all clients for thread #0

finished in 2.00s, 375624.00 req/s, 37.61MB/s
requests: 751248 total, 751408 started, 751248 done, 751248 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 751248 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 75.23MB (78881040) total, 37.97MB (39819536) headers (space savings 0.00%), 17.91MB (18782800) data
                     min         max         mean         sd        +/- sd
time for request:       94us     58.07ms       425us      1.42ms    94.34%
time for connect:        5us        89us        50us        27us    60.00%
time to 1st byte:     3.39ms      3.79ms      3.50ms       122us    90.00%
req/s           :   37366.86    37670.19    37559.82       87.94    70.00%
";

    // Captured from h2load 1.52.0 (`-c10 -m10 -D 2`, h2c) against a server that speaks only HTTP/1.1.
    const H2LOAD_NO_H2: &str = "\
starting benchmark...
spawning thread #0: 10 total client(s). Timing-based test with 0s of warm-up time and 2s of main duration for measurements.
Application protocol: h2c
Main benchmark duration is over for thread #0. Stopping all clients.
Stopped all clients for thread #0

finished in 2.00s, 0.00 req/s, 600B/s
requests: 0 total, 100 started, 0 done, 0 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 0 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 1.17KB (1200) total, 0B (0) headers (space savings 0.00%), 0B (0) data
                     min         max         mean         sd        +/- sd
time for request:        0us         0us         0us         0us     0.00%
time for connect:       44us       153us       100us        36us    60.00%
time to 1st byte:        0us         0us         0us         0us     0.00%
req/s           :       0.00        0.00        0.00        0.00   100.00%
";

    #[test]
    fn parses_wrk() {
        let report = wrk(WRK).unwrap();
        assert_eq!(
            report,
            WrkReport {
                requests: 106_086,
                elapsed: Duration::from_secs_f64(2.09),
                requests_per_sec: 50804.38,
                p50: Duration::from_secs_f64(322e-6),
                p99: Duration::from_secs_f64(52.87e-3),
                errors: 0,
            }
        );
    }

    #[test]
    fn parses_wrk_errors_and_seconds() {
        let report = wrk(WRK_ERRORS).unwrap();
        assert_eq!(report.requests, 40);
        assert_eq!(report.errors, 3 + 7 + 2);
        assert_eq!(report.p50, Duration::from_secs_f64(1.1));
        assert_eq!(report.p99, Duration::from_secs(2));
    }

    #[test]
    fn wrk_without_latency_is_an_error() {
        let output = WRK.replace("     50%  322.00us\n", "");
        let error = wrk(&output).unwrap_err().to_string();
        assert!(error.contains("50%"), "{error}");
    }

    #[test]
    fn parses_h2load() {
        let report = h2load(H2LOAD_H1).unwrap();
        assert_eq!(
            report,
            H2loadReport {
                elapsed: Duration::from_secs(2),
                requests_per_sec: 375624.0,
                done: 751_248,
                succeeded: 751_248,
                failed: 0,
                mean_latency: Duration::from_micros(425),
                protocol: Some("http/1.1".into()),
            }
        );
    }

    #[test]
    fn parses_h2load_against_a_server_without_h2() {
        let report = h2load(H2LOAD_NO_H2).unwrap();
        assert_eq!(report.succeeded, 0);
        assert_eq!(report.done, 0);
        assert_eq!(report.protocol.as_deref(), Some("h2c"));
    }

    #[test]
    fn h2load_failures_are_summed() {
        let output = H2LOAD_H1.replace(
            "0 failed, 0 errored, 0 timeout",
            "4 failed, 2 errored, 1 timeout",
        );
        assert_eq!(h2load(&output).unwrap().failed, 7);
    }

    #[test]
    fn truncated_h2load_output_is_an_error() {
        let error = h2load("starting benchmark...\n").unwrap_err().to_string();
        assert!(error.contains("finished in"), "{error}");
    }

    #[test]
    fn reads_time_units() {
        assert_eq!(duration("5us").unwrap(), Duration::from_micros(5));
        assert_eq!(duration(" 2.5ms ").unwrap(), Duration::from_micros(2500));
        assert_eq!(duration("1.00m").unwrap(), Duration::from_secs(60));
        assert!(duration("12").is_err());
        assert!(duration("3parsecs").is_err());
    }
}
