//! docs/troubleshooting.md quotes what Peregrine says: each quoted message below is in the page and
//! in the source that says it, word for word, so that a reworded message cannot leave the page
//! quoting something no longer said.

use std::path::{Path, PathBuf};

/// Fragments of messages the page quotes, each as the code writes it.
const QUOTED: &[&str] = &[
    "cannot bind the gRPC (xDS) address",
    "cannot listen for Prometheus metrics on",
    "is in use by another running supervisor",
    "eBPF is not available, falling back to procfs",
    "cannot read the kernel's BTF (/sys/kernel/btf/vmlinux)",
    "cannot load the eBPF object (needs root or CAP_BPF + CAP_PERFMON)",
    "this process runs in a nested pid namespace",
    "the eBPF program was not built",
    "no Envoy connected for endpoints",
    "it sent cleartext HTTP/2 to a TLS port",
    "Envoy rejected a response (NACK)",
    "the new worker did not register within",
    "this user may not ask the supervisor on",
    "only its own user, root, may (run the command with sudo)",
    "as this user (run the command with sudo, or as a user who may read it)",
    "is not searchable by it",
    "themselves, and hold no capability to",
    "may not all start: their io_uring rings need",
    "Not every Envoy ACKed the drain in time; stopping the worker anyway",
    "Worker did not stop in time; killing it",
    "Worker stalled: Envoy sends it no new request until it moves again",
    "which this version of Peregrine cannot adopt",
    "drain them with a restart instead of upgrading in place",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

/// The text of every `.rs` file under `dir`, joined, each line's leading spaces and a line
/// continuation (`\` at a line's end, then the next line's indent) folded as Rust folds them.
fn sources(dir: &Path, into: &mut String) {
    for entry in std::fs::read_dir(dir).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, into);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("a source file");
            let mut folded = String::new();
            let mut lines = text.lines().peekable();
            while let Some(line) = lines.next() {
                if let Some(head) = line.strip_suffix('\\') {
                    folded.push_str(head);
                    if let Some(next) = lines.peek_mut() {
                        *next = next.trim_start();
                    }
                } else {
                    folded.push_str(line);
                    folded.push('\n');
                }
            }
            into.push_str(&folded);
        }
    }
}

#[test]
fn every_message_the_troubleshooting_page_quotes_is_said_by_the_code() {
    let page = std::fs::read_to_string(root().join("docs/troubleshooting.md")).expect("the page");
    // The page wraps lines: compare with its whitespace folded.
    let page = page.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut code = String::new();
    for crate_dir in ["supervisor/src", "ebpf/src", "peregrine/src"] {
        sources(&root().join(crate_dir), &mut code);
    }
    let missing: Vec<String> = QUOTED
        .iter()
        .filter_map(|quote| {
            let in_page = page.contains(quote);
            let in_code = code.contains(quote);
            (!in_page || !in_code).then(|| format!("{quote:?}: page {in_page}, code {in_code}"))
        })
        .collect();
    assert!(missing.is_empty(), "{missing:#?}");
}
