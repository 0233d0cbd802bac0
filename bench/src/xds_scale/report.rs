//! The report: three markdown tables (changes; burst and storm; memory), each row a cell, with the
//! machine's load; and a CSV of every cell for the plot.

use std::fmt::Write as _;

use super::cell::{Cell, Change};
use crate::table::{markdown, median};

/// The `q` quantile (0 to 1) of `values`, nearest rank; 0 for none.
pub(super) fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Every client's ACK time of every change that reached them all, pooled.
fn pooled(changes: &[Change]) -> Vec<f64> {
    changes
        .iter()
        .flat_map(|c| c.per_client_ms.iter().copied())
        .collect()
}

/// The last client's ACK time of each change that reached them all.
fn last_acks(changes: &[Change]) -> Vec<f64> {
    changes
        .iter()
        .filter(|c| !c.per_client_ms.is_empty())
        .map(|c| c.per_client_ms.iter().copied().fold(0.0, f64::max))
        .collect()
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / f64::from(n) }
}

fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

fn bytes(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.1} MB", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.1} kB", value / 1e3)
    } else {
        format!("{value:.0} B")
    }
}

fn kib(value: f64) -> String {
    if value.abs() >= 1024.0 {
        format!("{:.1} MiB", value / 1024.0)
    } else {
        format!("{value:.1} KiB")
    }
}

fn head(cell: &Cell) -> Vec<String> {
    vec![
        cell.label.clone(),
        cell.kind.to_owned(),
        cell.clients.to_string(),
        cell.endpoints.to_string(),
        cell.services.to_string(),
    ]
}

/// Changes that did not reach every client, as a note.
fn missed(changes: &[Change], clients: usize) -> String {
    let missed: Vec<String> = changes
        .iter()
        .filter(|c| c.done < clients)
        .map(|c| format!("{}/{clients}", c.done))
        .collect();
    if missed.is_empty() {
        String::new()
    } else {
        format!(" (timed out: {})", missed.join(", "))
    }
}

/// The markdown of every cell.
pub(super) fn markdown_tables(cells: &[Cell]) -> String {
    let mut out = String::new();
    let load = |c: &Cell| {
        format!(
            "{:.2} ({:.2})/{:.1}",
            c.machine_cores, c.other_cores, c.load1
        )
    };
    let mut rows = vec![
        [
            "supervisor",
            "kind",
            "N",
            "M",
            "S",
            "changes",
            "ACK p50 ms",
            "ACK p99 ms",
            "last ACK median (max) ms",
            "CPU/change ms (ticks)",
            "bytes/change",
            "EDS pushes/stream",
            "client CPU/change ms",
            "cores busy (others)/load1",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for cell in cells {
        let all = pooled(&cell.changes);
        let last = last_acks(&cell.changes);
        let n = cell.changes.len().max(1) as f64;
        let mut row = head(cell);
        row.extend([
            format!(
                "{}{}",
                cell.changes.len(),
                missed(&cell.changes, cell.clients)
            ),
            ms(quantile(&all, 0.5)),
            ms(quantile(&all, 0.99)),
            if last.is_empty() {
                "-".into()
            } else {
                format!(
                    "{} ({})",
                    ms(median(last.clone())),
                    ms(last.iter().copied().fold(0.0, f64::max))
                )
            },
            format!(
                "{} ({})",
                ms(mean(cell.changes.iter().map(|c| c.cpu_ms))),
                ms(mean(cell.changes.iter().map(|c| c.cpu_ticks_ms)))
            ),
            bytes(cell.changes.iter().map(|c| c.bytes as f64).sum::<f64>() / n),
            format!(
                "{:.2}",
                mean(
                    cell.changes
                        .iter()
                        .flat_map(|c| c.pushes.iter().map(|p| *p as f64))
                )
            ),
            ms(mean(cell.changes.iter().map(|c| c.client_cpu_ms))),
            load(cell),
        ]);
        rows.push(row);
    }
    writeln!(out, "One worker change, until every client ACKed it (ACK: from the put's return to each client's ACK, every client of every change pooled; last ACK: the slowest client of each change):\n").expect("a String");
    out.push_str(&markdown(&rows, 2));
    let mut rows = vec![
        [
            "supervisor",
            "kind",
            "N",
            "M",
            "S",
            "burst: last ACK after last put ms",
            "after first put ms",
            "responses/stream median (max)",
            "states/stream median (max)",
            "burst CPU ms",
            "burst bytes",
            "initial sync s",
            "initial bytes",
            "storm s",
            "storm peak RSS / steady",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for cell in cells {
        let mut row = head(cell);
        match &cell.burst {
            Some(burst) if burst.done == cell.clients => {
                let spread = |counts: &[u64]| {
                    let counts: Vec<f64> = counts.iter().map(|p| *p as f64).collect();
                    let max = counts.iter().copied().fold(0.0, f64::max);
                    format!("{} ({max})", median(counts))
                };
                let last = burst.per_client_ms.iter().copied().fold(0.0, f64::max);
                row.extend([
                    ms(last),
                    ms(burst.from_first_ms),
                    spread(&burst.pushes),
                    spread(&burst.states),
                    ms(burst.cpu_ms),
                    bytes(burst.bytes as f64),
                ]);
            }
            Some(burst) => row.extend([
                format!("timed out ({}/{})", burst.done, cell.clients),
                "-".into(),
                "-".into(),
                "-".into(),
                ms(burst.cpu_ms),
                bytes(burst.bytes as f64),
            ]),
            None => row.extend(std::iter::repeat_n("-".to_owned(), 6)),
        }
        row.extend([
            format!("{:.2}", cell.initial_sync_s),
            bytes(cell.initial_bytes as f64),
            cell.storm_s
                .map_or_else(|| "timed out".into(), |s| format!("{s:.2}")),
            format!(
                "{} / {} ({:.2}x)",
                kib(cell.storm_peak_kib as f64),
                kib(cell.rss_streams_kib as f64),
                cell.storm_peak_kib as f64 / cell.rss_streams_kib.max(1) as f64
            ),
        ]);
        rows.push(row);
    }
    writeln!(out, "\nA burst of 100 workers changed within 1 s, the initial sync (every client connecting at once) and a reconnect storm (every client dropping its connection and connecting again at once, as a fresh Envoy):\n").expect("a String");
    out.push_str(&markdown(&rows, 2));
    let mut rows = vec![
        [
            "supervisor",
            "kind",
            "N",
            "M",
            "S",
            "RSS empty",
            "RSS with M endpoints",
            "per endpoint",
            "RSS with N clients",
            "per client",
            "per stream",
            "idle CPU ms/s",
            "errors",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for cell in cells {
        let per_endpoint = (cell.rss_loaded_kib as f64 - cell.rss_empty_kib as f64) * 1024.0
            / cell.endpoints.max(1) as f64;
        let per_client =
            (cell.rss_streams_kib as f64 - cell.rss_loaded_kib as f64) / cell.clients.max(1) as f64;
        let streams = super::client::Kind::parse(cell.kind).map_or(1, |k| k.streams());
        let mut row = head(cell);
        row.extend([
            kib(cell.rss_empty_kib as f64),
            kib(cell.rss_loaded_kib as f64),
            format!("{per_endpoint:.0} B"),
            kib(cell.rss_streams_kib as f64),
            kib(per_client),
            kib(per_client / streams as f64),
            format!("{:.1}", cell.idle_cpu_ms_per_s),
            match &cell.last_error {
                Some(error) if cell.errors > 0 => format!("{} ({error})", cell.errors),
                _ => cell.errors.to_string(),
            },
        ]);
        rows.push(row);
    }
    writeln!(out, "\nMemory (RSS of the supervisor: with no other host, with the M endpoints and no client, with the N clients synced; per client is one connection with its {{CDS, EDS}} or ADS streams):\n").expect("a String");
    out.push_str(&markdown(&rows, 2));
    out
}

/// One line per cell, for the plot.
pub(super) fn csv(cells: &[Cell]) -> String {
    let mut out = String::from(
        "supervisor,kind,clients,endpoints,services,ack_p50_ms,ack_p99_ms,cpu_ms,bytes,burst_pushes_max,rss_per_client_kib,rss_per_endpoint_b,storm_s\n",
    );
    for cell in cells {
        let all = pooled(&cell.changes);
        let n = cell.changes.len().max(1) as f64;
        writeln!(
            out,
            "{},{},{},{},{},{:.2},{:.2},{:.2},{:.0},{},{:.2},{:.0},{}",
            cell.label,
            cell.kind,
            cell.clients,
            cell.endpoints,
            cell.services,
            quantile(&all, 0.5),
            quantile(&all, 0.99),
            mean(cell.changes.iter().map(|c| c.cpu_ms)),
            cell.changes.iter().map(|c| c.bytes as f64).sum::<f64>() / n,
            cell.burst
                .as_ref()
                .map_or(0, |b| b.pushes.iter().copied().max().unwrap_or(0)),
            (cell.rss_streams_kib as f64 - cell.rss_loaded_kib as f64) / cell.clients.max(1) as f64,
            (cell.rss_loaded_kib as f64 - cell.rss_empty_kib as f64) * 1024.0
                / cell.endpoints.max(1) as f64,
            cell.storm_s.map_or(String::new(), |s| format!("{s:.3}")),
        )
        .expect("a String");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&values, 0.5), 50.0);
        assert_eq!(quantile(&values, 0.99), 99.0);
        assert_eq!(quantile(&values, 1.0), 100.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
    }
}
