//! The walls between the workspace's crates, as ARCHITECTURE.md's code map draws them, held by the
//! manifests: one table ([`RULES`]) of which of the workspace's crates each one may depend on, which
//! crates it may never bring in (directly or through any dependency, with its own features), and for
//! the bottom crates every outside crate they may use at all. `cargo metadata` gives the edges,
//! `cargo tree -p CRATE -e normal` what one crate brings in with its own features. A `#[path]` module
//! that reaches outside its crate is an edge no manifest shows, so none may.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

/// What one crate may depend on.
struct Rule {
    /// The package.
    krate: &'static str,
    /// The workspace's crates it may depend on (normal dependencies; dev- and build-dependencies
    /// are the tests' and the build's, not the product's).
    ours: &'static [&'static str],
    /// Crates it may never bring in, however deep.
    never: &'static [&'static str],
    /// When given, the only outside crates it may depend on directly.
    only_outside: Option<&'static [&'static str]>,
}

/// The walls. A crate missing here fails the test: a new crate comes with its rule.
const RULES: &[Rule] = &[
    Rule {
        krate: "peregrine-contract",
        ours: &[],
        never: &["tokio"],
        only_outside: Some(&["rustix", "thiserror"]),
    },
    Rule {
        krate: "peregrine-testenv",
        ours: &[],
        never: &[],
        only_outside: Some(&["rustix", "thiserror"]),
    },
    Rule {
        krate: "peregrine-proto",
        ours: &[],
        never: &["tokio", "tonic"],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-ebpf-build",
        ours: &[],
        never: &[],
        only_outside: Some(&[]),
    },
    Rule {
        krate: "peregrine-ebpf",
        ours: &["peregrine-contract"],
        never: &["tokio", "tonic"],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-etcd",
        ours: &[],
        never: &[],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-worker",
        ours: &["peregrine-contract", "peregrine-proto"],
        never: &["tonic", "envoy-types", "peregrine-supervisor"],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-supervisor",
        ours: &[
            "peregrine-contract",
            "peregrine-proto",
            "peregrine-ebpf",
            "peregrine-etcd",
        ],
        never: &["peregrine-worker"],
        only_outside: None,
    },
    Rule {
        krate: "peregrine",
        ours: &[
            "peregrine-contract",
            "peregrine-proto",
            "peregrine-ebpf",
            "peregrine-supervisor",
            "peregrine-worker",
        ],
        never: &[],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-e2e",
        ours: &[
            "peregrine-contract",
            "peregrine-proto",
            "peregrine-ebpf",
            "peregrine-testenv",
        ],
        // The harness runs the `peregrine` binary: it links neither the supervisor's library nor
        // the worker (every supervisor test build would compile the worker through it).
        never: &["peregrine-supervisor", "peregrine-worker"],
        only_outside: None,
    },
    Rule {
        krate: "xtask",
        ours: &[
            "peregrine-contract",
            "peregrine-testenv",
            "peregrine-ebpf-build",
        ],
        never: &["peregrine-e2e", "tonic", "envoy-types", "aya"],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-demo",
        ours: &["peregrine-contract", "peregrine-e2e", "xtask"],
        never: &["peregrine-supervisor"],
        only_outside: None,
    },
    Rule {
        krate: "peregrine-bench",
        ours: &[
            "peregrine-contract",
            "peregrine-proto",
            "peregrine-etcd",
            "peregrine-e2e",
            "peregrine-worker",
            "xtask",
        ],
        never: &["peregrine-supervisor"],
        only_outside: None,
    },
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

fn cargo(args: &[&str]) -> String {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(args)
        .current_dir(root())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("cargo's output is UTF-8")
}

/// Each workspace package with its normal dependencies' names.
fn packages() -> Vec<(String, Vec<String>)> {
    let metadata: serde_json::Value = serde_json::from_str(&cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]))
    .expect("cargo metadata's JSON");
    metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|package| {
            let name = package["name"].as_str().expect("a name").to_owned();
            let deps = package["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|dep| dep["kind"].is_null())
                .map(|dep| dep["name"].as_str().expect("a name").to_owned())
                .collect();
            (name, deps)
        })
        .collect()
}

/// What a rule finds wrong with `krate`'s direct dependencies `deps`, `workspace` being every
/// package of the workspace.
fn direct_breaches(rule: &Rule, deps: &[String], workspace: &BTreeSet<String>) -> Vec<String> {
    let mut breaches = Vec::new();
    for dep in deps {
        if workspace.contains(dep) {
            if !rule.ours.contains(&dep.as_str()) {
                breaches.push(format!("{} depends on {dep}", rule.krate));
            }
        } else if let Some(only) = rule.only_outside
            && !only.contains(&dep.as_str())
        {
            breaches.push(format!(
                "{} depends on {dep}, outside its only ones {only:?}",
                rule.krate
            ));
        }
    }
    breaches
}

#[test]
fn every_crate_depends_only_on_what_its_rule_allows() {
    let packages = packages();
    let workspace: BTreeSet<String> = packages.iter().map(|(name, _)| name.clone()).collect();
    let mut breaches = Vec::new();
    for (name, deps) in &packages {
        match RULES.iter().find(|rule| rule.krate == name) {
            None => breaches.push(format!("{name} has no rule in xtask/tests/walls.rs")),
            Some(rule) => breaches.extend(direct_breaches(rule, deps, &workspace)),
        }
    }
    for rule in RULES {
        assert!(
            workspace.contains(rule.krate),
            "a rule for {}, which is not in the workspace",
            rule.krate
        );
    }
    assert!(breaches.is_empty(), "{breaches:#?}");
}

#[test]
fn no_crate_brings_in_what_its_rule_forbids() {
    let mut breaches = Vec::new();
    for rule in RULES.iter().filter(|rule| !rule.never.is_empty()) {
        // With the crate's own features: what building it alone compiles.
        let tree = cargo(&[
            "tree",
            "--offline",
            "-p",
            rule.krate,
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ]);
        let brought: BTreeSet<&str> = tree
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .collect();
        for forbidden in rule.never {
            if brought.contains(forbidden) {
                breaches.push(format!("{} brings in {forbidden}", rule.krate));
            }
        }
    }
    assert!(breaches.is_empty(), "{breaches:#?}");
}

#[test]
fn a_new_edge_is_a_breach() {
    // The check itself, on an edge the table forbids: the worker on the supervisor.
    let workspace: BTreeSet<String> = RULES.iter().map(|r| r.krate.to_owned()).collect();
    let worker = RULES
        .iter()
        .find(|r| r.krate == "peregrine-worker")
        .unwrap();
    let deps = vec![
        "peregrine-contract".to_owned(),
        "peregrine-supervisor".to_owned(),
    ];
    assert_eq!(
        direct_breaches(worker, &deps, &workspace),
        ["peregrine-worker depends on peregrine-supervisor"]
    );
    let contract = RULES
        .iter()
        .find(|r| r.krate == "peregrine-contract")
        .unwrap();
    assert_eq!(
        direct_breaches(contract, &["libc".to_owned()], &workspace),
        ["peregrine-contract depends on libc, outside its only ones [\"rustix\", \"thiserror\"]"]
    );
}

/// The `.rs` files under `dir`, but not under `target` or a hidden folder.
fn sources(dir: &Path, into: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a folder").flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                sources(&path, into);
            }
        } else if name.ends_with(".rs") {
            into.push(path);
        }
    }
}

#[test]
fn no_path_module_reaches_outside_its_crate() {
    let mut files = Vec::new();
    sources(&root(), &mut files);
    let mut reaching = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a source file");
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.starts_with("#[path") && line.contains("..") {
                reaching.push(format!("{}:{}: {line}", file.display(), index + 1));
            }
        }
    }
    assert!(reaching.is_empty(), "{reaching:#?}");
}
