//! What a service's workers are: how many requests one serves at once (`concurrency`), and the
//! listener that follows from it (`listener`).
//!
//! A server that takes one request at a time (gunicorn's sync worker, Unicorn, Puma with one thread)
//! is balanced best by one accept queue that all its processes share: each connection goes to
//! whichever process frees first, as the server's own pre-fork model does. A listener per worker
//! binds each request to one worker when Envoy sends it, and a request queued behind a slow one
//! waits it out while another worker is idle. Servers that take many requests at once (async ones,
//! the built-in worker) keep a listener each, which Envoy weighs by load.
//!
//! Left to `"auto"`, the concurrency of a passed-socket server is read off its command line (and
//! `GUNICORN_CMD_ARGS`) for the servers known here; any other server is taken to serve many at once.
//!
//! Invariant: pure functions of the config's text; nothing here looks at a running process.

use std::{collections::BTreeMap, path::Path};

/// The service key of the concurrency.
pub const CONCURRENCY_KEY: &str = "concurrency";

/// The most `concurrency` may say.
pub const MAX_CONCURRENCY: u32 = 65_535;

/// How a service's workers listen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenerMode {
    /// Each worker its own listener, published as an endpoint of its own.
    PerWorker,
    /// One listener the supervisor binds once and passes to every worker of the service: one
    /// accept queue, published as one endpoint (a passed-socket service only).
    Shared,
}

impl ListenerMode {
    /// As the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ListenerMode::PerWorker => "per-worker",
            ListenerMode::Shared => "shared",
        }
    }

    /// From the config's text.
    pub fn parse(text: &str) -> Option<ListenerMode> {
        match text {
            "per-worker" => Some(ListenerMode::PerWorker),
            "shared" => Some(ListenerMode::Shared),
            _ => None,
        }
    }
}

/// How many requests one worker of a service serves at once, and how that was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Concurrency {
    /// The most requests a worker serves at once; `None`: many (an async server, or one not known).
    pub limit: Option<u32>,
    /// Where the figure comes from.
    pub source: ConcurrencySource,
}

/// Where a service's concurrency comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConcurrencySource {
    /// `concurrency = N` in the config.
    Written,
    /// Read off the command line of a server known here: why, in words (`gunicorn's sync worker`).
    Command(String),
    /// The built-in worker, which serves many at once.
    BuiltIn,
    /// Neither written nor recognised: taken as many at once.
    Assumed,
}

impl Concurrency {
    /// Many at once, as assumed of a server not known here.
    pub fn many() -> Self {
        Concurrency {
            limit: None,
            source: ConcurrencySource::Assumed,
        }
    }

    /// The built-in worker's: many at once.
    pub fn built_in() -> Self {
        Concurrency {
            limit: None,
            source: ConcurrencySource::BuiltIn,
        }
    }

    /// One line for `peregrine check` and `status`: `1 (gunicorn's sync worker)`.
    pub fn describe(&self) -> String {
        let figure = match self.limit {
            Some(n) => n.to_string(),
            None => "many".to_owned(),
        };
        match &self.source {
            ConcurrencySource::Written => format!("{figure} (written)"),
            ConcurrencySource::Command(why) => format!("{figure} ({why})"),
            ConcurrencySource::BuiltIn => format!("{figure} (the built-in worker)"),
            ConcurrencySource::Assumed => format!("{figure} (assumed)"),
        }
    }

    /// The listener a passed-socket service of this concurrency gets unless `listener` says
    /// otherwise: shared for one at a time.
    pub fn default_listener(&self, pass_socket: bool) -> ListenerMode {
        if pass_socket && self.limit == Some(1) {
            ListenerMode::Shared
        } else {
            ListenerMode::PerWorker
        }
    }
}

/// The concurrency of a server started by `program` with `args` and the service's `env`, for the
/// servers known here; `None` for any other.
pub fn infer(
    program: &Path,
    args: &[String],
    env: &BTreeMap<String, String>,
) -> Option<Concurrency> {
    // A wrapper (`taskset -c 0 gunicorn ...`, `python -m gunicorn ...`, `bundle exec puma ...`) runs
    // the server later on the line: the first word that names one starts its arguments.
    let words: Vec<&str> = std::iter::once(program.to_str().unwrap_or_default())
        .chain(args.iter().map(String::as_str))
        .collect();
    let (at, server) = words.iter().enumerate().find_map(|(at, word)| {
        let name = Path::new(word).file_name()?.to_str()?;
        Server::named(name).map(|server| (at, server))
    })?;
    let rest = &words[at + 1..];
    let (limit, why) = match server {
        Server::Gunicorn => {
            // GUNICORN_CMD_ARGS comes before the command line, which wins.
            let from_env: Vec<&str> = env
                .get("GUNICORN_CMD_ARGS")
                .map(|a| a.split_whitespace().collect())
                .unwrap_or_default();
            let all: Vec<&str> = from_env.iter().chain(rest).copied().collect();
            let class = option(&all, &["-k", "--worker-class"]);
            let threads = option(&all, &["--threads"]).and_then(|t| t.parse::<u32>().ok());
            match class.map(gunicorn_class) {
                None | Some("sync") => match threads {
                    // gunicorn runs a sync worker with more than one thread as gthread.
                    Some(n) if n > 1 => (Some(n), format!("gunicorn with --threads {n}")),
                    _ => (Some(1), "gunicorn's sync worker".to_owned()),
                },
                Some("gthread") => {
                    let n = threads.unwrap_or(1).max(1);
                    (Some(n), format!("gunicorn's gthread worker, {n} thread(s)"))
                }
                Some(other) => (None, format!("gunicorn's {other} worker")),
            }
        }
        Server::Unicorn => (Some(1), "Unicorn".to_owned()),
        Server::Puma => {
            // `-t MIN:MAX` or `--threads MIN:MAX` (or one figure); Puma's default is more than one.
            let max = option(rest, &["-t", "--threads"])
                .and_then(|t| t.rsplit(':').next().and_then(|m| m.parse::<u32>().ok()));
            match max {
                Some(n) => (Some(n.max(1)), format!("Puma with {n} thread(s)")),
                None => (None, "Puma's default threads".to_owned()),
            }
        }
    };
    Some(Concurrency {
        limit,
        source: ConcurrencySource::Command(why),
    })
}

/// The servers whose concurrency their command line tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    Gunicorn,
    Unicorn,
    Puma,
}

impl Server {
    fn named(name: &str) -> Option<Server> {
        match name {
            "gunicorn" | "gunicorn3" => Some(Server::Gunicorn),
            "unicorn" | "unicorn_rails" => Some(Server::Unicorn),
            "puma" => Some(Server::Puma),
            _ => None,
        }
    }
}

/// The value of the first of `names` in `words`: `--name value`, `--name=value` or `-kvalue`.
fn option<'a>(words: &[&'a str], names: &[&str]) -> Option<&'a str> {
    let mut found = None;
    let mut words = words.iter();
    while let Some(word) = words.next() {
        for name in names {
            if word == name {
                found = words.next().copied();
            } else if let Some(value) = word.strip_prefix(name) {
                if let Some(value) = value.strip_prefix('=') {
                    found = Some(value);
                } else if !name.starts_with("--") && !value.is_empty() {
                    found = Some(value);
                }
            }
        }
    }
    // The last one written wins, as in gunicorn's and Puma's parsers.
    found
}

/// A gunicorn worker class as a short name: `sync`, `gthread`, `gevent`, `uvicorn.workers.UvicornWorker`.
fn gunicorn_class(class: &str) -> &str {
    let class = class.strip_prefix("egg:gunicorn#").unwrap_or(class);
    match class {
        "sync" | "gunicorn.workers.sync.SyncWorker" => "sync",
        "gthread" | "gunicorn.workers.gthread.ThreadWorker" => "gthread",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn infer_line(line: &str, env: &[(&str, &str)]) -> Option<Option<u32>> {
        let mut words = line.split_whitespace();
        let program = Path::new(words.next().unwrap());
        let args: Vec<String> = words.map(str::to_owned).collect();
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        infer(program, &args, &env).map(|c| c.limit)
    }

    #[test]
    fn gunicorns_sync_worker_takes_one_request_at_a_time_and_its_other_classes_more() {
        assert_eq!(
            infer_line("/srv/venv/bin/gunicorn --workers 1 app:app", &[]),
            Some(Some(1))
        );
        assert_eq!(infer_line("gunicorn -k sync app:app", &[]), Some(Some(1)));
        assert_eq!(
            infer_line("gunicorn --threads 4 app:app", &[]),
            Some(Some(4))
        );
        assert_eq!(
            infer_line("gunicorn -k gthread app:app", &[]),
            Some(Some(1))
        );
        assert_eq!(
            infer_line("gunicorn -k uvicorn.workers.UvicornWorker app:app", &[]),
            Some(None)
        );
        assert_eq!(
            infer_line("gunicorn --worker-class=gevent app:app", &[]),
            Some(None)
        );
        assert_eq!(infer_line("gunicorn -kgevent app:app", &[]), Some(None));
        // Through a wrapper, and from the environment, which the command line overrides.
        assert_eq!(
            infer_line("taskset -c 0 gunicorn app:app", &[]),
            Some(Some(1))
        );
        assert_eq!(
            infer_line("gunicorn app:app", &[("GUNICORN_CMD_ARGS", "-k gevent")]),
            Some(None)
        );
        assert_eq!(
            infer_line(
                "gunicorn -k sync app:app",
                &[("GUNICORN_CMD_ARGS", "-k gevent")]
            ),
            Some(Some(1))
        );
    }

    #[test]
    fn unicorn_and_puma_are_read_and_other_servers_are_not_known() {
        assert_eq!(
            infer_line("bundle exec unicorn -c u.rb", &[]),
            Some(Some(1))
        );
        assert_eq!(infer_line("puma -t 1:1 config.ru", &[]), Some(Some(1)));
        assert_eq!(infer_line("puma --threads 0:5", &[]), Some(Some(5)));
        assert_eq!(infer_line("puma config.ru", &[]), Some(None));
        assert_eq!(infer_line("/usr/bin/node server.js", &[]), None);
        assert_eq!(infer_line("uvicorn --fd 3 app:app", &[]), None);
        // A path that merely mentions a server is not it.
        assert_eq!(
            infer_line("/usr/bin/python3 /srv/gunicorn-like/app.py", &[]),
            None
        );
    }

    #[test]
    fn one_at_a_time_shares_a_passed_listener_and_nothing_else_does() {
        let one = Concurrency {
            limit: Some(1),
            source: ConcurrencySource::Written,
        };
        assert_eq!(one.default_listener(true), ListenerMode::Shared);
        assert_eq!(one.default_listener(false), ListenerMode::PerWorker);
        assert_eq!(
            Concurrency::many().default_listener(true),
            ListenerMode::PerWorker
        );
        assert_eq!(one.describe(), "1 (written)");
        assert_eq!(ListenerMode::parse("shared"), Some(ListenerMode::Shared));
        assert_eq!(
            ListenerMode::parse(ListenerMode::PerWorker.as_str()),
            Some(ListenerMode::PerWorker)
        );
        assert_eq!(ListenerMode::parse("own"), None);
    }
}
