//! The supervisor library does not depend on the worker: the supervisor–worker contract lives in
//! `peregrine-contract`, and only the binary's `peregrine worker` subcommand links the worker crate.

use std::path::Path;

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether `text` names the `peregrine_worker` crate: the word itself, not a longer identifier
/// such as the metric `peregrine_worker_cpu_cores`.
fn names_the_crate(text: &str) -> bool {
    text.match_indices("peregrine_worker").any(|(at, word)| {
        let next = text[at + word.len()..].chars().next();
        !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn the_crate_is_told_from_longer_names() {
    assert!(names_the_crate("use peregrine_worker::hello;"));
    assert!(names_the_crate("peregrine_worker"));
    assert!(!names_the_crate("\"peregrine_worker_cpu_cores\""));
}

#[test]
fn only_the_binary_names_the_worker_crate() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found only {files:?}");
    let naming: Vec<_> = files
        .iter()
        .filter(|path| names_the_crate(&std::fs::read_to_string(path).expect("read a source file")))
        .map(|path| path.strip_prefix(&src).unwrap().display().to_string())
        .collect();
    assert_eq!(
        naming,
        ["main.rs"],
        "the library must not use the worker crate"
    );
}
