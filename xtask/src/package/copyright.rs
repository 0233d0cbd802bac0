//! The package's machine-readable copyright file (DEP-5): `packaging/debian/copyright`, with the
//! Rust crates compiled into the binary listed in its header's comment, each with the license its
//! Cargo.toml declares, as `cargo tree` finds them for the release build.

use std::collections::BTreeSet;

use anyhow::{Context, ensure};
use xtask::cargo;

/// Where the template puts the list of crates.
const CRATES: &str = "${crates}";
/// Where the template puts the years of the copyright notices.
const YEARS: &str = "${years}";

/// A crate compiled into the binary.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Crate {
    pub(super) name: String,
    pub(super) version: String,
    /// Its SPDX license expression; `unknown` when its Cargo.toml declares none.
    pub(super) license: String,
}

/// The crates from crates.io (and other registries or git) that `package` links into its binary
/// on this machine's target: normal dependencies, not build scripts' or procedural macros', which
/// run at build time only; the workspace's own crates left out.
pub(super) fn crates(package: &str) -> anyhow::Result<Vec<Crate>> {
    let mut command = cargo();
    command.args([
        "tree",
        "--package",
        package,
        "--edges",
        "normal,no-proc-macro",
        "--prefix",
        "none",
        "--format",
        "{p}\t{l}",
    ]);
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    ensure!(
        out.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    parse_tree(&String::from_utf8_lossy(&out.stdout))
}

/// The crates of `cargo tree --prefix none --format "{p}\t{l}"` output, each once, by name.
fn parse_tree(text: &str) -> anyhow::Result<Vec<Crate>> {
    let mut crates = BTreeSet::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        // A crate seen before is marked `(*)` after the format's text.
        let line = line.strip_suffix(" (*)").unwrap_or(line);
        let (package, license) = line
            .split_once('\t')
            .with_context(|| format!("not `NAME vVERSION<tab>LICENSE`: {line:?}"))?;
        // A path dependency (`name v0.1.0 (/work/main/ebpf)`) is one of the workspace's own.
        if package.contains(" (/") {
            continue;
        }
        let mut words = package.split_whitespace();
        let (Some(name), Some(version)) = (words.next(), words.next()) else {
            anyhow::bail!("not `NAME vVERSION`: {package:?}");
        };
        let license = license.trim();
        crates.insert(Crate {
            name: name.to_owned(),
            version: version.trim_start_matches('v').to_owned(),
            license: if license.is_empty() {
                "unknown".to_owned()
            } else {
                // Some crates still write `MIT/Apache-2.0`, cargo's old form of `MIT OR Apache-2.0`.
                license
                    .split('/')
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join(" OR ")
            },
        });
    }
    ensure!(!crates.is_empty(), "cargo tree listed no crate");
    Ok(crates.into_iter().collect())
}

/// The copyright file: `template` with its `${crates}` line replaced by one line per crate, and
/// each `${years}` by `years` (the years of the tree's commits, `2025-2026`).
pub(super) fn render(template: &str, years: &str, crates: &[Crate]) -> anyhow::Result<String> {
    ensure!(
        template.matches(CRATES).count() == 1 && template.lines().any(|l| l == CRATES),
        "the copyright template must have one line {CRATES}"
    );
    ensure!(
        template.contains(YEARS),
        "the copyright template names no {YEARS}"
    );
    let lines: Vec<String> = crates
        .iter()
        .map(|c| format!(" {} {}: {}", c.name, c.version, c.license))
        .collect();
    Ok(template
        .replace(CRATES, &lines.join("\n"))
        .replace(YEARS, years))
}

/// The years of the tree's first and last commits: `2026`, or `2025-2026`.
pub(super) fn years(first: &str, last: &str) -> String {
    if first == last {
        first.to_owned()
    } else {
        format!("{first}-{last}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xtask::workspace_root;

    const TREE: &str = "\
peregrine-supervisor v0.1.0 (/work/main/supervisor)\tApache-2.0
anyhow v1.0.100\tMIT OR Apache-2.0
aho-corasick v1.1.3\tUnlicense OR MIT
peregrine-ebpf v0.1.0 (/work/main/ebpf)\tApache-2.0
anyhow v1.0.100\tMIT OR Apache-2.0 (*)
ring v0.17.14\tApache-2.0 AND ISC
fnv v1.0.7\tApache-2.0 / MIT
atty v0.2.14\tMIT/Apache-2.0
nolicense v0.1.0\t
";

    #[test]
    fn the_crates_are_each_listed_once_without_the_workspaces_own() {
        let crates = parse_tree(TREE).unwrap();
        let names: Vec<String> = crates
            .iter()
            .map(|c| format!("{} {}: {}", c.name, c.version, c.license))
            .collect();
        assert_eq!(
            names,
            [
                "aho-corasick 1.1.3: Unlicense OR MIT",
                "anyhow 1.0.100: MIT OR Apache-2.0",
                "atty 0.2.14: MIT OR Apache-2.0",
                "fnv 1.0.7: Apache-2.0 OR MIT",
                "nolicense 0.1.0: unknown",
                "ring 0.17.14: Apache-2.0 AND ISC",
            ]
        );
        assert!(parse_tree("").is_err());
        assert!(parse_tree("no tab here\n").is_err());
    }

    #[test]
    fn the_copyright_file_lists_the_crates_in_its_header() {
        let template =
            std::fs::read_to_string(workspace_root().join("packaging/debian/copyright")).unwrap();
        let crates = parse_tree(TREE).unwrap();
        let text = render(&template, &years("2025", "2026"), &crates).unwrap();
        assert!(
            text.starts_with(
                "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("\n ring 0.17.14: Apache-2.0 AND ISC\n"),
            "{text}"
        );
        // DEP-5: paragraphs of fields; a field's further lines start with a space.
        for paragraph in text.split("\n\n") {
            for line in paragraph.lines() {
                assert!(
                    line.starts_with(' ') || line.split_once(": ").is_some(),
                    "not a field or its continuation: {line:?}"
                );
            }
        }
        // Every license a Files paragraph names has its own License paragraph.
        for name in ["Apache-2.0", "GPL-2"] {
            assert!(text.contains(&format!("\n\nLicense: {name}\n")), "{name}");
        }
        assert!(
            text.contains("\nCopyright: 2025-2026 The Peregrine authors\n"),
            "{text}"
        );
        assert!(!text.contains("${"), "{text}");
        assert!(render("no list\n", "2026", &crates).is_err());
        assert_eq!(years("2026", "2026"), "2026");
    }

    #[test]
    fn cargo_tree_finds_the_binarys_crates() {
        let crates = crates("peregrine").unwrap();
        let names: Vec<&str> = crates.iter().map(|c| c.name.as_str()).collect();
        // Linked in: tokio, the eBPF loader, clap. Not: a proc macro or a build script's crate.
        for linked in ["tokio", "aya", "clap", "rustls"] {
            assert!(names.contains(&linked), "{linked} missing: {names:?}");
        }
        for build_time in ["serde_derive", "prost-build", "peregrine-ebpf"] {
            assert!(
                !names.contains(&build_time),
                "{build_time} listed: {names:?}"
            );
        }
    }
}
