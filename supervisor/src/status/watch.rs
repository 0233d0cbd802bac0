//! `peregrine status --watch`: the status redrawn in place every interval until Ctrl-C, as top(1)
//! does, for a person at a terminal. Each frame is a header line (the interval, the socket and the
//! time) and the table, or what kept the supervisor from answering: a watch outlives a supervisor
//! restart and shows the next one when it is back. With `--json` every frame is one line of JSON
//! (the status, or `{"error": ...}`), for a script to read.
//!
//! This module makes the frames (pure); the binary times and writes them.

use std::{
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use super::StatusView;

/// Moves the cursor home and clears the screen: each frame replaces the last.
pub const CLEAR: &str = "\x1b[H\x1b[2J";
/// The shortest interval: a frame costs a control-socket round trip.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// One frame for a terminal (`clear`: it starts with [`CLEAR`]; otherwise frames are separated by
/// a blank line): the header and the table, or the error.
pub fn frame(
    clear: bool,
    interval: Duration,
    socket: &Path,
    at: SystemTime,
    status: Result<&StatusView, &str>,
) -> String {
    let mut out = String::new();
    if clear {
        out.push_str(CLEAR);
    }
    out.push_str(&format!(
        "every {:.1}s: peregrine status ({})   {}\n\n",
        interval.as_secs_f64(),
        socket.display(),
        clock(at)
    ));
    match status {
        Ok(view) => out.push_str(&view.table()),
        Err(error) => out.push_str(&format!("no answer: {error}\n(retrying)\n")),
    }
    if !clear {
        out.push('\n');
    }
    out
}

/// One JSON line: the status, or `{"error": ...}`.
pub fn json_line(status: Result<&StatusView, &str>) -> String {
    // The view's own field order, as `status --json` prints it.
    let line = match status {
        Ok(view) => serde_json::to_string(view)
            .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string()),
        Err(error) => serde_json::json!({ "error": error }).to_string(),
    };
    format!("{line}\n")
}

/// `HH:MM:SS UTC`.
fn clock(at: SystemTime) -> String {
    let secs = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_a_header_and_the_table_or_the_error() {
        let view = StatusView::default();
        let at = UNIX_EPOCH + Duration::from_secs(86_400 * 3 + 3600 * 13 + 62);
        let socket = Path::new("/run/p.sock");
        let shown = frame(true, Duration::from_millis(2000), socket, at, Ok(&view));
        assert!(shown.starts_with(CLEAR), "{shown:?}");
        assert!(
            shown.contains("every 2.0s: peregrine status (/run/p.sock)   13:01:02 UTC\n\n"),
            "{shown:?}"
        );
        assert!(shown.ends_with(&view.table()), "{shown:?}");
        let failed = frame(
            false,
            Duration::from_secs(1),
            socket,
            at,
            Err("connection refused"),
        );
        assert!(!failed.contains(CLEAR));
        assert!(
            failed.contains("no answer: connection refused\n(retrying)\n"),
            "{failed:?}"
        );
        assert_eq!(json_line(Err("gone")), "{\"error\":\"gone\"}\n");
        assert!(
            json_line(Ok(&view)).starts_with("{\"sampler\":null"),
            "{}",
            json_line(Ok(&view))
        );
    }
}
