//! What the package installs, and where: [`FILES`] from the tree as they are, and what is made at
//! package time (the stripped binary, the manual pages from its own command line, the Envoy
//! bootstrap of the installed config, the copyright file and the changelogs); then `DEBIAN/` with
//! the control file, the conffiles, the maintainer scripts and the md5sums.
//!
//! Modes are set here, not taken from the checkout: folders 0755, files 0644, programs and
//! maintainer scripts 0755. dpkg-deb's `--root-owner-group` makes everything root's.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, ensure};
use xtask::run_checked;

use super::{NAME, copyright, output, read};

/// The binary's path on the host.
pub(super) const BINARY: &str = "/usr/bin/peregrine";
/// The unit's path on the host.
pub(super) const UNIT: &str = "/lib/systemd/system/peregrine.service";
/// The config's path on the host: a conffile.
pub(super) const CONFIG: &str = "/etc/peregrine/peregrine.toml";
/// The package's documentation folder.
pub(super) const DOC: &str = "/usr/share/doc/peregrine";
/// The Envoy bootstrap of the installed config, made at package time.
pub(super) const ENVOY_BOOTSTRAP: &str = "/usr/share/doc/peregrine/examples/envoy.yaml";

/// Files installed as the tree has them: (path in the workspace, path on the host).
const FILES: &[(&str, &str)] = &[
    ("packaging/systemd/peregrine.service", UNIT),
    ("packaging/peregrine.toml", CONFIG),
    ("README.md", "/usr/share/doc/peregrine/README.md"),
    ("SECURITY.md", "/usr/share/doc/peregrine/SECURITY.md"),
    // The guide's links to the code map, the figures and the worker's design hold on the host too.
    (
        "ARCHITECTURE.md",
        "/usr/share/doc/peregrine/ARCHITECTURE.md",
    ),
    ("BENCHMARKS.md", "/usr/share/doc/peregrine/BENCHMARKS.md"),
    (
        "worker/DESIGN.md",
        "/usr/share/doc/peregrine/worker/DESIGN.md",
    ),
    (
        "packaging/debian/lintian-overrides",
        "/usr/share/lintian/overrides/peregrine",
    ),
];
/// Folders whose files (subfolders and the docs' pictures included) go into the documentation
/// folder, keeping the tree's layout, so the README's links (`docs/configuration.md`) hold.
const DOC_FOLDERS: &[&str] = &["docs", "examples"];
/// The maintainer scripts, in `packaging/debian/`.
const SCRIPTS: &[&str] = &["postinst", "prerm", "postrm"];

/// What the package is made from.
#[derive(Debug)]
pub(super) struct Sources<'a> {
    /// The workspace root.
    pub(super) workspace: &'a Path,
    /// The release binary.
    pub(super) binary: &'a Path,
    /// The package's tree (made here).
    pub(super) tree: &'a Path,
    /// Where the binary's debug info is kept.
    pub(super) debug_info: &'a Path,
    /// The Debian version.
    pub(super) version: &'a str,
    /// The commit built.
    pub(super) commit: &'a str,
    /// `Name <email>`.
    pub(super) maintainer: &'a str,
    /// The commit's date as RFC 2822 (`date -R`).
    pub(super) date: &'a str,
    /// The years of the tree's commits, for the copyright notices.
    pub(super) years: &'a str,
}

/// Lays out every installed file under `tree`.
pub(super) fn lay_out(s: &Sources<'_>) -> anyhow::Result<()> {
    let at = |path: &str| s.tree.join(path.trim_start_matches('/'));

    // The binary, stripped as dh_strip strips it; its debug info kept beside the package.
    let binary = at(BINARY);
    make_parent(&binary)?;
    run_checked(
        Command::new("objcopy")
            .args(["--only-keep-debug", "--compress-debug-sections"])
            .arg(s.binary)
            .arg(s.debug_info),
    )?;
    run_checked(
        Command::new("strip")
            .args([
                "--remove-section=.comment",
                "--remove-section=.note",
                "--strip-unneeded",
                "-o",
            ])
            .arg(&binary)
            .arg(s.binary),
    )?;

    for (from, to) in FILES {
        copy(&s.workspace.join(from), &at(to))?;
    }
    let doc = at(DOC);
    for folder in DOC_FOLDERS {
        let from = s.workspace.join(folder);
        if from.is_dir() {
            copy_folder(&from, &doc.join(folder))?;
        }
    }
    // The Envoy bootstrap of the installed config, as `peregrine envoy-bootstrap` prints it. Loading
    // a config looks its services' users up, and the package's system user exists where the
    // package is installed, not on the machine that builds it: the bootstrap, which no user
    // changes, is made from a copy without those lines (the package test checks that it is what
    // the installed binary prints for the installed config).
    let config = s
        .tree
        .parent()
        .context("the tree has a parent")?
        .join("peregrine-without-users.toml");
    write(
        &config,
        &without_accounts(&read(&s.workspace.join("packaging/peregrine.toml"))?),
    )?;
    let bootstrap = output(Command::new(s.binary).arg("envoy-bootstrap").arg(&config))?;
    write(&at(ENVOY_BOOTSTRAP), &envoy_bootstrap_file(&bootstrap))?;
    let crates = copyright::crates("peregrine")?;
    write(
        &doc.join("copyright"),
        &copyright::render(
            &read(&s.workspace.join("packaging/debian/copyright"))?,
            s.years,
            &crates,
        )?,
    )?;
    gzip_text(
        &changelog_entry(s.version, s.commit, s.maintainer, s.date),
        &doc.join("changelog.Debian.gz"),
    )?;
    let upstream = s.workspace.join("CHANGELOG.md");
    if upstream.is_file() {
        gzip_text(&read(&upstream)?, &doc.join("changelog.gz"))?;
    }

    // The manual pages, written by the binary from its own command line and configuration
    // reference, compressed, each in its section's folder (`peregrine.toml.5` in man5).
    let man = at("/usr/share/man/man1");
    fs::create_dir_all(&man)?;
    let pages = s
        .tree
        .parent()
        .context("the tree has a parent")?
        .join("man1");
    run_checked(
        Command::new(s.binary)
            .arg("man")
            .arg(&pages)
            .stdout(Stdio::null()),
    )?;
    for entry in fs::read_dir(&pages)? {
        let page = entry?.path();
        let name = page.file_name().context("a page's name")?.to_string_lossy();
        let section = page
            .extension()
            .and_then(|e| e.to_str())
            .context("a page's section")?;
        let folder = at(&format!("/usr/share/man/man{section}"));
        fs::create_dir_all(&folder)?;
        gzip_text(&read(&page)?, &folder.join(format!("{name}.gz")))?;
    }
    ensure!(
        man.join(format!("{NAME}.1.gz")).is_file()
            && at(&format!("/usr/share/man/man5/{NAME}.toml.5.gz")).is_file(),
        "`peregrine man` wrote no {NAME}.1 or {NAME}.toml.5"
    );
    set_modes(s.tree)
}

/// `DEBIAN/` in `tree`: the control file, the conffiles, the maintainer scripts and the md5sums
/// of every other installed file.
pub(super) fn debian_dir(workspace: &Path, tree: &Path, control: &str) -> anyhow::Result<()> {
    let debian = tree.join("DEBIAN");
    fs::create_dir_all(&debian)?;
    write(&debian.join("control"), control)?;
    let conffiles = read(&workspace.join("packaging/debian/conffiles"))?;
    for conffile in conffiles.lines() {
        ensure!(
            tree.join(conffile.trim_start_matches('/')).is_file(),
            "the conffile {conffile} is not in the package"
        );
    }
    write(&debian.join("conffiles"), &conffiles)?;
    for script in SCRIPTS {
        let path = debian.join(script);
        copy(&workspace.join("packaging/debian").join(script), &path)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
    }
    let mut files = Vec::new();
    list_files(tree, tree, &mut files)?;
    files.retain(|f| {
        !f.starts_with("DEBIAN/")
            && !conffiles
                .lines()
                .any(|c| c.trim_start_matches('/') == f.as_str())
    });
    files.sort();
    let sums = output(Command::new("md5sum").args(&files).current_dir(tree))?;
    write(&debian.join("md5sums"), &format!("{sums}\n"))?;
    fs::set_permissions(&debian, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// A config's text without its `user` and `group` lines (each replaced by an empty line, so the
/// others keep their numbers).
fn without_accounts(config: &str) -> String {
    config
        .lines()
        .map(|line| {
            let key = line.split('=').next().unwrap_or_default().trim();
            if line.contains('=') && (key == "user" || key == "group") {
                ""
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// The shipped bootstrap: a header that says where it comes from, then the command's output.
fn envoy_bootstrap_file(bootstrap: &str) -> String {
    format!(
        "# Envoy's bootstrap for the config this package installs in {CONFIG}, as\n\
         # `peregrine envoy-bootstrap` prints it. After a change to the config, write it again:\n\
         #   peregrine envoy-bootstrap > envoy.yaml && envoy -c envoy.yaml\n\
         {bootstrap}\n"
    )
}

/// The Debian changelog's one entry.
fn changelog_entry(version: &str, commit: &str, maintainer: &str, date: &str) -> String {
    format!(
        "{NAME} ({version}) bookworm; urgency=medium\n\n  \
         * Built from commit {commit}. The changes are in\n    \
         /usr/share/doc/peregrine/changelog.gz.\n\n \
         -- {maintainer}  {date}\n"
    )
}

/// Writes `text` gzipped (`gzip -9n`: no name, no time, the same bytes for the same text).
fn gzip_text(text: &str, to: &Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    make_parent(to)?;
    let file = fs::File::create(to).with_context(|| format!("creating {}", to.display()))?;
    let mut child = Command::new("gzip")
        .args(["-9n", "-c"])
        .stdin(Stdio::piped())
        .stdout(file)
        .spawn()
        .context("running gzip")?;
    child
        .stdin
        .take()
        .context("gzip's stdin")?
        .write_all(text.as_bytes())?;
    let status = child.wait()?;
    ensure!(status.success(), "gzip failed: {status}");
    Ok(())
}

/// Copies `folder`'s files into `to`, keeping subfolders.
fn copy_folder(folder: &Path, to: &Path) -> anyhow::Result<()> {
    for entry in fs::read_dir(folder).with_context(|| format!("reading {}", folder.display()))? {
        let path = entry?.path();
        let name = path.file_name().context("a name")?;
        if path.is_dir() {
            copy_folder(&path, &to.join(name))?;
        } else {
            copy(&path, &to.join(name))?;
        }
    }
    Ok(())
}

/// Folders 0755, files 0644, programs in `usr/bin` 0755.
fn set_modes(tree: &Path) -> anyhow::Result<()> {
    fn walk(dir: &Path, programs: bool) -> anyhow::Result<()> {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                walk(&path, path.ends_with("usr/bin"))?;
            } else {
                let mode = if programs { 0o755 } else { 0o644 };
                fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
            }
        }
        Ok(())
    }
    walk(tree, false)
}

/// The files under `dir`, as paths relative to `tree`.
fn list_files(tree: &Path, dir: &Path, files: &mut Vec<String>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            list_files(tree, &path, files)?;
        } else {
            let relative = path.strip_prefix(tree)?;
            files.push(relative.to_str().context("a UTF-8 path")?.to_owned());
        }
    }
    Ok(())
}

fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    make_parent(to)?;
    fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn write(to: &Path, text: &str) -> anyhow::Result<()> {
    make_parent(to)?;
    fs::write(to, text).with_context(|| format!("writing {}", to.display()))
}

fn make_parent(path: &Path) -> anyhow::Result<PathBuf> {
    let parent = path.parent().context("a path with a folder")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    Ok(parent.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use xtask::workspace_root;

    #[test]
    fn every_installed_file_is_in_the_tree_and_the_conffile_under_etc() {
        let root = workspace_root();
        for (from, to) in FILES {
            assert!(root.join(from).is_file(), "{from} is missing");
            assert!(to.starts_with('/'), "{to}");
        }
        for script in SCRIPTS {
            let text = std::fs::read_to_string(root.join("packaging/debian").join(script)).unwrap();
            assert!(text.starts_with("#!/bin/sh\n"), "{script}");
            assert!(text.contains("\nset -e\n"), "{script}");
            assert!(text.ends_with("\nexit 0\n"), "{script}");
            assert!(text.contains("'peregrine.service'"), "{script}");
        }
        let conffiles = std::fs::read_to_string(root.join("packaging/debian/conffiles")).unwrap();
        assert_eq!(conffiles.lines().collect::<Vec<_>>(), [CONFIG]);
        assert!(FILES.iter().any(|(_, to)| *to == CONFIG));
    }

    #[test]
    fn the_unit_runs_the_installed_binary_on_the_installed_config() {
        let unit =
            std::fs::read_to_string(workspace_root().join("packaging/systemd/peregrine.service"))
                .unwrap();
        for (key, command) in [
            ("ExecStartPre", "check"),
            ("ExecStart", "run"),
            ("ExecReload", "reload"),
        ] {
            let line = format!("{key}={BINARY} {command} {CONFIG}");
            assert!(unit.lines().any(|l| l == line), "no {line:?} in the unit");
        }
        assert!(UNIT.ends_with(&format!("/{NAME}.service")));
    }

    #[test]
    fn the_changelog_entry_is_in_debians_format() {
        let entry = changelog_entry(
            "0.1.0-1",
            "33ee67c",
            "A Builder <builder@example.org>",
            "Wed, 2 Dec 2026 10:20:00 +0000",
        );
        let lines: Vec<&str> = entry.lines().collect();
        assert_eq!(lines[0], "peregrine (0.1.0-1) bookworm; urgency=medium");
        assert_eq!(lines[1], "");
        assert_eq!(
            lines[2],
            "  * Built from commit 33ee67c. The changes are in"
        );
        assert_eq!(
            lines.last().unwrap(),
            &" -- A Builder <builder@example.org>  Wed, 2 Dec 2026 10:20:00 +0000"
        );
    }

    #[test]
    fn the_bootstrap_is_made_from_the_config_without_its_users() {
        let config = "[service.hello]\n# runs as user = \"x\"\nuser = \"peregrine\"\n  group=\"adm\"\nusers = 1\ncount = 2\n";
        assert_eq!(
            without_accounts(config),
            "[service.hello]\n# runs as user = \"x\"\n\n\nusers = 1\ncount = 2\n"
        );
        let packaged =
            std::fs::read_to_string(workspace_root().join("packaging/peregrine.toml")).unwrap();
        let kept = without_accounts(&packaged);
        assert_eq!(kept.lines().count(), packaged.lines().count());
        assert!(!kept.lines().any(|l| l.starts_with("user")), "{kept}");
    }

    #[test]
    fn the_shipped_bootstrap_is_the_commands_output_under_a_comment() {
        let file = envoy_bootstrap_file("node:\n  id: \"peregrine\"");
        let body: Vec<&str> = file.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(body, ["node:", "  id: \"peregrine\""]);
        assert!(file.contains(CONFIG));
    }
}
