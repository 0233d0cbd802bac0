//! The package's control file: `packaging/debian/control` with its `${name}` variables filled in,
//! as dpkg-gencontrol fills a debian/control's; the `Depends:` field from dpkg-shlibdeps and what the
//! maintainer scripts run; `Installed-Size:` counted as dpkg-gencontrol counts it.

use std::{fs, os::unix::fs::MetadataExt as _, path::Path};

use anyhow::{Context, bail, ensure};

/// What the maintainer scripts run beyond the essential packages: the postinst's `adduser`.
/// (`deb-systemd-helper` and `deb-systemd-invoke` are init-system-helpers', which is essential.)
const SCRIPT_DEPENDS: &[&str] = &["adduser"];

/// `template` with each `${name}` replaced by its value in `vars`. A variable the template names
/// that `vars` lacks, a value left unused, or a field left empty is an error, and so is a value
/// that would break the file's format (a line break).
pub(super) fn render(template: &str, vars: &[(&str, &str)]) -> anyhow::Result<String> {
    let mut out = String::with_capacity(template.len());
    let mut used = vec![false; vars.len()];
    let mut rest = template;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after
            .find('}')
            .with_context(|| format!("an unclosed ${{ in the template: {:?}", &rest[at..]))?;
        let name = &after[..end];
        let Some(index) = vars.iter().position(|(key, _)| *key == name) else {
            bail!("the template names ${{{name}}}, which has no value");
        };
        let value = vars[index].1;
        ensure!(
            !value.contains('\n'),
            "${{{name}}} is more than one line: {value:?}"
        );
        used[index] = true;
        out.push_str(value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    if let Some(index) = used.iter().position(|used| !used) {
        bail!("the template does not name ${{{}}}", vars[index].0);
    }
    check_fields(&out)?;
    Ok(out)
}

/// Fails unless `control` is one paragraph of `Field: value` lines, each continued by lines that
/// start with a space, with no field empty and no field twice.
fn check_fields(control: &str) -> anyhow::Result<()> {
    let mut seen = Vec::new();
    for line in control.lines() {
        if line.starts_with(' ') {
            ensure!(!seen.is_empty(), "a continuation line before any field");
            continue;
        }
        let (field, value) = line
            .split_once(':')
            .with_context(|| format!("not a field: {line:?}"))?;
        ensure!(
            !field.is_empty() && !field.contains(char::is_whitespace),
            "not a field name: {field:?}"
        );
        ensure!(!value.trim().is_empty(), "the field {field} is empty");
        ensure!(!seen.contains(&field), "the field {field} is there twice");
        seen.push(field);
    }
    Ok(())
}

/// The value of the `shlibs:Depends=` line of dpkg-shlibdeps' output (`-O`).
pub(super) fn shlibs_depends(said: &str) -> anyhow::Result<String> {
    said.lines()
        .find_map(|line| line.strip_prefix("shlibs:Depends="))
        .map(|value| value.trim().to_owned())
        .filter(|value| !value.is_empty())
        .with_context(|| format!("dpkg-shlibdeps named no shared library: {said:?}"))
}

/// The `Depends:` field: what the maintainer scripts run, then the binary's shared libraries.
pub(super) fn depends(shlibs: &str) -> anyhow::Result<String> {
    let libraries: Vec<&str> = shlibs.split(',').map(str::trim).collect();
    ensure!(
        libraries.iter().any(|l| l.starts_with("libc6 ")),
        "no libc6 among the binary's libraries: {shlibs:?}"
    );
    let mut all: Vec<&str> = SCRIPT_DEPENDS.to_vec();
    for library in libraries {
        let name = library.split_whitespace().next().unwrap_or_default();
        if !all
            .iter()
            .any(|d| d.split_whitespace().next() == Some(name))
        {
            all.push(library);
        }
    }
    Ok(all.join(", "))
}

/// The package's installed size in KiB as dpkg-gencontrol counts it: each file's size rounded up
/// to a KiB, and one for each folder and symbolic link; `DEBIAN/` left out.
pub(super) fn installed_size(tree: &Path) -> anyhow::Result<u64> {
    fn walk(dir: &Path, top: bool, total: &mut u64) -> anyhow::Result<()> {
        for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            if top && entry.file_name() == "DEBIAN" {
                continue;
            }
            let meta = entry.path().symlink_metadata()?;
            if meta.is_dir() {
                *total += 1;
                walk(&entry.path(), false, total)?;
            } else if meta.is_symlink() {
                *total += 1;
            } else {
                *total += meta.size().div_ceil(1024);
            }
        }
        Ok(())
    }
    let mut total = 0;
    walk(tree, true, &mut total)?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xtask::workspace_root;

    /// The variables `cargo xtask package` fills in, with a build's values.
    fn vars() -> Vec<(&'static str, &'static str)> {
        vec![
            ("version", "0.1.0-1"),
            ("architecture", "amd64"),
            ("maintainer", "A Builder <builder@example.org>"),
            ("installed-size", "14021"),
            ("depends", "adduser, libc6 (>= 2.34), libgcc-s1 (>= 4.2)"),
        ]
    }

    #[test]
    fn the_control_file_has_every_field_dpkg_needs_filled_in() {
        let template =
            std::fs::read_to_string(workspace_root().join("packaging/debian/control")).unwrap();
        let control = render(&template, &vars()).unwrap();
        let field = |name: &str| {
            control
                .lines()
                .find_map(|line| line.strip_prefix(&format!("{name}: ")))
                .unwrap_or_else(|| panic!("no {name} in\n{control}"))
        };
        assert_eq!(field("Package"), "peregrine");
        assert_eq!(field("Version"), "0.1.0-1");
        assert_eq!(field("Architecture"), "amd64");
        assert_eq!(field("Maintainer"), "A Builder <builder@example.org>");
        assert_eq!(field("Installed-Size"), "14021");
        assert_eq!(
            field("Depends"),
            "adduser, libc6 (>= 2.34), libgcc-s1 (>= 4.2)"
        );
        assert_eq!(field("Section"), "net");
        assert_eq!(field("Priority"), "optional");
        // A synopsis under 80 characters, then the extended description.
        let synopsis = field("Description");
        assert!(
            synopsis.len() < 80 && !synopsis.ends_with('.'),
            "{synopsis}"
        );
        assert!(control.lines().any(|l| l == " ."), "{control}");
        assert!(
            control.ends_with('\n') && !control.contains("${"),
            "{control}"
        );
    }

    #[test]
    fn a_variable_missing_unused_or_breaking_the_format_is_an_error() {
        let template = "Package: p\nVersion: ${version}\n";
        assert_eq!(
            render(template, &[("version", "1-1")]).unwrap(),
            "Package: p\nVersion: 1-1\n"
        );
        let error = render(
            "Version: ${version}\nArchitecture: ${arch}\n",
            &[("version", "1")],
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "the template names ${arch}, which has no value"
        );
        let error = render(template, &[("version", "1"), ("arch", "amd64")]).unwrap_err();
        assert_eq!(error.to_string(), "the template does not name ${arch}");
        let error = render(template, &[("version", "1\nEvil: yes")]).unwrap_err();
        assert!(error.to_string().contains("more than one line"), "{error}");
        let error = render(template, &[("version", "")]).unwrap_err();
        assert_eq!(error.to_string(), "the field Version is empty");
        let error = render("Package: p\nPackage: q\n", &[]).unwrap_err();
        assert_eq!(error.to_string(), "the field Package is there twice");
    }

    #[test]
    fn depends_puts_the_scripts_needs_before_the_libraries() {
        let said = "shlibs:Depends=libc6 (>= 2.34), libgcc-s1 (>= 4.2)\n";
        let shlibs = shlibs_depends(said).unwrap();
        assert_eq!(
            depends(&shlibs).unwrap(),
            "adduser, libc6 (>= 2.34), libgcc-s1 (>= 4.2)"
        );
        // A library named twice stays once.
        assert_eq!(
            depends("adduser, libc6 (>= 2.36)").unwrap(),
            "adduser, libc6 (>= 2.36)"
        );
        assert!(shlibs_depends("dpkg-shlibdeps: warning: nothing\n").is_err());
        assert!(depends("libgcc-s1 (>= 4.2)").is_err(), "no libc6");
    }

    #[test]
    fn the_installed_size_counts_kib_per_file_and_one_per_folder() {
        let dir = tempfile::TempDir::new().unwrap();
        let tree = dir.path();
        std::fs::create_dir_all(tree.join("usr/bin")).unwrap();
        std::fs::create_dir_all(tree.join("DEBIAN")).unwrap();
        std::fs::write(tree.join("usr/bin/a"), vec![0u8; 1025]).unwrap();
        std::fs::write(tree.join("usr/bin/b"), b"").unwrap();
        std::fs::write(tree.join("DEBIAN/control"), vec![0u8; 4096]).unwrap();
        std::os::unix::fs::symlink("a", tree.join("usr/bin/c")).unwrap();
        // usr, usr/bin: 2; a: 2 KiB; b: 0; c: 1; DEBIAN: not counted.
        assert_eq!(installed_size(tree).unwrap(), 5);
    }
}
