//! What the TOML parser and serde say, in the words of the file a person wrote: TOML's type names
//! rather than Rust's (`an integer`, not `i64`), the nearest key for a misspelt one, and, for a table
//! or key given twice, which one and where it was first.

use strsim::levenshtein;

/// `message` from serde, with Rust's type names put as TOML's and the nearest key named.
pub(super) fn serde_message(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("unknown field `") {
        if let Some((unknown, expected)) = rest.split_once("`, expected one of ") {
            return unknown_key(unknown, &backquoted(expected));
        }
        if let Some((unknown, expected)) = rest.split_once("`, expected ") {
            return unknown_key(unknown, &backquoted(expected));
        }
    }
    if let Some((found, expected)) = message
        .strip_prefix("invalid type: ")
        .and_then(|rest| rest.split_once(", expected "))
    {
        return format!("expected {}, found {found}", toml_type(expected));
    }
    message.to_owned()
}

/// "unknown key `unknown`", with the nearest of `known` when one is near enough to be a misspelling,
/// and every key this table takes.
fn unknown_key(unknown: &str, known: &[&str]) -> String {
    let list = known
        .iter()
        .map(|key| format!("`{key}`"))
        .collect::<Vec<_>>()
        .join(", ");
    match nearest(unknown, known) {
        Some(near) => {
            format!("unknown key `{unknown}`: did you mean `{near}`? (this table takes {list})")
        }
        None => format!("unknown key `{unknown}` (this table takes {list})"),
    }
}

/// The key of `known` closest to `unknown`, if it is within a third of its length in edits (at
/// least 2, so `cont` finds `count`); the first of equally close ones.
fn nearest<'a>(unknown: &str, known: &[&'a str]) -> Option<&'a str> {
    let allowed = (unknown.chars().count() / 3).max(2);
    known
        .iter()
        .map(|key| (levenshtein(unknown, key), *key))
        .filter(|(distance, _)| *distance <= allowed)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, key)| key)
}

/// Every `` `name` `` in `text`.
fn backquoted(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Why `url` is not an `http://IP:PORT` address: a port out of range says so, as a range; anything
/// else shows the form with `example`.
pub(super) fn not_an_http_address(url: &str, example: &str) -> String {
    let port = url
        .strip_prefix("http://")
        .map(|rest| rest.trim_end_matches('/'))
        .and_then(|rest| rest.rsplit_once(':'))
        .and_then(|(_, port)| port.parse::<u64>().ok())
        .filter(|&port| port > u64::from(u16::MAX));
    match port {
        Some(port) => format!("the port {port} in {url:?} is out of range (0..=65535)"),
        None => format!("expected http://IP:PORT (e.g. {example}), got {url:?}"),
    }
}

/// serde's description of an expected type, as TOML names it.
fn toml_type(expected: &str) -> &str {
    match expected {
        "i8" | "i16" | "i32" | "i64" | "i128" | "u8" | "u16" | "u32" | "u64" | "u128" | "usize"
        | "isize" => "an integer",
        "f32" | "f64" => "a float",
        "bool" | "a boolean" => "a boolean (true or false)",
        "a sequence" => "an array",
        "a map" => "a table",
        other => other,
    }
}

/// For TOML's "duplicate key" at `span` of `source`: which table or key is given twice, and the line
/// it was first given on.
pub(super) fn duplicate(source: &str, span: std::ops::Range<usize>) -> String {
    let start = source[..span.start.min(source.len())]
        .rfind('\n')
        .map_or(0, |at| at + 1);
    let line = source[start..].lines().next().unwrap_or("").trim();
    // The lines before it; the one at index `i` is line `i + 1`.
    let earlier: Vec<&str> = source[..start].lines().collect();
    let (what, first) = if line.starts_with('[') {
        // A table header: the same header earlier.
        let header = header_of(line);
        let first = earlier.iter().position(|l| header_of(l.trim()) == header);
        (format!("the table `{header}`"), first)
    } else {
        // A key: the same key earlier in the same table (after the last header before it).
        let key = line.split('=').next().unwrap_or("").trim();
        let table = earlier
            .iter()
            .rposition(|l| l.trim_start().starts_with('['))
            .map_or(0, |i| i + 1);
        let first = earlier[table..]
            .iter()
            .position(|l| l.split_once('=').is_some_and(|(k, _)| k.trim() == key))
            .map(|i| table + i);
        (format!("`{key}`"), first)
    };
    match first {
        Some(i) => format!("{what} is given twice: first on line {}", i + 1),
        None => format!("{what} is given twice"),
    }
}

/// The header `[name]` (or `[[name]]`) a line opens, without a comment after it.
fn header_of(line: &str) -> &str {
    let end = line.find(']').map_or(line.len(), |at| {
        if line[at + 1..].starts_with(']') {
            at + 2
        } else {
            at + 1
        }
    });
    if line.starts_with('[') {
        &line[..end]
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_type_names_become_tomls() {
        assert_eq!(
            serde_message(r#"invalid type: string "2", expected i64"#),
            r#"expected an integer, found string "2""#
        );
        assert_eq!(
            serde_message("invalid type: integer `3`, expected a string"),
            "expected a string, found integer `3`"
        );
        assert_eq!(
            serde_message("invalid type: string \"yes\", expected a boolean"),
            "expected a boolean (true or false), found string \"yes\""
        );
        assert_eq!(serde_message("something else"), "something else");
    }

    #[test]
    fn a_port_out_of_range_is_named_as_one() {
        assert_eq!(
            not_an_http_address("http://127.0.0.1:70000", "http://[::1]:18000"),
            "the port 70000 in \"http://127.0.0.1:70000\" is out of range (0..=65535)"
        );
        assert_eq!(
            not_an_http_address("http://localhost:18000", "http://[::1]:18000"),
            "expected http://IP:PORT (e.g. http://[::1]:18000), got \"http://localhost:18000\""
        );
    }

    #[test]
    fn a_misspelt_key_names_the_nearest_and_a_stranger_only_the_list() {
        let message = "unknown field `cont`, expected one of `count`, `url`, `command`";
        assert_eq!(
            serde_message(message),
            "unknown key `cont`: did you mean `count`? (this table takes `count`, `url`, `command`)"
        );
        let message = "unknown field `readypath`, expected one of `count`, `ready_path`";
        assert!(serde_message(message).contains("did you mean `ready_path`?"));
        let message = "unknown field `zebra`, expected one of `count`, `url`";
        assert_eq!(
            serde_message(message),
            "unknown key `zebra` (this table takes `count`, `url`)"
        );
        let message = "unknown field `sampeler`, expected `sampler`";
        assert!(serde_message(message).contains("did you mean `sampler`?"));
    }

    #[test]
    fn a_table_or_key_given_twice_says_which_and_where_first() {
        let source =
            "[service.a]\ncount = 1\n\n[service.b]\ncount = 1\n\n[service.a] # again\ncount = 2\n";
        let second = source.rfind("[service.a]").unwrap();
        assert_eq!(
            duplicate(source, second..second + 11),
            "the table `[service.a]` is given twice: first on line 1"
        );
        let source = "[service.a]\ncount = 1\nurl = \"unix:///x\"\ncount = 2\n";
        let second = source.rfind("count").unwrap();
        assert_eq!(
            duplicate(source, second..second + 5),
            "`count` is given twice: first on line 2"
        );
        // The same key in another table is not the first of it.
        let source = "[service.a]\ncount = 1\n[service.b]\ncount = 1\ncount = 2\n";
        let second = source.rfind("count").unwrap();
        assert_eq!(
            duplicate(source, second..second + 5),
            "`count` is given twice: first on line 4"
        );
    }
}
