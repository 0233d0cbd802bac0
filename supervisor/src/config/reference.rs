//! The configuration reference, `docs/configuration.md`, held to the parser.
//!
//! - Every key the parser's serde mirror has ([`keys`]) has a row in its table's section of the page,
//!   and the page documents no key the parser does not have.
//! - A documented default is the parser's: a config that sets the key to it parses to the same
//!   [`Config`] as the same config without it.
//! - A documented range is the parser's: both ends are accepted, one step beyond either is refused
//!   with a problem that names the key.
//! - Documented values (`one of ...`) are each accepted, and they are the values the parser lists
//!   when it refuses another.
//! - A documented environment override replaces the key, over the file's value, and every
//!   `PEREGRINE_*` variable the parser's source names is documented as one.
//!
//! Each key is tried in a config where it applies ([`base`]): one service, and what the key needs
//! beside it (a fleet for `[cluster]` keys, both TLS tables for theirs, a hashing policy for the ring's
//! keys). How the page's cells are written is in [`page`].

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::{Path, PathBuf},
};

use super::{Config, Problem, raw::RawConfig};

mod keys;
mod page;

use self::{keys::MAP_ENTRY, page::Row};

/// The service of every base config: `service.NAME.count` is tried as `service.web.count`.
const SERVICE: &str = "web";

/// The page, as rows.
fn documented() -> Vec<Row> {
    let path = reference_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    page::rows(&text).unwrap_or_else(|error| panic!("{error}"))
}

fn reference_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .join("docs/configuration.md")
}

/// The key as a config writes it: `service.NAME.count` is `service.web.count`.
fn concrete(key: &str) -> String {
    key.split('.')
        .map(|part| if part == MAP_ENTRY { SERVICE } else { part })
        .collect::<Vec<_>>()
        .join(".")
}

/// A config in which `key` applies: one service, and the tables and keys that `key` needs beside it.
fn base(key: &str) -> toml::Table {
    let field = key.rsplit('.').next().unwrap_or(key);
    let mut source = String::new();
    if key.starts_with("cluster.") {
        // A fleet that speaks TLS to etcd: every [cluster] key applies, `allow_insecure` too.
        source.push_str(
            "[cluster]\netcd = [\"https://127.0.0.1:2379\"]\n\
             [cluster.tls]\nca = \"tls/etcd-ca.pem\"\n",
        );
    }
    if key.starts_with("supervisor.tls.") || key.starts_with("envoy.tls.") {
        source.push_str(
            "[supervisor.tls]\ncert = \"tls/server.pem\"\nkey = \"tls/server.key\"\n\
             [envoy.tls]\nca = \"tls/ca.pem\"\n",
        );
    }
    if key == "envoy.timeout_ms" {
        // Each try is bounded by the whole: a timeout below the per-try default needs a shorter try.
        source.push_str("[envoy]\nper_try_timeout_ms = 1\n");
    }
    source.push_str(&format!("[service.{SERVICE}]\n"));
    if key.starts_with("service.") {
        match field {
            "ready_path" | "listener" => {
                let program = std::env::current_exe().expect("the test binary's path");
                let program = toml::Value::from(program.display().to_string());
                source.push_str(&format!("pass_socket = true\ncommand = [{program}]\n"));
            }
            "choice_count" => source.push_str("lb_policy = \"least_request\"\n"),
            "ring_size_min" | "ring_size_max" | "hash_balance_factor" | "hash_on" => {
                source.push_str("lb_policy = \"ring_hash\"\nhash_on = \"source_ip\"\n");
            }
            "table_size" => source.push_str("lb_policy = \"maglev\"\nhash_on = \"source_ip\"\n"),
            _ => {}
        }
    }
    source.parse().expect("a base config is TOML")
}

/// Why a documented value cannot be written into a test config.
#[derive(Debug, thiserror::Error)]
enum Unwritable {
    #[error("{literal:?} is not a TOML value: {source}")]
    NotToml {
        literal: String,
        source: toml::de::Error,
    },
    #[error("{part} is not a table in the base config")]
    NotATable { part: String },
    #[error(transparent)]
    Serialize(#[from] toml::ser::Error),
}

/// `key`'s base config with each of `settings` (a dotted key and a TOML value) set, as TOML text.
fn with(key: &str, settings: &[(&str, &str)]) -> Result<String, Unwritable> {
    let mut config = base(key);
    for (key, literal) in settings {
        let value = format!("v = {literal}")
            .parse::<toml::Table>()
            .map_err(|source| Unwritable::NotToml {
                literal: (*literal).to_owned(),
                source,
            })?
            .remove("v")
            .expect("the one key");
        let concrete = concrete(key);
        let mut parts: Vec<&str> = concrete.split('.').collect();
        let last = parts.pop().expect("a key");
        let mut table = &mut config;
        for part in parts {
            table = table
                .entry(part)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .ok_or_else(|| Unwritable::NotATable {
                    part: part.to_owned(),
                })?;
        }
        table.insert(last.to_owned(), value);
    }
    Ok(toml::to_string(&config)?)
}

fn parse(source: &str, env: &HashMap<String, String>) -> Result<Config, Vec<Problem>> {
    Config::parse(source, Path::new("/etc/peregrine"), env)
}

fn no_env() -> HashMap<String, String> {
    HashMap::new()
}

/// The lines where two configs' `Debug` forms differ, labelled.
fn differences(left: (&str, &Config), right: (&str, &Config)) -> String {
    let (a, b) = (format!("{:#?}", left.1), format!("{:#?}", right.1));
    let width = left.0.len().max(right.0.len());
    a.lines()
        .zip(b.lines())
        .filter(|(a, b)| a != b)
        .take(8)
        .map(|(a, b)| {
            format!(
                "\n      {:width$}: {}\n      {:width$}: {}",
                left.0,
                a.trim(),
                right.0,
                b.trim()
            )
        })
        .collect()
}

fn show(problems: &[Problem]) -> String {
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    lines.join("; ")
}

/// Fails with every finding, one per line.
fn assert_none(findings: Vec<String>, what: &str) {
    assert!(
        findings.is_empty(),
        "{} ({what}):\n  {}",
        reference_path().display(),
        findings.join("\n  ")
    );
}

#[test]
fn every_key_of_the_parser_is_documented_and_no_other() {
    let parser = keys::keys::<RawConfig>().expect("the mirror can be walked");
    assert!(parser.len() > 50, "the walk found too few keys: {parser:?}");
    let rows = documented();
    let mut findings = Vec::new();
    let mut seen = BTreeMap::new();
    for row in &rows {
        if let Some(first) = seen.insert(row.dotted(), row.line) {
            findings.push(format!(
                "{}: documented twice (first on line {first})",
                row.at()
            ));
        }
        if !parser.contains(&row.dotted()) {
            findings.push(format!(
                "{}: documented, but the parser has no such key (config/raw.rs)",
                row.at()
            ));
        }
    }
    for key in parser.iter().filter(|key| !seen.contains_key(*key)) {
        let (section, _) = key.rsplit_once('.').unwrap_or(("", key));
        findings.push(format!(
            "{key}: a key of the parser (config/raw.rs) missing from the page: add a row to the \
             table under the heading `[{section}]`"
        ));
    }
    assert_none(findings, "keys");
}

#[test]
fn documented_defaults_are_the_parsers() {
    let mut findings = Vec::new();
    let mut checked = 0;
    for row in documented() {
        let Some(default) = row.default_value() else {
            continue;
        };
        let key = row.dotted();
        let without = match with(&key, &[]).map(|source| parse(&source, &no_env())) {
            Ok(Ok(config)) => config,
            Ok(Err(problems)) => {
                findings.push(format!(
                    "{}: the test's base config for the key is refused: {}",
                    row.at(),
                    show(&problems)
                ));
                continue;
            }
            Err(error) => panic!("{error}"),
        };
        let source = match with(&key, &[(&key, default)]) {
            Ok(source) => source,
            Err(error) => {
                findings.push(format!("{}: default: {error}", row.at()));
                continue;
            }
        };
        checked += 1;
        match parse(&source, &no_env()) {
            Err(problems) => findings.push(format!(
                "{}: the documented default {default} is refused: {}",
                row.at(),
                show(&problems)
            )),
            Ok(set) if set != without => findings.push(format!(
                "{}: the documented default {default} is not the parser's; the configs differ:{}",
                row.at(),
                differences(
                    (&format!("{} = {default}", concrete(&key)), &set),
                    ("left out", &without)
                )
            )),
            Ok(_) => {}
        }
    }
    assert!(checked > 40, "only {checked} defaults checked");
    assert_none(findings, "defaults");
}

#[test]
fn documented_ranges_are_the_parsers() {
    let mut findings = Vec::new();
    let mut checked = 0;
    for row in documented() {
        let (floor, ceiling) = match row.range() {
            Ok(Some(range)) => range,
            Ok(None) => continue,
            Err(error) => {
                findings.push(error);
                continue;
            }
        };
        checked += 1;
        let key = row.dotted();
        let outcome = |value: i64| {
            let source = with(&key, &[(&key, &value.to_string())]).expect("an integer");
            parse(&source, &no_env())
        };
        let mut accepted = vec![floor];
        let mut refused = vec![floor - 1];
        if let Some(ceiling) = ceiling {
            accepted.push(ceiling);
            refused.push(ceiling + 1);
        }
        for value in accepted {
            if let Err(problems) = outcome(value) {
                findings.push(format!(
                    "{}: {value} is in the documented range but refused: {}",
                    row.at(),
                    show(&problems)
                ));
            }
        }
        for value in refused {
            match outcome(value) {
                Ok(_) => findings.push(format!(
                    "{}: {value} is outside the documented range but accepted",
                    row.at()
                )),
                Err(problems) if !problems.iter().any(|p| p.key == concrete(&key)) => {
                    findings.push(format!(
                        "{}: {value} is refused, but not for this key: {}",
                        row.at(),
                        show(&problems)
                    ));
                }
                Err(_) => {}
            }
        }
    }
    assert!(checked > 20, "only {checked} ranges checked");
    assert_none(findings, "ranges");
}

/// What a documented value of `key` needs beside it: a hashing policy needs `hash_on`.
fn needs(key: &str, value: &str) -> Vec<(String, String)> {
    if key.ends_with(".lb_policy") && matches!(value, "\"ring_hash\"" | "\"maglev\"") {
        return vec![(
            format!("service.{MAP_ENTRY}.hash_on"),
            "\"source_ip\"".into(),
        )];
    }
    Vec::new()
}

/// The values a refusal lists: `expected "a", "b" or "c", got "d"`, or `...: one of A, B, C`.
fn alternatives(message: &str) -> Option<BTreeSet<String>> {
    let list = match (message.find("expected "), message.find("one of ")) {
        (Some(at), _) => {
            let rest = &message[at + "expected ".len()..];
            &rest[..rest.find(", got ").unwrap_or(rest.len())]
        }
        (None, Some(at)) => &message[at + "one of ".len()..],
        (None, None) => return None,
    };
    Some(
        list.split(", ")
            .flat_map(|part| part.split(" or "))
            .map(|value| value.trim().trim_matches('"').to_owned())
            .collect(),
    )
}

#[test]
fn documented_values_are_the_parsers() {
    let mut findings = Vec::new();
    let mut checked = 0;
    for row in documented() {
        let values = match row.choices() {
            Ok(Some(values)) => values,
            Ok(None) => continue,
            Err(error) => {
                findings.push(error);
                continue;
            }
        };
        checked += 1;
        let key = row.dotted();
        for value in &values {
            let needed = needs(&key, value);
            let mut settings: Vec<(&str, &str)> = vec![(&key, value)];
            settings.extend(needed.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let outcome = with(&key, &settings).map(|source| parse(&source, &no_env()));
            match outcome {
                Err(error) => findings.push(format!("{}: {error}", row.at())),
                Ok(Err(problems)) => findings.push(format!(
                    "{}: the documented value {value} is refused: {}",
                    row.at(),
                    show(&problems)
                )),
                Ok(Ok(_)) => {}
            }
        }
        let bogus = "\"no-such-value\"";
        let source = with(&key, &[(&key, bogus)]).expect("a text");
        let Err(problems) = parse(&source, &no_env()) else {
            findings.push(format!("{}: {bogus} is accepted", row.at()));
            continue;
        };
        let Some(listed) = problems
            .iter()
            .find(|p| p.key == concrete(&key))
            .and_then(|p| alternatives(&p.message))
        else {
            findings.push(format!(
                "{}: {bogus} is refused without a list of values: {}",
                row.at(),
                show(&problems)
            ));
            continue;
        };
        let documented: BTreeSet<String> = values
            .iter()
            .map(|v| v.trim_matches('"').to_owned())
            .collect();
        if listed != documented {
            findings.push(format!(
                "{}: the page lists {documented:?}, the parser {listed:?}",
                row.at()
            ));
        }
    }
    assert!(checked >= 5, "only {checked} lists of values checked");
    assert_none(findings, "values");
}

/// A value for `key`, which an environment variable overrides: as the variable gives it, and as the
/// file writes it.
fn env_sample(key: &str) -> Option<(&'static str, &'static str)> {
    Some(match key {
        "supervisor.bind" => ("http://127.0.0.1:1", "\"http://127.0.0.1:1\""),
        "supervisor.metrics" => ("http://127.0.0.1:2", "\"http://127.0.0.1:2\""),
        "supervisor.control" => ("/run/peregrine/other.sock", "\"/run/peregrine/other.sock\""),
        "cluster.etcd" => (
            "https://192.0.2.1:2379, https://192.0.2.2:2379",
            "[\"https://192.0.2.1:2379\", \"https://192.0.2.2:2379\"]",
        ),
        _ => return None,
    })
}

/// Every `PEREGRINE_*` name in the parser's source (`config.rs` and `config/`, this test aside).
fn variables_in_the_parser() -> BTreeSet<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![src.join("config.rs")];
    let mut dirs = vec![src.join("config")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the config sources") {
            let path = entry.expect("a directory entry").path();
            if path.file_stem().is_some_and(|stem| stem == "reference") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a source file");
        for (at, _) in text.match_indices("PEREGRINE_") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if name.len() > "PEREGRINE_".len() {
                names.insert(name);
            }
        }
    }
    names
}

#[test]
fn documented_environment_overrides_are_the_parsers() {
    let rows = documented();
    let mut findings = Vec::new();
    let documented: BTreeSet<String> = rows
        .iter()
        .filter_map(|row| row.env_var().map(str::to_owned))
        .collect();
    for name in variables_in_the_parser().difference(&documented) {
        findings.push(format!(
            "{name}: the parser reads it, the page names it for no key"
        ));
    }
    for row in rows.iter().filter(|row| row.env_var().is_some()) {
        let variable = row.env_var().expect("filtered").to_owned();
        let key = row.dotted();
        let Some((from_env, in_file)) = env_sample(&key) else {
            findings.push(format!(
                "{}: documented as overridden by {variable}, and the test has no sample value \
                 for it (reference::env_sample)",
                row.at()
            ));
            continue;
        };
        let env = HashMap::from([(variable.clone(), from_env.to_owned())]);
        let by_env = parse(&with(&key, &[]).expect("a base"), &env);
        let by_file = parse(&with(&key, &[(&key, in_file)]).expect("a value"), &no_env());
        let plain = parse(&with(&key, &[]).expect("a base"), &no_env());
        match (by_env, by_file, plain) {
            (Ok(by_env), Ok(by_file), Ok(plain)) => {
                if by_env == plain {
                    findings.push(format!(
                        "{}: {variable}={from_env:?} changes nothing",
                        row.at()
                    ));
                } else if by_env != by_file {
                    findings.push(format!(
                        "{}: {variable}={from_env:?} is not {} = {in_file}:{}",
                        row.at(),
                        concrete(&key),
                        differences(("by the environment", &by_env), ("by the file", &by_file))
                    ));
                }
                // The environment wins over the file.
                if let Some(default) = row.default_value() {
                    let source = with(&key, &[(&key, default)]).expect("a value");
                    match parse(&source, &env) {
                        Ok(both) if both == by_file => {}
                        Ok(_) => findings.push(format!(
                            "{}: with {} = {default} in the file, {variable} does not win",
                            row.at(),
                            concrete(&key)
                        )),
                        Err(problems) => findings.push(format!(
                            "{}: {variable} over the file is refused: {}",
                            row.at(),
                            show(&problems)
                        )),
                    }
                }
            }
            (by_env, by_file, _) => findings.push(format!(
                "{}: a sample is refused: by the environment {:?}, by the file {:?}",
                row.at(),
                by_env.err().map(|p| show(&p)),
                by_file.err().map(|p| show(&p))
            )),
        }
    }
    assert_none(findings, "environment overrides");
}
