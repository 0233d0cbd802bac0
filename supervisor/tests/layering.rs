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

#[test]
fn only_the_binary_names_the_worker_crate() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found only {files:?}");
    let naming: Vec<_> = files
        .iter()
        .filter(|path| {
            std::fs::read_to_string(path)
                .expect("read a source file")
                .contains("peregrine_worker")
        })
        .map(|path| path.strip_prefix(&src).unwrap().display().to_string())
        .collect();
    assert_eq!(
        naming,
        ["main.rs"],
        "the library must not use the worker crate"
    );
}
