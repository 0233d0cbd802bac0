//! `peregrine man DIR`: the manual pages. Those of the commands are clap's, from the same
//! definitions as `--help`, with the sections a manual page has and clap does not write (EXIT
//! STATUS, SIGNALS, ENVIRONMENT, FILES, SEE ALSO); peregrine.toml(5) is docs/configuration.md,
//! compiled in and turned into roff, so that the page and the reference cannot differ.

use std::path::{Path, PathBuf};

use anyhow::Context;
use roff::{Roff, bold, italic, roman};

use crate::exit::Exit;

/// The configuration reference, as the binary was built with it.
const CONFIGURATION: &str = include_str!("../../docs/configuration.md");

/// Writes every page into `dir`; returns the files written, sorted.
pub(crate) fn write_pages(command: clap::Command, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Built as clap_mangen::generate_to builds it: no `help` subcommand, and each subcommand named
    // `peregrine-NAME` so that its page is `peregrine-NAME.1`.
    let mut command = command.disable_help_subcommand(true);
    command.build();
    let mut written = Vec::new();
    write_command(command, true, dir, &mut written)
        .with_context(|| format!("cannot write the manual pages into {}", dir.display()))?;
    let path = dir.join("peregrine.toml.5");
    std::fs::write(&path, configuration_page())
        .with_context(|| format!("cannot write {}", path.display()))?;
    written.push(path);
    written.sort();
    Ok(written)
}

/// The page of `command` and of each of its visible subcommands.
fn write_command(
    command: clap::Command,
    top: bool,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> std::io::Result<()> {
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_command(sub.clone(), false, dir, written)?;
    }
    let man = clap_mangen::Man::new(command)
        .source(format!("peregrine {}", env!("CARGO_PKG_VERSION")))
        .manual("Peregrine");
    let path = dir.join(man.get_filename());
    let mut page = Vec::new();
    man.render(&mut page)?;
    page.extend_from_slice(extra_sections(top).to_roff().as_bytes());
    std::fs::write(&path, page)?;
    written.push(path);
    Ok(())
}

/// What follows clap's sections: all of them on peregrine(1), EXIT STATUS and SEE ALSO on a
/// command's own page.
fn extra_sections(top: bool) -> Roff {
    let mut roff = Roff::new();
    roff.control("SH", ["EXIT STATUS"]);
    for exit in Exit::ALL {
        let code = exit.code().to_string();
        let head = match exit.sysexits_name() {
            Some(name) => vec![bold(code), roman(format!(" ({name})"))],
            None => vec![bold(code)],
        };
        roff.control("TP", [])
            .text(head)
            .text([roman(exit.meaning())]);
    }
    if top {
        roff.control("SH", ["SIGNALS"]);
        for (signal, what) in SIGNALS {
            roff.control("TP", [])
                .text([bold(*signal)])
                .text([roman(*what)]);
        }
        roff.control("SH", ["ENVIRONMENT"]);
        for (variable, what) in ENVIRONMENT {
            roff.control("TP", [])
                .text([bold(*variable)])
                .text([roman(*what)]);
        }
        roff.control("SH", ["FILES"]);
        for (file, what) in FILES {
            roff.control("TP", [])
                .text([italic(*file)])
                .text([roman(*what)]);
        }
    }
    roff.control("SH", ["SEE ALSO"]).text([roman(if top {
        "peregrine.toml(5), peregrine-run(1), peregrine-check(1), peregrine-status(1), \
         peregrine-restart(1), peregrine-reload(1), peregrine-upgrade(1), \
         peregrine-envoy-bootstrap(1), peregrine-tls(1), systemctl(1), journalctl(1), envoy(1); \
         /usr/share/doc/peregrine/docs/ (operating.md, troubleshooting.md)"
    } else {
        "peregrine(1), peregrine.toml(5); /usr/share/doc/peregrine/docs/operating.md"
    })]);
    roff
}

/// The signals the supervisor handles, and what each does.
const SIGNALS: &[(&str, &str)] = &[
    (
        "SIGTERM, SIGINT",
        "Stop: drain and stop every worker (each after Envoy has it as draining, SIGKILL after \
         stop_timeout_ms), then exit 0.",
    ),
    (
        "SIGHUP",
        "As peregrine restart: read the config again, apply it, and replace every worker, \
         restart_batch at a time.",
    ),
    (
        "SIGUSR2",
        "As peregrine upgrade: exec the program file again, which adopts the running workers.",
    ),
    (
        "SIGKILL",
        "Ends the supervisor at once; its workers keep serving, and the next supervisor on the same \
         control socket adopts them.",
    ),
];

/// The variables the commands read.
const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "PEREGRINE_BIND, PEREGRINE_METRICS, PEREGRINE_CONTROL, PEREGRINE_ETCD",
        "Replace supervisor.bind, supervisor.metrics, supervisor.control and cluster.etcd of the \
         config (peregrine.toml(5)).",
    ),
    (
        "PEREGRINE_LOG",
        "The log filter, in tracing's EnvFilter syntax (e.g. debug, or info,peregrine_supervisor=debug); \
         RUST_LOG when unset; info by default.",
    ),
    (
        "PEREGRINE_LOG_FORMAT",
        "text (the default) or json: one JSON object per log line, for log collectors.",
    ),
    (
        "PATH",
        "Where a worker program named without a / is found when the config is checked.",
    ),
];

/// The files a packaged host has.
const FILES: &[(&str, &str)] = &[
    (
        "/etc/peregrine/peregrine.toml",
        "The configuration every command reads when given none (peregrine.toml(5)).",
    ),
    (
        "/run/peregrine/peregrine.sock",
        "The control socket of the packaged config, the supervisor's user's alone, and its lock \
         file beside it.",
    ),
    (
        "/lib/systemd/system/peregrine.service",
        "The unit: peregrine check, then peregrine run; systemctl reload runs peregrine reload.",
    ),
    (
        "/usr/share/doc/peregrine/",
        "The documentation (docs/) and the examples, an Envoy unit among them.",
    ),
];

/// peregrine.toml(5): docs/configuration.md in roff.
fn configuration_page() -> String {
    let mut roff = Roff::new();
    roff.control(
        "TH",
        [
            "peregrine.toml",
            "5",
            "",
            &format!("peregrine {}", env!("CARGO_PKG_VERSION")),
            "Peregrine",
        ],
    );
    roff.control("SH", ["NAME"]).text([roman(
        "peregrine.toml - the configuration of the Peregrine supervisor",
    )]);
    roff.control("SH", ["SYNOPSIS"])
        .text([italic("/etc/peregrine/peregrine.toml")]);
    roff.control("SH", ["DESCRIPTION"]);
    markdown_to_roff(CONFIGURATION, &mut roff);
    roff.control("SH", ["SEE ALSO"])
        .text([roman("peregrine(1), peregrine-check(1)")]);
    roff.render()
}

/// Appends the Markdown `text` (its first heading left out: the page has its own title) to
/// `roff`: `##` headings become sections, `###` subsections, paragraphs and lists text, code
/// blocks unfilled text, and each table row a tagged paragraph (its first cell the tag, the
/// others after it). Inline Markdown is reduced to its words.
fn markdown_to_roff(text: &str, roff: &mut Roff) {
    // The paragraph being gathered, and whether it is a list item.
    let mut paragraph: Vec<String> = Vec::new();
    let mut item = false;
    let mut header: Vec<String> = Vec::new();
    let mut in_code = false;
    let flush = |paragraph: &mut Vec<String>, item: bool, roff: &mut Roff| {
        if !paragraph.is_empty() {
            if item {
                roff.control("IP", ["-", "2"]);
            } else {
                roff.control("PP", []);
            }
            roff.text([roman(paragraph.join(" "))]);
            paragraph.clear();
        }
    };
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            flush(&mut paragraph, item, roff);
            if in_code {
                roff.control("fi", []);
            } else {
                roff.control("PP", []).control("nf", []);
            }
            in_code = !in_code;
            continue;
        }
        if in_code {
            roff.text([roman(line)]);
            continue;
        }
        let trimmed = line.trim();
        if let Some(title) = trimmed.strip_prefix("## ") {
            flush(&mut paragraph, item, roff);
            roff.control("SH", [inline(title).to_uppercase().as_str()]);
        } else if let Some(title) = trimmed.strip_prefix("### ") {
            flush(&mut paragraph, item, roff);
            roff.control("SS", [inline(title).as_str()]);
        } else if trimmed.starts_with("# ") {
            continue;
        } else if trimmed.starts_with('|') {
            flush(&mut paragraph, item, roff);
            let cells: Vec<String> = trimmed
                .trim_matches('|')
                .split(" | ")
                .map(|cell| inline(cell.trim()))
                .collect();
            if cells
                .iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
            {
                continue;
            }
            if header.is_empty() {
                header = cells;
                continue;
            }
            let rest: Vec<String> = cells[1..]
                .iter()
                .zip(&header[1..])
                .filter(|(cell, _)| !cell.is_empty() && cell.as_str() != "-")
                .map(|(cell, name)| {
                    if name == "Description" || name == "Notes" {
                        cell.clone()
                    } else {
                        format!("{name}: {cell}.")
                    }
                })
                .collect();
            roff.control("TP", [])
                .text([bold(cells[0].clone())])
                .text([roman(rest.join(" "))]);
        } else if trimmed.is_empty() {
            flush(&mut paragraph, item, roff);
            header.clear();
        } else if let Some(text) = trimmed.strip_prefix("- ") {
            flush(&mut paragraph, item, roff);
            item = true;
            paragraph.push(inline(text));
        } else {
            // A line that goes on an item is indented; any other ends the list.
            if item && !line.starts_with(' ') {
                flush(&mut paragraph, item, roff);
                item = false;
            }
            paragraph.push(inline(trimmed));
        }
    }
    flush(&mut paragraph, item, roff);
}

/// Markdown's inline marks taken out: code spans keep their text, links their words, emphasis its
/// letters.
fn inline(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if c == '[' {
            // [words](target) -> words
            if let Some(close) = rest.find("](")
                && let Some(end) = rest[close..].find(')')
            {
                out.push_str(&inline(&rest[1..close]));
                rest = &rest[close + end + 1..];
                continue;
            }
        }
        if c != '`' && c != '*' {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_markdown_is_reduced_to_its_words() {
        assert_eq!(
            inline("a `key` in [the docs](docs/x.md#y), **not** *this*"),
            "a key in the docs, not this"
        );
        assert_eq!(inline("[not a link"), "[not a link");
    }

    #[test]
    fn the_configuration_page_has_every_key_of_the_reference() {
        let page = configuration_page();
        assert!(page.contains(".TH peregrine.toml 5"), "{page}");
        assert!(
            page.contains(".SH \"[SUPERVISOR]: THE SUPERVISOR ITSELF\""),
            "{page}"
        );
        for key in [
            "control",
            "drain_timeout_ms",
            "stop_timeout_ms",
            "count",
            "pass_socket",
        ] {
            assert!(
                page.contains(&format!("\\fB{key}\\fR")),
                "{key} in:\n{page}"
            );
        }
        // A table row: its tag, then its other cells.
        assert!(page.contains("Default: \"peregrine.sock\"."), "{page}");
    }
}
