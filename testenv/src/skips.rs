//! A test that cannot run here says so where a person and CI see it: straight to stderr (the test
//! runner captures only the print macros, so the line shows even when the test passes), and, when
//! `PEREGRINE_SKIPS` names a file, as a line appended there, which `cargo xtask test` lists at the
//! end of its run. A skip that nobody sees is a test that asserts nothing.

use std::{fmt::Display, io::Write as _};

/// The variable naming the file each skip is appended to.
pub const SKIPS_VAR: &str = "PEREGRINE_SKIPS";

/// Says that `test` is skipped, and why.
pub fn skip(test: &str, why: impl Display) {
    let line = format!("skipping {test}: {why}");
    let _ = writeln!(std::io::stderr(), "{line}");
    if let Some(path) = std::env::var_os(SKIPS_VAR) {
        // One write of one line, appended: tests of one binary skip from parallel threads.
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = file.write_all(format!("{}\n", line.replace('\n', " ")).as_bytes());
        }
    }
}

/// The running test's name: the test runner names each test's thread after it.
pub fn current_test() -> String {
    std::thread::current().name().unwrap_or("a test").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_running_test() {
        assert_eq!(current_test(), "skips::tests::names_the_running_test");
    }
}
