//! The checks of a `[service.NAME]` table: its name, count, url, command, environment, routes,
//! restart batch and account (`user`, `group`); its balancing keys go on to
//! [`balancing`](super::balancing).
//!
//! Invariant: a service's workers can all bind at once: a fixed port or a shared socket path is only
//! accepted for a single worker.

use std::{collections::BTreeMap, ops::Range, path::Path};

type Span = Range<usize>;

use peregrine_contract::url::BindUrl;
use toml::Spanned;

use super::{Checker, NAME_RULE, balancing::OrcaReach, valid_name};
use crate::config::{
    ADDRESS_PLACEHOLDER, DEFAULT_PASSED_URL, DEFAULT_READY_PATH, DEFAULT_URL, FD_PLACEHOLDER,
    INDEX_PLACEHOLDER, PORT_PLACEHOLDER, Program, ServiceConfig, StopSignal, WorkerCommand,
    account::{self, Account, AccountKey, worker_socket},
    concurrency::{
        self, CONCURRENCY_KEY, Concurrency, ConcurrencySource, ListenerMode, MAX_CONCURRENCY,
    },
    files::resolve_program,
    limits::{MAX_SOCKET_PATH, MAX_WORKERS},
    raw::{AccountId, RawConcurrency, RawConfig, RawService, key_part},
};

/// Where the file writes a service's name, and the keys that checks across services name.
#[derive(Clone, Debug, Default)]
pub(super) struct ServiceSpans {
    /// The name in `[service.NAME]`.
    pub(super) name: Option<Span>,
    /// `count`.
    pub(super) count: Option<Span>,
    /// `prefix`.
    pub(super) prefix: Option<Span>,
    /// `domains`.
    pub(super) domains: Option<Span>,
}

impl ServiceSpans {
    /// Every service's, by name.
    pub(super) fn of_all(raw: &RawConfig) -> BTreeMap<String, ServiceSpans> {
        raw.service
            .iter()
            .map(|(name, service)| {
                let spans = ServiceSpans {
                    name: raw.service_names.get(name).cloned(),
                    count: service.count.as_ref().map(Spanned::span),
                    prefix: service.prefix.as_ref().map(Spanned::span),
                    domains: service.domains.as_ref().map(Spanned::span),
                };
                (name.clone(), spans)
            })
            .collect()
    }
}

/// The service with the most workers, for a problem with the total of workers: its `count` key,
/// and the span of its count (of its name, when count is left out).
pub(super) fn busiest(
    services: &BTreeMap<String, ServiceConfig>,
    written: &BTreeMap<String, ServiceSpans>,
) -> Option<(String, Option<Span>)> {
    let (name, _) = services.iter().max_by_key(|(_, service)| service.count)?;
    let span = written
        .get(name)
        .and_then(|spans| spans.count.clone().or_else(|| spans.name.clone()));
    Some((format!("service.{}.count", key_part(name)), span))
}

impl Checker<'_> {
    /// `[service.NAME]`; `control` is the control socket's path, which a service with a `user` names
    /// its worker socket after, and `name_span` where the file writes the name.
    pub(super) fn service(
        &mut self,
        name: String,
        name_span: Option<Span>,
        mut raw: RawService,
        control: &Path,
    ) -> ServiceConfig {
        // The service's keys as the file writes them: `service."a b".count`.
        let table = format!("service.{}", key_part(&name));
        let key = |field: &str| format!("{table}.{field}");
        let balancing = raw.take_balancing();
        let passing = Passing {
            pass_socket: raw.pass_socket.take(),
            concurrency: raw.concurrency.take(),
            listener: raw.listener.take(),
            ready_path: raw.ready_path.take(),
            stop_signal: raw.stop_signal.take(),
        };
        if !valid_name(&name) {
            self.report(name_span, table.clone(), NAME_RULE);
        }
        let checked = self.number(&key, "count", &raw.count, 1..u64::from(MAX_WORKERS) + 1);
        // A `count` given wrong is reported once: what depends on it (a fixed port's room, one
        // weight per worker) is not checked against a stand-in.
        let known_count = match (&raw.count, checked) {
            (Some(_), None) => None,
            (_, checked) => Some(checked.map_or(1, |n| n as u32)),
        };
        let count = known_count.unwrap_or(1);
        let (url, url_span) = match raw.url {
            Some(url) => (url.get_ref().clone(), Some(url.span())),
            // One address: a passed listener is one socket, where `localhost` binds two.
            None if passing.pass_socket.as_ref().is_some_and(|p| *p.get_ref()) => {
                (DEFAULT_PASSED_URL.to_string(), None)
            }
            None => (DEFAULT_URL.to_string(), None),
        };
        let url_span_for_pass = url_span.clone();
        let parsed_url = match url.replace(INDEX_PLACEHOLDER, "0").parse::<BindUrl>() {
            Err(err) => {
                self.report(url_span.clone(), key("url"), err.to_string());
                None
            }
            Ok(BindUrl::Tcp { .. }) if url.contains(INDEX_PLACEHOLDER) => {
                self.report(
                    url_span.clone(),
                    key("url"),
                    format!("{INDEX_PLACEHOLDER} is only allowed in unix:// urls"),
                );
                None
            }
            Ok(parsed) => Some(parsed),
        };
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
                            key(&format!("env.{}", key_part(variable))),
                            "a value cannot hold a NUL byte: the environment is NUL-terminated text",
                        );
                    }
                }
                env
            }
        };
        let command_span = raw.command.as_ref().map(Spanned::span);
        let command = match raw.command.take() {
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
                        // A program of the user's, if not a runnable one: what depends on the
                        // command is checked as for a server of one's own, not the built-in
                        // worker, and adds no second error.
                        WorkerCommand {
                            program: Program::Path(std::path::PathBuf::new()),
                            args: Vec::new(),
                        }
                    }
                    Some(program) => {
                        let program = resolve_program(&program, self.base, self.search_path)
                            .unwrap_or_else(|why| {
                                self.report(Some(span), key("command"), why.to_string());
                                Program::Path(std::path::PathBuf::from(program))
                            });
                        WorkerCommand {
                            program,
                            args: words.collect(),
                        }
                    }
                }
            }
        };
        let pass_socket = passing.pass_socket.as_ref().is_some_and(|p| *p.get_ref());
        let (concurrency, listener) = self.concurrency(
            &key,
            &passing,
            (pass_socket, balancing.balances_workers()),
            &command,
            &env,
        );
        if let (Some(parsed), Some(count)) = (&parsed_url, known_count) {
            self.listeners_fit(&key, (&url, parsed, url_span.clone()), count, listener);
        }
        let (ready_path, stop_signal) = self.passed_socket(
            &key,
            &passing,
            (&url, url_span_for_pass.clone()),
            &command,
            command_span.clone(),
        );
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
        let reach = if url.starts_with("unix:") {
            OrcaReach::Unix
        } else {
            OrcaReach::Yes
        };
        let (balancing, weights) = self.balancing(
            &key_part(&name),
            balancing,
            known_count,
            reach,
            (pass_socket, listener),
        );
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
        let account = self.account(&key, &name, (raw.user, raw.group), control);
        if let (Some(account), Program::Path(program)) = (&account, &command.program)
            && account.uid != 0
            && let Some(why) = not_runnable_by(program, account)
        {
            self.report(
                command_span.clone(),
                key("command"),
                format!(
                    "user {} cannot run {}: {why}; the workers would fail to start",
                    account.user,
                    program.display()
                ),
            );
        }
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
            pass_socket,
            ready_path,
            stop_signal,
            account,
            concurrency,
            listener,
        }
    }

    /// Whether `count` workers can all listen on `url` at once: a fixed port or one socket path
    /// serves one worker, unless they share the one listener.
    fn listeners_fit(
        &mut self,
        key: &dyn Fn(&str) -> String,
        (url, parsed, url_span): (&str, &BindUrl, Option<Span>),
        count: u32,
        listener: ListenerMode,
    ) {
        if listener == ListenerMode::Shared {
            if url.contains(INDEX_PLACEHOLDER) {
                self.report(
                    url_span,
                    key("url"),
                    format!(
                        "{INDEX_PLACEHOLDER} names a socket per worker, and the workers of a shared \
                         listener share one: write its one path"
                    ),
                );
            }
            return;
        }
        if let Some(port) = parsed.fixed_port().filter(|_| count > 1) {
            self.report(
                url_span.clone(),
                key("url"),
                format!(
                    "fixed port {port} cannot serve {count} workers: each worker binds its own \
                     listener (no SO_REUSEPORT); use port 0, count = 1, or a listener the workers \
                     share (pass_socket = true with listener = \"shared\")"
                ),
            );
        }
        if matches!(parsed, BindUrl::Unix { .. }) && count > 1 && !url.contains(INDEX_PLACEHOLDER) {
            self.report(
                url_span,
                key("url"),
                format!(
                    "one socket path cannot serve {count} workers: each worker binds its own \
                     listener; put {INDEX_PLACEHOLDER} in the path (e.g. \
                     unix:///run/app-{INDEX_PLACEHOLDER}.sock)"
                ),
            );
        }
    }

    /// `concurrency` and `listener`: how many requests one worker serves at once (written, or read
    /// off the command of a passed-socket server), and whether the workers share one listener: by
    /// default a passed-socket server of one request at a time does, unless the service chooses
    /// how Envoy balances over its workers (`balances_workers`).
    fn concurrency(
        &mut self,
        key: &dyn Fn(&str) -> String,
        raw: &Passing,
        (pass_socket, balances_workers): (bool, bool),
        command: &WorkerCommand,
        env: &BTreeMap<String, String>,
    ) -> (Concurrency, ListenerMode) {
        let written = match &raw.concurrency {
            None => None,
            Some(value) => match value.get_ref() {
                RawConcurrency::Text(text) if text == "auto" => None,
                RawConcurrency::Number(n) if (1..=i64::from(MAX_CONCURRENCY)).contains(n) => {
                    Some(Concurrency {
                        limit: Some(*n as u32),
                        source: ConcurrencySource::Written,
                    })
                }
                other => {
                    let shown = match other {
                        RawConcurrency::Number(n) => n.to_string(),
                        RawConcurrency::Text(text) => format!("{text:?}"),
                    };
                    self.report(
                        Some(value.span()),
                        key(CONCURRENCY_KEY),
                        format!(
                            "expected how many requests one worker serves at once, 1 to \
                             {MAX_CONCURRENCY}, or \"auto\" (read off a known server's command \
                             line), got {shown}"
                        ),
                    );
                    None
                }
            },
        };
        let concurrency = written.unwrap_or_else(|| match &command.program {
            Program::Peregrine => Concurrency::built_in(),
            Program::Path(program) => concurrency::infer(program, &command.args, env)
                .filter(|_| pass_socket)
                .unwrap_or_else(Concurrency::many),
        });
        let listener = match &raw.listener {
            // A balancing policy written for the service balances over its workers: each keeps
            // its own listener.
            None if balances_workers => ListenerMode::PerWorker,
            None => concurrency.default_listener(pass_socket),
            Some(text) => match ListenerMode::parse(text.get_ref()) {
                Some(ListenerMode::Shared) if !pass_socket => {
                    self.report(
                        Some(text.span()),
                        key("listener"),
                        "a shared listener is one the supervisor binds and passes to every worker: \
                         it needs pass_socket = true and a command of your own",
                    );
                    ListenerMode::PerWorker
                }
                Some(mode) => mode,
                None => {
                    self.report(
                        Some(text.span()),
                        key("listener"),
                        format!(
                            "expected \"shared\" or \"per-worker\", got {:?}",
                            text.get_ref()
                        ),
                    );
                    concurrency.default_listener(pass_socket)
                }
            },
        };
        (concurrency, listener)
    }

    /// `user` and `group`: the account the service's workers run as, which must exist and be one this
    /// supervisor may switch to, and a worker socket whose path a Unix socket can be bound at.
    fn account(
        &mut self,
        key: &dyn Fn(&str) -> String,
        name: &str,
        (user, group): (Option<Spanned<AccountId>>, Option<Spanned<AccountId>>),
        control: &Path,
    ) -> Option<Account> {
        let user_span = user.as_ref().map(Spanned::span);
        let group_span = group.as_ref().map(Spanned::span);
        if user.is_some() {
            let socket = worker_socket(control, name);
            let length = socket.as_os_str().len();
            if length > MAX_SOCKET_PATH {
                self.report(
                    user_span.clone(),
                    key("user"),
                    format!(
                        "the workers of a service with a user register on a socket of their own, \
                         {}, whose path of {length} bytes is longer than the {MAX_SOCKET_PATH} a Unix \
                         socket's may be: shorten supervisor.control or the service's name",
                        socket.display()
                    ),
                );
            }
        }
        let written =
            |id: &Option<Spanned<AccountId>>| id.as_ref().map(|id| id.get_ref().0.clone());
        let account = match account::resolve(written(&user).as_deref(), written(&group).as_deref())
        {
            Ok(account) => account?,
            Err(error) => {
                let (span, at) = match error.key() {
                    AccountKey::User => (user_span, "user"),
                    AccountKey::Group => (group_span, "group"),
                };
                self.report(span, key(at), error.to_string());
                return None;
            }
        };
        let identity = self.identity;
        if account.is_other_than(&identity) && !identity.can_switch {
            self.report(
                user_span,
                key("user"),
                format!(
                    "the workers would run as uid {} and gid {}, but the supervisor runs as uid {} \
                     and gid {} and cannot switch users: it must run as root or with CAP_SETUID and \
                     CAP_SETGID",
                    account.uid, account.gid, identity.uid, identity.gid
                ),
            );
        }
        Some(account)
    }

    /// The keys of a service whose listener the supervisor binds and passes (`pass_socket`,
    /// `ready_path`, the command's placeholders) and `stop_signal`: the ready path and the stop signal.
    fn passed_socket(
        &mut self,
        key: &dyn Fn(&str) -> String,
        raw: &Passing,
        (url, url_span): (&str, Option<Span>),
        command: &WorkerCommand,
        command_span: Option<Span>,
    ) -> (String, StopSignal) {
        let pass_socket = raw.pass_socket.as_ref().is_some_and(|p| *p.get_ref());
        let uses = |placeholder: &str| command.args.iter().any(|a| a.contains(placeholder));
        if pass_socket {
            if command.program == Program::Peregrine {
                self.report(
                    raw.pass_socket.as_ref().map(Spanned::span),
                    key("pass_socket"),
                    "is for servers of your own (command = [...]): the built-in worker binds its \
                     own listener and registers itself",
                );
            }
            match url.replace(INDEX_PLACEHOLDER, "0").parse::<BindUrl>() {
                Ok(BindUrl::Tcp { host, .. }) if host.parse::<std::net::IpAddr>().is_err() => {
                    self.report(
                        url_span,
                        key("url"),
                        format!(
                            "with pass_socket the supervisor binds one listener per worker: give an IP \
                             address (127.0.0.1, ::1, 0.0.0.0), not {host:?}, which may resolve to several"
                        ),
                    );
                }
                Ok(BindUrl::Unix { .. }) if uses(PORT_PLACEHOLDER) => self.report(
                    command_span.clone(),
                    key("command"),
                    format!("{PORT_PLACEHOLDER} needs a TCP url: a unix:// listener has no port"),
                ),
                _ => {}
            }
        } else {
            for placeholder in [FD_PLACEHOLDER, PORT_PLACEHOLDER, ADDRESS_PLACEHOLDER] {
                if uses(placeholder) {
                    self.report(
                        command_span.clone(),
                        key("command"),
                        format!(
                            "{placeholder} names the listener the supervisor passes, and it passes \
                             none: set pass_socket = true"
                        ),
                    );
                }
            }
        }
        let ready_path = match &raw.ready_path {
            None => DEFAULT_READY_PATH.to_owned(),
            Some(path) if !pass_socket => {
                self.report(
                    Some(path.span()),
                    key("ready_path"),
                    "applies to pass_socket services only: a worker that registers itself is ready \
                     when it registers",
                );
                DEFAULT_READY_PATH.to_owned()
            }
            Some(path) if !is_request_path(path.get_ref()) => {
                self.report(
                    Some(path.span()),
                    key("ready_path"),
                    format!(
                        "{:?} is not a request path: it must start with / and hold only visible \
                         ASCII, without #",
                        path.get_ref()
                    ),
                );
                DEFAULT_READY_PATH.to_owned()
            }
            Some(path) => path.get_ref().clone(),
        };
        let stop_signal = match &raw.stop_signal {
            None => StopSignal::default(),
            Some(name) => StopSignal::parse(name.get_ref()).unwrap_or_else(|| {
                let known: Vec<String> = StopSignal::NAMES
                    .iter()
                    .map(|(n, _)| format!("SIG{n}"))
                    .collect();
                self.report(
                    Some(name.span()),
                    key("stop_signal"),
                    format!(
                        "no such signal {:?}: one of {}",
                        name.get_ref(),
                        known.join(", ")
                    ),
                );
                StopSignal::default()
            }),
        };
        (ready_path, stop_signal)
    }
}

/// The keys of a service about a passed socket and its stop, taken out of its table.
struct Passing {
    pass_socket: Option<Spanned<bool>>,
    concurrency: Option<Spanned<RawConcurrency>>,
    listener: Option<Spanned<String>>,
    ready_path: Option<Spanned<String>>,
    stop_signal: Option<Spanned<String>>,
}

/// Whether `path` can be sent as the target of a request line: `/`, then visible ASCII without `#`.
fn is_request_path(path: &str) -> bool {
    path.starts_with('/') && path.bytes().all(|b| b.is_ascii_graphic() && b != b'#')
}

/// Why `account` (holding no capability, as every worker) cannot run the program at `path`, if it
/// cannot: a folder on the way it may not search, or a file it may not execute; for a script, the
/// same of its interpreter. Read from the mode bits, as the kernel judges them without ACLs.
fn not_runnable_by(path: &Path, account: &Account) -> Option<String> {
    // The kernel follows at most 4 interpreters (BINPRM_MAX_RECURSION): so does this.
    not_runnable_within(path, account, 4)
}

fn not_runnable_within(path: &Path, account: &Account, interpreters: u8) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let ids = |meta: &std::fs::Metadata| (meta.uid(), meta.gid(), meta.mode());
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    if let Some((dir, mode)) = [path, real.as_path()]
        .into_iter()
        .find_map(|file| account.unsearchable_folder(file))
    {
        return Some(format!(
            "{} (mode {mode:04o}) is not searchable by it",
            dir.display()
        ));
    }
    let meta = std::fs::metadata(&real).ok()?;
    if !account.may(0o1, ids(&meta)) {
        return Some(format!(
            "{} (mode {:04o}) is not executable by it",
            real.display(),
            meta.mode() & 0o7777
        ));
    }
    // A script runs its interpreter, which must be runnable too (and readable, the script).
    let mut head = [0u8; 256];
    let read = std::fs::File::open(&real)
        .and_then(|mut file| std::io::Read::read(&mut file, &mut head))
        .ok()?;
    let interpreter = head[..read]
        .strip_prefix(b"#!")
        .and_then(|line| line.split(|b| *b == b'\n').next())
        .and_then(|line| std::str::from_utf8(line).ok())
        .and_then(|line| line.split_whitespace().next())?;
    if !account.may(0o4, ids(&meta)) {
        return Some(format!(
            "the script {} (mode {:04o}) is not readable by it",
            real.display(),
            meta.mode() & 0o7777
        ));
    }
    let interpreter = Path::new(interpreter);
    interpreters
        .checked_sub(1)
        .and_then(|left| not_runnable_within(interpreter, account, left))
        .map(|why| format!("its interpreter {}: {why}", interpreter.display()))
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::Path};

    use super::*;
    use crate::config::concurrency::{Concurrency, ListenerMode};
    use crate::config::{
        Config, Identity,
        testing::{parse, parse_as, problems},
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
    fn a_server_of_one_request_at_a_time_shares_a_listener_unless_told_otherwise() {
        let gunicorn =
            "pass_socket = true\ncommand = [\"/usr/bin/env\", \"gunicorn\", \"app:app\"]\n";
        let service = |extra: &str| {
            parse(&format!("[service.api]\ncount = 4\n{gunicorn}{extra}"))
                .map(|config| config.services["api"].clone())
        };
        // gunicorn's sync worker: one at a time, so one shared listener and least request between
        // hosts' listeners.
        let api = service("").unwrap();
        assert_eq!(api.concurrency.limit, Some(1));
        assert_eq!(api.concurrency.describe(), "1 (gunicorn's sync worker)");
        assert_eq!(api.listener, ListenerMode::Shared);
        assert_eq!(api.balancing.name(), "least_request");
        // A fixed port serves every worker of a shared listener.
        let fixed = service("url = \"http://127.0.0.1:8000\"\n").unwrap();
        assert_eq!(fixed.listener, ListenerMode::Shared);
        // A balancing policy written balances over the workers: each keeps its own listener.
        for policy in [
            "orca = true",
            "lb_policy = \"least_request\"",
            "weights = [1, 1, 1, 2]",
        ] {
            let api = service(&format!("{policy}\n")).unwrap();
            assert_eq!(api.listener, ListenerMode::PerWorker, "{policy}");
        }
        assert_eq!(
            service("orca = false\n").unwrap().listener,
            ListenerMode::Shared
        );
        // Written, either way.
        let many = service("listener = \"per-worker\"\n").unwrap();
        assert_eq!(
            (many.listener, many.balancing.name()),
            (ListenerMode::PerWorker, "orca")
        );
        let async_server = service("concurrency = 100\n").unwrap();
        assert_eq!(async_server.listener, ListenerMode::PerWorker);
        let uvicorn = parse(
            "[service.api]\ncount = 2\npass_socket = true\nconcurrency = 1\n\
             command = [\"/usr/bin/env\", \"uvicorn\", \"--fd\", \"{fd}\", \"app:app\"]\n",
        )
        .unwrap();
        assert_eq!(uvicorn.services["api"].listener, ListenerMode::Shared);
        // The built-in worker is never taken for one at a time.
        let builtin = parse("[service.a]\ncount = 2\n").unwrap();
        assert_eq!(builtin.services["a"].concurrency, Concurrency::built_in());
        assert_eq!(builtin.services["a"].listener, ListenerMode::PerWorker);
    }

    #[test]
    fn shared_listener_mistakes_are_explained_with_their_lines() {
        let errors = |source: &str| problems(source).join("\n");
        let text = errors("[service.a]\ncount = 2\nlistener = \"shared\"\n");
        assert!(
            text.contains(
                "line 3: service.a.listener: a shared listener is one the supervisor binds"
            ),
            "{text}"
        );
        // ORCA with a shared listener weighs the hosts' listeners on their reports, out of band
        // only (a passed-socket server does not carry reports in its responses).
        let shared_orca = parse(
            "[service.a]\ncount = 2\npass_socket = true\ncommand = [\"/bin/sh\"]\n\
             listener = \"shared\"\norca = true\n",
        )
        .unwrap();
        let a = &shared_orca.services["a"];
        assert_eq!(
            (a.listener, a.balancing.name()),
            (ListenerMode::Shared, "orca")
        );
        assert_eq!(
            a.balanced_on(),
            "concurrency many (assumed), one shared listener, orca between hosts"
        );
        let text = errors(
            "[service.a]\npass_socket = true\ncommand = [\"/bin/sh\"]\nlistener = \"shared\"\n\
             orca = \"in-band\"\n",
        );
        assert!(
            text.contains("line 5: service.a.orca: orca = \"in-band\" needs"),
            "{text}"
        );
        let text = errors(
            "[service.a]\ncount = 2\npass_socket = true\ncommand = [\"/bin/sh\"]\n\
             listener = \"shared\"\nurl = \"unix:///run/a-{index}.sock\"\n",
        );
        assert!(
            text.contains("line 6: service.a.url: {index} names a socket per worker"),
            "{text}"
        );
        let text = errors("[service.a]\nconcurrency = 0\n");
        assert!(
            text.contains("line 2: service.a.concurrency: expected how many requests"),
            "{text}"
        );
        let text = errors("[service.a]\nconcurrency = \"many\"\n");
        assert!(text.contains("got \"many\""), "{text}");
        let text = errors("[service.a]\nlistener = \"own\"\n");
        assert!(
            text.contains("expected \"shared\" or \"per-worker\", got \"own\""),
            "{text}"
        );
        // A fixed port for several workers each with its own listener says what would share one.
        let text = errors("[service.a]\ncount = 2\nurl = \"http://127.0.0.1:8000\"\n");
        assert!(text.contains("listener = \"shared\""), "{text}");
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
    fn a_passed_socket_service_takes_placeholders_a_ready_path_and_a_stop_signal() {
        let config = parse(
            "[service.api]\ncount = 2\nurl = \"http://127.0.0.1:0\"\npass_socket = true\n\
             command = [\"/bin/sh\", \"-c\", \"exec app --fd {fd} --port {port} {address}\"]\n\
             ready_path = \"/healthz?deep=1\"\nstop_signal = \"SIGQUIT\"\n",
        )
        .unwrap();
        let api = &config.services["api"];
        assert!(api.pass_socket);
        assert_eq!(api.ready_path, "/healthz?deep=1");
        assert_eq!(api.stop_signal.signal, rustix::process::Signal::QUIT);
        assert_eq!(api.stop_signal.to_string(), "SIGQUIT");
        // The kernel counts its servers' responses: ORCA, as for any IP url.
        assert_eq!(api.balancing.name(), "orca");

        let plain = parse("[service.a]\n").unwrap();
        let a = &plain.services["a"];
        assert!(!a.pass_socket);
        assert_eq!(a.ready_path, "/");
        assert_eq!(a.stop_signal.to_string(), "SIGTERM");
        assert_eq!(
            StopSignal::parse("term").map(|s| s.signal),
            Some(rustix::process::Signal::TERM)
        );
    }

    #[test]
    fn passed_socket_mistakes_are_explained_with_their_lines() {
        let got = problems(
            "[service.a]\ncommand = [\"/bin/sh\", \"--bind\", \"fd://{fd}\"]\n\
             [service.b]\npass_socket = true\ncommand = [\"/bin/sh\"]\nready_path = \"healthz\"\n\
             [service.c]\npass_socket = true\ncommand = [\"/bin/sh\"]\nstop_signal = \"SIGSTOPP\"\n\
             [service.d]\nready_path = \"/ready\"\n\
             [service.e]\npass_socket = true\n\
             [service.g]\npass_socket = true\nurl = \"http://localhost:0\"\ncommand = [\"/bin/sh\"]\n\
             [service.h]\npass_socket = true\nurl = \"unix:///run/h.sock\"\ncommand = [\"/bin/sh\", \"{port}\"]\n",
        );
        let expect = [
            "line 2: service.a.command: {fd} names the listener the supervisor passes, and it passes none: set pass_socket = true",
            "line 6: service.b.ready_path: \"healthz\" is not a request path",
            "line 10: service.c.stop_signal: no such signal \"SIGSTOPP\": one of SIGTERM, SIGINT, SIGQUIT",
            "line 12: service.d.ready_path: applies to pass_socket services only",
            "line 14: service.e.pass_socket: is for servers of your own",
            "line 17: service.g.url: with pass_socket the supervisor binds one listener per worker",
            "line 22: service.h.command: {port} needs a TCP url",
        ];
        assert_eq!(got.len(), expect.len(), "{got:#?}");
        for (got, expect) in got.iter().zip(expect) {
            assert!(
                got.starts_with(expect),
                "{got:?} does not start with {expect:?}"
            );
        }
    }

    /// The uid and gid of `nobody`, from the user database.
    fn nobody() -> (u32, u32) {
        let nobody = nix::unistd::User::from_name("nobody")
            .unwrap()
            .expect("a nobody user");
        (nobody.uid.as_raw(), nobody.gid.as_raw())
    }

    #[test]
    fn a_user_and_a_group_give_the_workers_account() {
        let (uid, gid) = nobody();
        let config = parse("[service.a]\nuser = \"nobody\"\n[service.b]\n").unwrap();
        let account = config.services["a"].account.as_ref().expect("an account");
        assert_eq!(
            (account.user.as_str(), account.uid, account.gid),
            ("nobody", uid, gid)
        );
        assert!(account.groups.contains(&gid), "{account:?}");
        assert_eq!(config.services["b"].account, None);
        // A numeric id, as an integer or as a text, and a group by name.
        for user in [uid.to_string(), format!("\"{uid}\"")] {
            let config = parse(&format!("[service.a]\nuser = {user}\ngroup = \"root\"\n")).unwrap();
            let account = config.services["a"].account.clone().unwrap();
            assert_eq!((account.uid, account.gid), (uid, 0), "{user}");
        }
    }

    #[test]
    fn a_program_its_user_cannot_reach_or_run_is_found_and_a_script_by_its_interpreter() {
        use std::os::unix::fs::PermissionsExt;
        let ours = rustix::process::geteuid().as_raw();
        let uid = if ours == 4242 { 4243 } else { 4242 };
        let stranger = Account {
            user: "stranger".into(),
            uid,
            gid: uid,
            groups: vec![uid],
            login: None,
        };
        let mode = |path: &Path, mode| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        let dir = tempfile::tempdir().unwrap();
        mode(dir.path(), 0o755);
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        mode(&bin, 0o755);
        let python = bin.join("python");
        std::fs::write(&python, "").unwrap();
        mode(&python, 0o755);
        let app = bin.join("app");
        std::fs::write(&app, format!("#!{} -u\nprint()\n", python.display())).unwrap();
        mode(&app, 0o755);
        assert_eq!(not_runnable_by(&app, &stranger), None);
        // A folder on the way it may not search (a virtualenv under /root).
        mode(&bin, 0o700);
        let why = not_runnable_by(&app, &stranger).expect("bin/ is the owner's alone");
        assert!(
            why.contains("bin (mode 0700) is not searchable by it"),
            "{why}"
        );
        mode(&bin, 0o755);
        // Not executable, then its interpreter not executable.
        mode(&app, 0o644);
        let why = not_runnable_by(&app, &stranger).expect("not executable");
        assert!(
            why.contains("app (mode 0644) is not executable by it"),
            "{why}"
        );
        mode(&app, 0o755);
        mode(&python, 0o700);
        let why = not_runnable_by(&app, &stranger).expect("its interpreter is the owner's");
        assert!(
            why.starts_with(&format!("its interpreter {}", python.display())),
            "{why}"
        );
        // A script that names itself as its interpreter ends.
        std::fs::write(&app, format!("#!{}\n", app.display())).unwrap();
        assert_eq!(not_runnable_by(&app, &stranger), None);
    }

    #[test]
    fn a_command_that_cannot_run_is_one_problem_not_a_cascade() {
        for command in ["[\"no-such-server-of-peregrine\"]", "[]", "[\"\"]"] {
            let got = problems(&format!(
                "[service.a]\npass_socket = true\ncommand = {command}\n"
            ));
            assert_eq!(got.len(), 1, "command = {command}: {got:?}");
            assert!(got[0].starts_with("line 3: service.a.command: "), "{got:?}");
        }
    }

    #[test]
    fn a_count_given_wrong_is_one_problem_not_a_cascade() {
        for count in ["5000", "0", "-1"] {
            let got = problems(&format!(
                "[service.a]\ncount = {count}\nweights = [1, 2]\nurl = \"http://127.0.0.1:8080\"\n"
            ));
            assert_eq!(got.len(), 1, "count = {count}: {got:?}");
            assert!(got[0].starts_with("line 2: service.a.count: "), "{got:?}");
        }
        // A weight out of range still is one, whatever the count.
        let got = problems("[service.a]\ncount = 0\nweights = [0]\n");
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got[1].contains("each weight must be between 1 and"),
            "{got:?}"
        );
        // With a good count, both are checked against it.
        let got =
            problems("[service.a]\ncount = 3\nweights = [1, 2]\nurl = \"http://127.0.0.1:8080\"\n");
        assert_eq!(got.len(), 2, "{got:?}");
    }

    #[test]
    fn an_unknown_user_or_group_and_a_group_without_a_user_are_named_with_their_lines() {
        let got = problems(
            "[service.a]\nuser = \"no-such-user-here\"\n\
             [service.b]\nuser = \"nobody\"\ngroup = \"no-such-group-here\"\n\
             [service.c]\n\ngroup = \"root\"\n\
             [service.d]\nuser = \"\"\n\
             [service.e]\nuser = 4294967295\n",
        );
        assert_eq!(
            got,
            [
                "line 2: service.a.user: no user \"no-such-user-here\" in the user database",
                "line 5: service.b.group: no group \"no-such-group-here\" in the group database",
                "line 8: service.c.group: is set without user: a service's workers run as the \
                 supervisor's own user and group unless user names another; set user too",
                "line 10: service.d.user: must name a user or give a numeric uid",
                "line 12: service.e.user: 4294967295 is not a valid uid: ids run from 0 to \
                 4294967294",
            ]
        );
        let got = problems("[service.a]\nuser = -1\n");
        assert!(
            got[0].starts_with("line 2: service.a.user: invalid value"),
            "{got:?}"
        );
    }

    #[test]
    fn a_uid_without_an_entry_in_the_user_database_needs_a_group() {
        let uid = (2_000_000_000_u32..)
            .find(|&uid| {
                nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                    .unwrap()
                    .is_none()
            })
            .unwrap();
        let got = problems(&format!("[service.a]\nuser = {uid}\n"));
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with(&format!(
                "line 2: service.a.user: uid {uid} has no entry in the user database"
            )),
            "{got:?}"
        );
        let config = parse(&format!("[service.a]\nuser = {uid}\ngroup = 4242\n")).unwrap();
        let account = config.services["a"].account.clone().unwrap();
        assert_eq!(
            (account.uid, account.gid, account.groups),
            (uid, 4242, vec![4242])
        );
    }

    #[test]
    fn another_user_needs_a_supervisor_that_can_switch_users() {
        let (uid, gid) = nobody();
        let unprivileged = Identity {
            uid: 1000,
            gid: 1000,
            can_switch: false,
        };
        let got =
            parse_as("[service.a]\ncount = 2\nuser = \"nobody\"\n", unprivileged).unwrap_err();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(
            got[0].to_string(),
            format!(
                "line 3: service.a.user: the workers would run as uid {uid} and gid {gid}, but the \
                 supervisor runs as uid 1000 and gid 1000 and cannot switch users: it must run as \
                 root or with CAP_SETUID and CAP_SETGID"
            )
        );
        // Its own account needs no switch; a supervisor that may switch takes any.
        let itself = Identity {
            uid,
            gid,
            can_switch: false,
        };
        assert!(parse_as("[service.a]\nuser = \"nobody\"\n", itself).is_ok());
        let privileged = Identity {
            can_switch: true,
            ..unprivileged
        };
        assert!(parse_as("[service.a]\nuser = \"nobody\"\n", privileged).is_ok());
    }

    #[test]
    fn a_worker_socket_path_too_long_for_a_unix_socket_is_refused_at_the_user() {
        // `/r/` + the directory + `/c.sock` + `.a.workers`: 3 + dir + 7 + 10 bytes.
        let config = |dir_len: usize, user: &str| {
            format!(
                "[supervisor]\ncontrol = \"/r/{}/c.sock\"\n[service.a]\n{user}",
                "d".repeat(dir_len)
            )
        };
        let fits = 107 - 20;
        let path = crate::config::worker_socket(
            parse(&config(fits, ""))
                .unwrap()
                .supervisor
                .control
                .as_path(),
            "a",
        );
        assert_eq!(path.as_os_str().len(), 107, "{}", path.display());
        assert!(parse(&config(fits, "user = \"nobody\"\n")).is_ok());
        // Without a user the service has no worker socket, and its length does not matter.
        assert!(parse(&config(fits + 1, "")).is_ok());
        let got = problems(&config(fits + 1, "\nuser = \"nobody\"\n"));
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(
            got[0].starts_with(
                "line 5: service.a.user: the workers of a service with a user register"
            ),
            "{got:?}"
        );
        assert!(
            got[0]
                .contains("whose path of 108 bytes is longer than the 107 a Unix socket's may be"),
            "{got:?}"
        );
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
