//! The configuration's check, from any text: it never panics, and every problem it reports names
//! the key it is about or the line it is on (what `peregrine check` prints for an operator).
#![no_main]

use std::{collections::HashMap, path::Path};

use libfuzzer_sys::fuzz_target;
use peregrine_supervisor::config::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(problems) = Config::parse(text, Path::new("/etc/peregrine"), &HashMap::new()) {
        assert!(!problems.is_empty(), "a rejection names its problems");
        for problem in problems {
            assert!(
                problem.line.is_some() || !problem.key.is_empty(),
                "a problem with neither key nor line: {problem}"
            );
            assert!(!problem.to_string().is_empty());
        }
    }
});
