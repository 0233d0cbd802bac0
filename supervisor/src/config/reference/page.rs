//! Reading `docs/configuration.md`: its tables of keys, one per section, and what each row says.
//!
//! The page's shape, which [`rows`] holds it to: a section starts at a `##` heading whose first code
//! span is the table's name in brackets (`` ## `[supervisor.tls]` ``), and the next Markdown table
//! under it lists that table's keys. The table's header names its columns (`Key`, `Type`, `Default`,
//! `Allowed`, `Environment`, `Description`, in any order). In a row:
//!
//! - `Key` is the key in a code span: `` `bind` ``.
//! - `Default` opens with a code span holding the TOML value the parser takes when the key is left
//!   out (`` `"auto"` ``, `` `200` ``); a default in words (`the machine's hostname`, `none`) opens
//!   with anything else and is not checked.
//! - `Allowed` may open with a range in a code span (`` `>= 10` ``, `` `1..=4096` ``), or with
//!   `one of` and the values in code spans (`` one of `"auto"`, `"ebpf"` or `"off"` ``); anything
//!   after them (or a cell that opens otherwise) is prose for the reader.
//! - `Environment` holds the variable that overrides the key in a code span, or `-`.

/// One documented key.
#[derive(Clone, Debug)]
pub(super) struct Row {
    /// The row's line on the page (1-based).
    pub(super) line: usize,
    /// The table, e.g. `service.NAME`.
    pub(super) section: String,
    /// The key within it, e.g. `count`.
    pub(super) key: String,
    /// The `Default` cell.
    pub(super) default: String,
    /// The `Allowed` cell.
    pub(super) allowed: String,
    /// The `Environment` cell.
    pub(super) env: String,
}

impl Row {
    /// The dotted key, e.g. `service.NAME.count`.
    pub(super) fn dotted(&self) -> String {
        format!("{}.{}", self.section, self.key)
    }

    /// Where the row is, for messages: `docs/configuration.md:42 (service.NAME.count)`.
    pub(super) fn at(&self) -> String {
        format!("docs/configuration.md:{} ({})", self.line, self.dotted())
    }

    /// The documented default as a TOML value, when the cell opens with one.
    pub(super) fn default_value(&self) -> Option<&str> {
        leading_span(&self.default)
    }

    /// The documented range: its floor and, when it has one, its ceiling (both included).
    pub(super) fn range(&self) -> Result<Option<(i64, Option<i64>)>, String> {
        let Some(span) = leading_span(&self.allowed) else {
            return Ok(None);
        };
        let number = |text: &str| {
            text.trim()
                .parse::<i64>()
                .map_err(|_| format!("{}: {span:?} is not a range (`>= N` or `N..=M`)", self.at()))
        };
        if let Some(floor) = span.strip_prefix(">=") {
            return Ok(Some((number(floor)?, None)));
        }
        if let Some((floor, ceiling)) = span.split_once("..=") {
            return Ok(Some((number(floor)?, Some(number(ceiling)?))));
        }
        if span.starts_with(|c: char| c.is_ascii_digit() || c == '-') {
            return Err(format!(
                "{}: {span:?} is not a range (`>= N` or `N..=M`)",
                self.at()
            ));
        }
        Ok(None)
    }

    /// The documented values (TOML values, quotes kept) when the cell opens with `one of`.
    pub(super) fn choices(&self) -> Result<Option<Vec<String>>, String> {
        let Some(mut rest) = self.allowed.strip_prefix("one of ") else {
            return Ok(None);
        };
        let mut values = Vec::new();
        loop {
            let Some(value) = leading_span(rest) else {
                return Err(format!(
                    "{}: `one of` must be followed by values in code spans",
                    self.at()
                ));
            };
            values.push(value.to_owned());
            rest = &rest[value.len() + 2..];
            match [", or ", ", ", " or "]
                .iter()
                .find_map(|separator| rest.strip_prefix(separator))
            {
                Some(next) if next.starts_with('`') => rest = next,
                _ => return Ok(Some(values)),
            }
        }
    }

    /// The environment variable that overrides the key, if any.
    pub(super) fn env_var(&self) -> Option<&str> {
        leading_span(&self.env)
    }
}

/// The text of the code span `cell` opens with.
fn leading_span(cell: &str) -> Option<&str> {
    let rest = cell.strip_prefix('`')?;
    rest.find('`').map(|end| &rest[..end])
}

/// The cells of a table line: `| a | b |` gives `["a", "b"]`.
fn cells(line: &str) -> Vec<&str> {
    let inner = line.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    inner.split('|').map(str::trim).collect()
}

/// The columns a table of keys must have.
const COLUMNS: [&str; 6] = [
    "Key",
    "Type",
    "Default",
    "Allowed",
    "Environment",
    "Description",
];

/// Every documented key of `page`, or what is wrong with the page's shape.
pub(super) fn rows(page: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    let mut section: Option<String> = None;
    // The column of each of `COLUMNS` in the current table, once its header was read.
    let mut columns: Option<[usize; 6]> = None;
    let mut in_code = false;
    for (index, line) in page.lines().enumerate() {
        let number = index + 1;
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        if line.starts_with('#') {
            section = line
                .find('`')
                .and_then(|at| leading_span(&line[at..]))
                .and_then(|span| span.strip_prefix('['))
                .and_then(|span| span.strip_suffix(']'))
                .map(str::to_owned);
            columns = None;
            continue;
        }
        let Some(section) = &section else {
            continue;
        };
        if !line.trim_start().starts_with('|') {
            if !line.trim().is_empty() {
                // Prose after a table ends it.
                columns = None;
            }
            continue;
        }
        let row = cells(line);
        if row
            .iter()
            .all(|cell| cell.chars().all(|c| matches!(c, '-' | ':')))
        {
            continue;
        }
        let Some(at) = columns else {
            let mut found = [0; 6];
            for (slot, name) in found.iter_mut().zip(COLUMNS) {
                *slot = row.iter().position(|cell| *cell == name).ok_or_else(|| {
                    format!(
                        "docs/configuration.md:{number}: the table of [{section}] has no column \
                         {name:?} (it needs {COLUMNS:?})"
                    )
                })?;
            }
            columns = Some(found);
            continue;
        };
        if row.len() != COLUMNS.len() {
            return Err(format!(
                "docs/configuration.md:{number}: {} cells, the table has {} (a '|' inside a cell?)",
                row.len(),
                COLUMNS.len()
            ));
        }
        let key = leading_span(row[at[0]])
            .filter(|key| key.len() + 2 == row[at[0]].len())
            .ok_or_else(|| {
                format!(
                    "docs/configuration.md:{number}: the key cell must be one code span, got {:?}",
                    row[at[0]]
                )
            })?;
        rows.push(Row {
            line: number,
            section: section.clone(),
            key: key.to_owned(),
            default: row[at[2]].to_owned(),
            allowed: row[at[3]].to_owned(),
            env: row[at[4]].to_owned(),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::rows;

    const PAGE: &str = "\
# Title

| Key | not a section |
|---|---|

## `[supervisor]`: the supervisor

```toml,fragment
| not | a row |
```

| Key | Type | Default | Allowed | Environment | Description |
|-----|------|---------|---------|-------------|-------------|
| `bind` | string | `\"http://[::1]:18000\"` | `http://IP:PORT` | `PEREGRINE_BIND` | where |
| `sampler` | string | `\"auto\"` | one of `\"auto\"`, `\"ebpf\"` or `\"off\"`: which | - | how |
| `sample_interval_ms` | integer | `200` | `>= 10` | - | how often |
| `count` | integer | none | `1..=4096`, and more | - | how many |
";

    #[test]
    fn rows_are_read_with_their_section_line_and_cells() {
        let rows = rows(PAGE).unwrap();
        let keys: Vec<String> = rows.iter().map(|r| r.dotted()).collect();
        assert_eq!(
            keys,
            [
                "supervisor.bind",
                "supervisor.sampler",
                "supervisor.sample_interval_ms",
                "supervisor.count"
            ]
        );
        assert_eq!(rows[0].line, 14);
        assert_eq!(rows[0].default_value(), Some("\"http://[::1]:18000\""));
        assert_eq!(rows[0].env_var(), Some("PEREGRINE_BIND"));
        assert_eq!(rows[0].range(), Ok(None));
        assert_eq!(
            rows[1].choices(),
            Ok(Some(vec![
                "\"auto\"".into(),
                "\"ebpf\"".into(),
                "\"off\"".into()
            ]))
        );
        assert_eq!(rows[1].env_var(), None);
        assert_eq!(rows[2].range(), Ok(Some((10, None))));
        assert_eq!(rows[3].range(), Ok(Some((1, Some(4096)))));
        assert_eq!(rows[3].default_value(), None);
    }

    #[test]
    fn a_table_without_its_columns_is_refused() {
        let page = "## `[orca]`\n\n| Key | Default |\n|---|---|\n| `a` | `1` |\n";
        let error = rows(page).unwrap_err();
        assert!(error.contains("no column \"Type\""), "{error}");
    }
}
