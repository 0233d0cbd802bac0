//! The checks of a `[service.NAME]` table: its name, count, url, command, environment, routes and
//! restart batch; its balancing keys go on to [`balancing`](crate::config::balancing).
//!
//! Invariant: a service's workers can all bind at once: a fixed port or a shared socket path is only
//! accepted for a single worker.

use std::collections::BTreeMap;

use peregrine_contract::url::BindUrl;

use super::{Checker, NAME_RULE, valid_name};
use crate::config::{
    DEFAULT_URL, INDEX_PLACEHOLDER, Program, ServiceConfig, WorkerCommand, files::resolve_program,
    limits::MAX_WORKERS, raw::RawService,
};

impl Checker<'_> {
    pub(super) fn service(&mut self, name: String, mut raw: RawService) -> ServiceConfig {
        let key = |field: &str| format!("service.{name}.{field}");
        let balancing = raw.take_balancing();
        if !valid_name(&name) {
            let at = self.source.find(&format!("\"{name}\"")).map(|at| at..at);
            self.report(at, format!("service.{name}"), NAME_RULE);
        }
        let count = self
            .number(&key, "count", &raw.count, 1..u64::from(MAX_WORKERS) + 1)
            .map_or(1, |n| n as u32);
        let (url, url_span) = match raw.url {
            Some(url) => (url.get_ref().clone(), Some(url.span())),
            None => (DEFAULT_URL.to_string(), None),
        };
        match url.replace(INDEX_PLACEHOLDER, "0").parse::<BindUrl>() {
            Err(err) => self.report(url_span, key("url"), err.to_string()),
            Ok(BindUrl::Tcp { .. }) if url.contains(INDEX_PLACEHOLDER) => self.report(
                url_span,
                key("url"),
                format!("{INDEX_PLACEHOLDER} is only allowed in unix:// urls"),
            ),
            Ok(parsed) => {
                if let Some(port) = parsed.fixed_port().filter(|_| count > 1) {
                    self.report(
                        url_span.clone(),
                        key("url"),
                        format!(
                            "fixed port {port} cannot serve {count} workers: each worker binds its own \
                             listener (no SO_REUSEPORT); use port 0 or count = 1"
                        ),
                    );
                }
                if matches!(parsed, BindUrl::Unix { .. })
                    && count > 1
                    && !url.contains(INDEX_PLACEHOLDER)
                {
                    self.report(
                        url_span,
                        key("url"),
                        format!(
                            "one socket path cannot serve {count} workers: each worker binds its own \
                             listener; put {INDEX_PLACEHOLDER} in the path (e.g. unix:///run/app-{INDEX_PLACEHOLDER}.sock)"
                        ),
                    );
                }
            }
        }
        let env = match raw.env {
            None => BTreeMap::new(),
            Some(env) => {
                let span = env.span();
                let env = env.into_inner();
                for (variable, value) in &env {
                    if variable.is_empty() || variable.contains(['=', '\0']) {
                        self.report(
                            Some(span.clone()),
                            key("env"),
                            format!(
                                "{variable:?} is not a variable name: it must be non-empty, without \
                                 '=' or NUL"
                            ),
                        );
                    } else if value.contains('\0') {
                        self.report(
                            Some(span.clone()),
                            key(&format!("env.{variable}")),
                            "a value cannot hold a NUL byte: the environment is NUL-terminated text",
                        );
                    }
                }
                env
            }
        };
        let command = match raw.command {
            None => WorkerCommand::default(),
            Some(command) if command.get_ref().iter().any(|word| word.contains('\0')) => {
                self.report(
                    Some(command.span()),
                    key("command"),
                    "an argument cannot hold a NUL byte: arguments are NUL-terminated",
                );
                WorkerCommand::default()
            }
            Some(command) => {
                let span = command.span();
                let mut words = command.into_inner().into_iter();
                match words.next().filter(|p| !p.is_empty()) {
                    None => {
                        self.report(
                            Some(span),
                            key("command"),
                            "must name a program, e.g. [\"/usr/bin/app\", \"--flag\"]",
                        );
                        WorkerCommand::default()
                    }
                    Some(program) => {
                        let program = resolve_program(&program, self.base, self.search_path)
                            .unwrap_or_else(|why| {
                                self.report(Some(span), key("command"), why);
                                Program::Peregrine
                            });
                        WorkerCommand {
                            program,
                            args: words.collect(),
                        }
                    }
                }
            }
        };
        let prefix = self.valid(
            raw.prefix,
            key("prefix"),
            |prefix: &String| prefix.starts_with('/'),
            "must start with /",
            || "/".into(),
        );
        let domains = self.valid(
            raw.domains,
            key("domains"),
            |domains: &Vec<String>| !domains.is_empty(),
            "must name at least one domain (\"*\" for any)",
            || vec!["*".into()],
        );
        let unix = url.starts_with("unix:");
        let (balancing, weights) = self.balancing(&name, balancing, count, unix);
        let restart_batch = raw
            .restart_batch
            .and_then(|batch| {
                self.at_least(
                    &batch,
                    &key("restart_batch"),
                    1,
                    " (workers replaced at once)",
                )
            })
            .unwrap_or(1);
        ServiceConfig {
            name,
            count,
            url,
            command,
            env,
            prefix,
            domains,
            balancing,
            weights,
            restart_batch,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::Path};

    use super::*;
    use crate::config::{
        Config,
        testing::{parse, problems},
    };

    #[test]
    fn a_shared_unix_path_needs_the_index_placeholder() {
        let got = problems("[service.a]\ncount = 2\nurl = \"unix:///run/a.sock\"\n");
        assert!(got[0].contains("{index}"), "{got:?}");
        let config =
            parse("[service.a]\ncount = 2\nurl = \"unix:///run/a-{index}.sock\"\n").unwrap();
        assert_eq!(
            config.services["a"].url_for(1).to_string(),
            "unix:///run/a-1.sock"
        );
    }

    #[test]
    fn worker_programs_are_resolved_or_reported() {
        let env = HashMap::from([("PATH".to_string(), "/nonexistent:/bin:/usr/bin".to_string())]);
        let parse = |s: &str| Config::parse(s, Path::new("/etc"), &env);
        let config = parse("[service.a]\ncommand = [\"sh\", \"-c\", \"exit 1\"]\n").unwrap();
        let command = &config.services["a"].command;
        assert!(
            matches!(&command.program, Program::Path(p) if p.ends_with("sh")),
            "{command:?}"
        );
        assert_eq!(command.args, ["-c", "exit 1"]);
        let got = parse("[service.a]\ncommand = [\"no-such-program\"]\n").unwrap_err();
        assert_eq!(
            got[0].to_string(),
            "line 2: service.a.command: program \"no-such-program\" not found in PATH"
        );
        let got = parse("[service.a]\ncommand = [\"./app\"]\n").unwrap_err();
        assert!(
            got[0]
                .message
                .contains("/etc/./app is not an executable file"),
            "{got:?}"
        );
        let got = parse("[service.a]\ncommand = []\n").unwrap_err();
        assert!(got[0].message.contains("must name a program"), "{got:?}");
    }

    #[test]
    fn nul_bytes_and_bad_variable_names_are_refused_with_their_lines() {
        let got = problems(
            "[service.a]\n\nenv = { \"A\" = \"x\\u0000y\" }\n\
             [service.b]\nenv = { \"B=C\" = \"1\" }\n\
             [service.c]\ncommand = [\"peregrine\", \"wor\\u0000ker\"]\n\
             [service.d]\nenv = { \"\" = \"1\" }\n",
        );
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(
            got[0].starts_with("line 3: service.a.env.A: a value cannot hold a NUL"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("line 5: service.b.env: \"B=C\" is not a variable name"),
            "{got:?}"
        );
        assert!(
            got[2].starts_with("line 7: service.c.command: an argument cannot hold a NUL"),
            "{got:?}"
        );
        assert!(got[3].starts_with("line 9: service.d.env:"), "{got:?}");
    }
}
