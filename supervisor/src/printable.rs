//! Text from outside (a client's node id or NACK message, a certificate's subject, a worker's
//! claims, etcd's records) made safe to show on a terminal or write to the text log: one escaping
//! rule for `peregrine status` and for every log line.
//!
//! Invariant: imports nothing else of the crate; whatever `printable` returns holds no control
//! character and no bidirectional formatting character, and no text passes for one of its escapes.

use std::{borrow::Cow, fmt::Write as _};

/// `text` as a terminal may show it: every control character (a terminal escape, a newline, a
/// carriage return, C0 and C1 codes, DEL) and every bidirectional formatting character (which
/// reorders what follows it) written out as an escape, `\x1b` for ASCII ones and `\u{202e}` for the
/// others, and a backslash as `\\`, so that no text passes for an escape. Borrowed when there is
/// nothing to escape.
///
/// Log a client's text as a `%printable(..)` field or inside a message built with it: a `%` field
/// (`Display`) is written to the text log as it is.
pub fn printable(text: &str) -> Cow<'_, str> {
    let escaped = |c: char| c == '\\' || c.is_control() || is_bidi_control(c);
    if !text.chars().any(escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if escaped(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether `c` is one of Unicode's bidirectional formatting characters (marks, embeddings,
/// overrides, isolates), which reorder the text that follows them on a terminal.
pub fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_controls_bidi_and_backslashes_only() {
        assert!(matches!(printable("web-0 [::1]:80 é"), Cow::Borrowed(_)));
        assert_eq!(printable("a\x1b[2Jb"), "a\\x1b[2Jb");
        assert_eq!(
            printable("\r\n\t\x07\x7f\0"),
            "\\x0d\\x0a\\x09\\x07\\x7f\\x00"
        );
        assert_eq!(printable("\u{9b}31m\u{85}"), "\\u{9b}31m\\u{85}");
        assert_eq!(printable("\u{202e}gnp.exe"), "\\u{202e}gnp.exe");
        assert_eq!(
            printable("a\\x1b"),
            "a\\\\x1b",
            "no text passes for an escape"
        );
    }

    #[test]
    fn a_forged_log_line_stays_on_the_line_it_was_written_in() {
        let node = "envoy\n2026-12-07T00:00:00.000000Z ERROR forged\x1b[2J";
        let shown = printable(node);
        assert_eq!(shown.lines().count(), 1);
        assert_eq!(
            shown,
            "envoy\\x0a2026-12-07T00:00:00.000000Z ERROR forged\\x1b[2J"
        );
        assert!(!shown.chars().any(|c| c.is_control() || is_bidi_control(c)));
    }
}
