//! The table of `docs/kernels.md`: per Debian release, what the sampler measures on its stock
//! kernel, as the VM's check found it (its `fact:` lines). A run compares its row with the page's;
//! `--write-docs` writes it there instead. So the table is the VM's word, never a person's.

use std::collections::BTreeMap;

use super::Release;

/// The page, from the workspace's root.
pub(crate) const PAGE: &str = "docs/kernels.md";
/// The lines between which the rows stand, header included.
const BEGIN: &str = "<!-- rows written by `cargo xtask vm --write-docs`: begin -->";
const END: &str = "<!-- rows written by `cargo xtask vm --write-docs`: end -->";
/// The table's header.
const HEADER: &str = "| Debian | Kernel | BTF | Sampler | CPU time and run-queue wait | Responses of servers on passed sockets | Requests in flight | eBPF probe tests |\n|---|---|---|---|---|---|---|---|";

/// The row `facts` make for `release`.
pub(crate) fn row(release: Release, facts: &BTreeMap<String, String>) -> String {
    let fact = |key: &str| {
        facts
            .get(key)
            .filter(|value| !value.is_empty())
            .map_or("not measured", String::as_str)
    };
    let cpu = match fact("sampler") {
        "ebpf" => "eBPF: the scheduler's `tp_btf` tracepoints",
        "procfs" => "`/proc/PID/schedstat`",
        other => other,
    };
    format!(
        "{} | {} | {} | {} | {cpu} | {} | {} | {} |",
        label(release),
        fact("kernel"),
        fact("btf"),
        fact("sampler"),
        fact("sends"),
        fact("in_flight"),
        fact("probe"),
    )
}

/// The row's first cell, which names its release: `| 12 (bookworm)`.
fn label(release: Release) -> String {
    format!("| {} ({})", release.number(), release.suite())
}

/// The rows of `page`'s table, or why there is none.
fn rows(page: &str) -> Result<(usize, usize, Vec<&str>), String> {
    let begin = page
        .find(BEGIN)
        .ok_or_else(|| format!("{PAGE} has no line {BEGIN:?}"))?;
    let end = page
        .find(END)
        .filter(|&end| end > begin)
        .ok_or_else(|| format!("{PAGE} has no line {END:?} after its begin"))?;
    let inside = &page[begin + BEGIN.len()..end];
    let rows = inside
        .lines()
        .filter(|line| line.starts_with("| ") && !HEADER.contains(line.trim_end()))
        .collect();
    Ok((begin, end, rows))
}

/// Whether `page`'s row for `release` is `row`: `Ok` if so, else what differs.
pub(crate) fn compare(page: &str, release: Release, row: &str) -> Result<(), String> {
    let (_, _, rows) = rows(page)?;
    let label = label(release);
    match rows
        .iter()
        .find(|line| line.starts_with(&format!("{label} |")))
    {
        Some(line) if line.trim_end() == row => Ok(()),
        Some(line) => Err(format!(
            "{PAGE} says\n    {line}\nthis run measured\n    {row}\n(`cargo xtask vm --write-docs` writes it)"
        )),
        None => Err(format!(
            "{PAGE} has no row for Debian {}; this run measured\n    {row}\n(`cargo xtask vm --write-docs` writes it)",
            release.number()
        )),
    }
}

/// `page` with its row for `release` replaced by `row` (or added), the rows in release order.
pub(crate) fn write(page: &str, release: Release, row: &str) -> Result<String, String> {
    let (begin, end, rows) = rows(page)?;
    let label = format!("{} |", label(release));
    let mut kept: Vec<String> = rows
        .into_iter()
        .filter(|line| !line.starts_with(&label))
        .map(str::to_owned)
        .collect();
    kept.push(row.to_owned());
    kept.sort_by_key(|line| {
        line.trim_start_matches("| ")
            .split(' ')
            .next()
            .and_then(|number| number.parse::<u32>().ok())
    });
    Ok(format!(
        "{}{BEGIN}\n{HEADER}\n{}\n{}",
        &page[..begin],
        kept.join("\n"),
        &page[end..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(sends: &str) -> BTreeMap<String, String> {
        [
            ("kernel", "6.1"),
            ("btf", "yes"),
            ("sampler", "ebpf"),
            ("sends", sends),
            ("in_flight", "socket tables (sock_diag), weighed by Envoy"),
            ("probe", "13 passed, none skipped"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn a_row_is_written_checked_and_replaced_in_release_order() {
        let page = format!("# Kernels\n\ntext\n\n{BEGIN}\n{HEADER}\n{END}\n\nmore\n");
        let twelve = row(
            Release::Bookworm,
            &facts("counted at the return of tcp_sendmsg"),
        );
        assert!(twelve.starts_with("| 12 (bookworm) | 6.1 | yes | ebpf | eBPF"));
        assert!(compare(&page, Release::Bookworm, &twelve).is_err());
        let thirteen = row(Release::Trixie, &facts("at the tracepoint"));
        let page = write(&page, Release::Trixie, &thirteen).unwrap();
        let page = write(&page, Release::Bookworm, &twelve).unwrap();
        compare(&page, Release::Bookworm, &twelve).unwrap();
        compare(&page, Release::Trixie, &thirteen).unwrap();
        assert!(page.find("| 12 (").unwrap() < page.find("| 13 (").unwrap());
        assert!(page.ends_with(&format!("{END}\n\nmore\n")));
        // A changed fact is a difference, and writing replaces the row rather than adding one.
        let changed = row(Release::Bookworm, &facts("elsewhere"));
        let error = compare(&page, Release::Bookworm, &changed).unwrap_err();
        assert!(error.contains("this run measured"), "{error}");
        let page = write(&page, Release::Bookworm, &changed).unwrap();
        assert_eq!(page.matches("| 12 (bookworm)").count(), 1);
        // A missing fact says so rather than leaving a blank.
        let empty = row(Release::Trixie, &BTreeMap::new());
        assert!(empty.contains("not measured"), "{empty}");
    }
}
