//! The Debian mirror this machine's apt uses, read from `/etc/apt/sources.list` and
//! `/etc/apt/sources.list.d/` (one-line `.list` files and deb822 `.sources` files alike), so a fresh
//! root is made from, and installs from, the same mirror as the host.

use std::{fs, path::Path};

/// Debian's own mirror, for a machine whose apt names none.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// The release the fresh roots are made of.
pub(super) const SUITE: &str = "bookworm";

/// Where the Debian archive and its security updates are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mirror {
    /// The archive (`http://deb.debian.org/debian`).
    pub(crate) archive: String,
    /// The security archive (`http://deb.debian.org/debian-security`), when apt here has one.
    pub(super) security: Option<String>,
}

/// One `deb` source: its URI and suites.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Source {
    uri: String,
    suites: Vec<String>,
}

impl Mirror {
    /// The mirror of this machine's apt sources, else Debian's own.
    pub(crate) fn of_host() -> Self {
        let mut texts = Vec::new();
        for file in ["/etc/apt/sources.list"] {
            if let Ok(text) = fs::read_to_string(file) {
                texts.push((file.to_owned(), text));
            }
        }
        if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
            let mut paths: Vec<_> = entries.flatten().map(|entry| entry.path()).collect();
            paths.sort();
            for path in paths {
                if let Ok(text) = fs::read_to_string(&path) {
                    texts.push((path.display().to_string(), text));
                }
            }
        }
        Self::from_sources(
            &texts
                .iter()
                .flat_map(|(name, text)| parse(Path::new(name), text))
                .collect::<Vec<_>>(),
        )
    }

    /// The archive: the first source of the suite [`SUITE`], else of another release without a
    /// dash (`trixie`, `stable`; not `-updates` or `-security`) from a URI ending in `/debian`;
    /// the security archive: the first source of `<suite>-security`.
    fn from_sources(sources: &[Source]) -> Self {
        let has_suite = |source: &Source, wanted: &dyn Fn(&str) -> bool| {
            source.suites.iter().any(|suite| wanted(suite))
        };
        let archive = sources
            .iter()
            .find(|source| has_suite(source, &|suite| suite == SUITE))
            .or_else(|| {
                sources.iter().find(|source| {
                    source.uri.trim_end_matches('/').ends_with("/debian")
                        && has_suite(source, &|suite| !suite.contains('-'))
                })
            })
            .map_or_else(|| DEFAULT_MIRROR.to_owned(), |source| source.uri.clone());
        let security = sources
            .iter()
            .find(|source| has_suite(source, &|suite| suite.ends_with("-security")))
            .map(|source| source.uri.clone());
        Mirror { archive, security }
    }

    /// The root's `/etc/apt/sources.list`: the release, its updates and its security updates, main
    /// only.
    pub(super) fn sources_list(&self) -> String {
        let mut list = format!(
            "deb {} {SUITE} {SUITE}-updates main\n",
            self.archive.trim_end_matches('/')
        );
        if let Some(security) = &self.security {
            list.push_str(&format!(
                "deb {} {SUITE}-security main\n",
                security.trim_end_matches('/')
            ));
        }
        list
    }
}

/// The `deb` sources of one file: deb822 when its name ends in `.sources`, else one-line.
fn parse(path: &Path, text: &str) -> Vec<Source> {
    if path.extension().is_some_and(|ext| ext == "sources") {
        parse_deb822(text)
    } else if path.extension().is_some_and(|ext| ext == "list") || path.ends_with("sources.list") {
        parse_one_line(text)
    } else {
        Vec::new()
    }
}

/// `deb [options] URI SUITE COMPONENT...` lines.
fn parse_one_line(text: &str) -> Vec<Source> {
    let mut sources = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default().trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let mut rest = rest.trim_start();
        if rest.starts_with('[') {
            let Some(end) = rest.find(']') else {
                continue;
            };
            rest = rest[end + 1..].trim_start();
        }
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            sources.push(Source {
                uri: uri.to_owned(),
                suites: vec![suite.to_owned()],
            });
        }
    }
    sources
}

/// deb822 stanzas (`Types: deb`, `URIs:`, `Suites:`), separated by blank lines.
fn parse_deb822(text: &str) -> Vec<Source> {
    let mut sources = Vec::new();
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                key.trim().eq_ignore_ascii_case(name).then(|| {
                    value
                        .split_whitespace()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
            })
        };
        let enabled = field("Enabled").is_none_or(|value| value.iter().all(|v| v != "no"));
        let is_deb = field("Types").is_some_and(|types| types.iter().any(|t| t == "deb"));
        if !(enabled && is_deb) {
            continue;
        }
        let suites = field("Suites").unwrap_or_default();
        for uri in field("URIs").unwrap_or_default() {
            sources.push(Source {
                uri,
                suites: suites.clone(),
            });
        }
    }
    sources
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's files, in both formats, with a third-party source first.
    const DEB822: &str = "\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
# http://snapshot.debian.org/archive/debian-security/20250520T000000Z
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
";
    const NODE: &str = "\
Types: deb
URIs: https://deb.nodesource.com/node_20.x
Suites: nodistro
Components: main
";
    const ONE_LINE: &str = "\
# A comment
deb-src http://ftp.de.debian.org/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://ftp.de.debian.org/debian bookworm main contrib
deb http://security.debian.org/debian-security bookworm-security main
deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main
";

    fn sources(files: &[(&str, &str)]) -> Vec<Source> {
        files
            .iter()
            .flat_map(|(name, text)| parse(Path::new(name), text))
            .collect()
    }

    #[test]
    fn reads_deb822_sources() {
        let mirror = Mirror::from_sources(&sources(&[
            ("/etc/apt/sources.list.d/a-nodesource.sources", NODE),
            ("/etc/apt/sources.list.d/debian.sources", DEB822),
        ]));
        assert_eq!(
            mirror,
            Mirror {
                archive: "http://deb.debian.org/debian".into(),
                security: Some("http://deb.debian.org/debian-security".into()),
            }
        );
        assert_eq!(
            mirror.sources_list(),
            "deb http://deb.debian.org/debian bookworm bookworm-updates main\n\
             deb http://deb.debian.org/debian-security bookworm-security main\n"
        );
    }

    #[test]
    fn reads_one_line_sources_with_options() {
        let mirror = Mirror::from_sources(&sources(&[("/etc/apt/sources.list", ONE_LINE)]));
        assert_eq!(mirror.archive, "http://ftp.de.debian.org/debian");
        assert_eq!(
            mirror.security.as_deref(),
            Some("http://security.debian.org/debian-security")
        );
    }

    #[test]
    fn another_release_gives_its_mirror_and_none_gives_debians() {
        let trixie = "deb http://mirror.example/debian/ trixie main\n";
        let mirror = Mirror::from_sources(&sources(&[("/etc/apt/sources.list", trixie)]));
        assert_eq!(mirror.archive, "http://mirror.example/debian/");
        assert_eq!(mirror.security, None);
        assert_eq!(
            mirror.sources_list(),
            "deb http://mirror.example/debian bookworm bookworm-updates main\n"
        );
        let none = Mirror::from_sources(&sources(&[(
            "/etc/apt/sources.list.d/nodesource.sources",
            NODE,
        )]));
        assert_eq!(none.archive, DEFAULT_MIRROR);
        // A disabled stanza and a file of another kind are not read.
        let disabled = DEB822.replace("Types: deb\n", "Types: deb\nEnabled: no\n");
        assert!(sources(&[("/etc/apt/sources.list.d/d.sources", &disabled)]).is_empty());
        assert!(sources(&[("/etc/apt/sources.list.d/d.save", ONE_LINE)]).is_empty());
    }
}
