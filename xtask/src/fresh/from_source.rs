//! The README's build from source, on a root of its own as fresh as the demo's: its shell block that
//! runs `cargo build --release`, as it stands (its `apt-get install` line first), then the binary's
//! `--version`, which must say the eBPF sampler is built in. A root of its own, because the demo's
//! root has, by then, whatever the xtask installed: the README's package line must be enough
//! alone.
//!
//! The block runs as root, so each `sudo ` is dropped (a minimal root has no sudo), and apt is told
//! to answer yes (`APT::Get::Assume-Yes`), as the person at the keyboard would. `PROTOC=/bin/false`
//! is set as well: the root has no protoc nor its include files, and no build script may need them.

use std::time::Duration;

use anyhow::Context;
use xtask::workspace_root;

use super::{CLONE, PACKAGES, Root};

/// The root's name (under `target/fresh/`).
pub(super) const NAME: &str = "from-source";
/// What the block must build in.
const DEADLINE: Duration = Duration::from_secs(60 * 60);
/// What the binary's `--version` says when the eBPF sampler is built in.
const WITH_EBPF: &str = "eBPF sampler built in";

/// The README's shell block that builds the release binary (the one with `cargo build --release`).
pub(crate) fn build_block(readme: &str) -> anyhow::Result<String> {
    sh_block(readme, "cargo build --release")
}

/// The first ```` ```sh ```` block of `markdown` that contains `needle`.
pub(crate) fn sh_block(markdown: &str, needle: &str) -> anyhow::Result<String> {
    markdown
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```"))
        .find(|(block, _)| block.contains(needle))
        .map(|(block, _)| block.to_owned())
        .with_context(|| format!("README.md has no ```sh block with `{needle}`"))
}

/// The block as root runs it in the root: `sudo ` dropped, stopping at the first failure.
fn as_root(block: &str) -> String {
    let lines: Vec<String> = block
        .lines()
        .map(|line| line.replace("sudo ", ""))
        .filter(|line| !line.trim().is_empty())
        .collect();
    format!("set -e\n{}\n", lines.join("\n"))
}

/// Runs the README's build block in a fresh root with the tree at HEAD cloned into it; returns the
/// binary's version line, or why the build did not pass. The output is kept in the root's log
/// folder (`from-source.log`).
pub(super) fn check() -> anyhow::Result<Result<String, String>> {
    let readme =
        std::fs::read_to_string(workspace_root().join("README.md")).context("reading README.md")?;
    let script = as_root(&build_block(&readme)?);
    let root = Root::builder(NAME)
        .packages(PACKAGES)
        .rust_toolchain()
        .prepare()?;
    root.write(
        "/etc/apt/apt.conf.d/90assume-yes",
        "APT::Get::Assume-Yes \"true\";\n",
    )?;
    let clone = root.host_path(CLONE);
    xtask::run_checked(
        std::process::Command::new("git")
            .args(["clone", "--quiet", "--no-hardlinks"])
            .arg(workspace_root())
            .arg(&clone),
    )?;
    // No protoc in the root, and any that a build script would look for fails: no part of the
    // build may need one.
    let script = format!("cd {CLONE}\nexport PROTOC=/bin/false\n{script}");
    println!(
        "\n$ (the README's build block, in the root {})\n{script}",
        root.path().display()
    );
    let transcript = root.transcript(&script, DEADLINE)?;
    let log = root.log_dir().join(format!("{NAME}.log"));
    std::fs::write(&log, &transcript.text).with_context(|| format!("writing {}", log.display()))?;
    Ok(judge(transcript.status.success(), &transcript.text)
        .map_err(|why| format!("{why} (the output: {})", log.display())))
}

/// The verdict of the build block from whether it exited 0 and its output: the version line, which
/// must say the eBPF sampler is built in.
fn judge(exited_ok: bool, output: &str) -> Result<String, String> {
    if !exited_ok {
        return Err("the README's build block failed".into());
    }
    output
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with("peregrine ") && line.contains(WITH_EBPF))
        .map(str::to_owned)
        .ok_or_else(|| format!("no `peregrine --version` line says \"{WITH_EBPF}\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readmes_build_block_runs_as_it_stands_but_for_sudo() {
        let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
        let block = build_block(&readme).unwrap();
        assert!(block.contains("apt-get install"), "{block}");
        let script = as_root(&block);
        assert!(script.starts_with("set -e\n"), "{script}");
        assert!(!script.contains("sudo "), "{script}");
        assert!(script.contains("cargo build --release"), "{script}");
        assert!(sh_block("```sh\nls\n```\n", "cargo build").is_err());
    }

    #[test]
    fn the_build_passes_only_with_the_ebpf_sampler_built_in() {
        let with = "   Finished `release` profile\npeperegrine\nperegrine 0.2.0 (abc1234, eBPF sampler built in)\n";
        assert_eq!(
            judge(true, with),
            Ok("peregrine 0.2.0 (abc1234, eBPF sampler built in)".to_owned())
        );
        let without = "peregrine 0.2.0 (abc1234, eBPF sampler not built in: procfs only)\n";
        assert!(judge(true, without).is_err());
        assert!(judge(false, with).is_err());
    }
}
