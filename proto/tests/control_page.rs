//! docs/control.md lists every refusal code of the registration protocol, and no other: the page a
//! client is written from and the `.proto` file its messages come from say the same.

use std::{collections::BTreeSet, path::Path};

/// The `CODE_*` words of `text`.
fn codes(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_uppercase() || c == '_'))
        .filter(|word| word.starts_with("CODE_") && word.len() > "CODE_".len())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_control_page_lists_every_refusal_code_of_the_proto_and_no_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto = std::fs::read_to_string(root.join("peregrine/worker/v1/registration.proto"))
        .expect("the .proto");
    let page = std::fs::read_to_string(root.join("../docs/control.md")).expect("docs/control.md");
    let in_proto = codes(&proto);
    assert!(in_proto.len() >= 15, "{in_proto:?}");
    assert_eq!(codes(&page), in_proto);
}
