//! Envoy's admin `/clusters` polled from a thread of its own, at a fixed interval, for as long as the
//! watch runs (from inside a host's network namespace when asked): every change of what a
//! projection of the answer shows, with when it came and how finely that moment is known. A change
//! that comes and goes between two polls is missed.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::http_get;

/// Run first on the watch's thread (e.g. [`NetHost::entry`](crate::NetHost::entry)).
pub type Enter = Box<dyn FnOnce() -> anyhow::Result<()> + Send>;

/// One state the watch saw.
#[derive(Clone, Debug)]
pub struct Change<T> {
    /// When the answer that first showed it arrived.
    pub at: Instant,
    /// Since the answer before, which did not show it: the state came within this (zero for the
    /// first state).
    pub resolution: Duration,
    /// The projection of the answer.
    pub state: T,
}

/// A running watch of one Envoy's `/clusters`; stopped on drop.
#[derive(Debug)]
pub struct AdminWatch<T> {
    shared: Arc<Shared<T>>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared<T> {
    stop: AtomicBool,
    changes: Mutex<Vec<Change<T>>>,
    /// Why the thread could not watch (it could not enter where it was to run).
    error: Mutex<Option<String>>,
}

impl<T: Clone + PartialEq + Send + 'static> AdminWatch<T> {
    /// Polls `GET /clusters` on `admin` every `every` (after `enter`, if any), keeping each answer's
    /// `project`ion that differs from the one before. An answer that fails (or is not 200) is
    /// skipped.
    pub fn start(
        admin: SocketAddr,
        every: Duration,
        enter: Option<Enter>,
        project: impl Fn(&str) -> T + Send + 'static,
    ) -> AdminWatch<T> {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            changes: Mutex::new(Vec::new()),
            error: Mutex::new(None),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                if let Some(enter) = enter
                    && let Err(error) = enter()
                {
                    *lock(&shared.error) = Some(format!("{error:#}"));
                    return;
                }
                let mut previous: Option<Instant> = None;
                loop {
                    // One more poll once told to stop: the state at the end is in the timeline.
                    let stopping = shared.stop.load(Ordering::Relaxed);
                    let polled = Instant::now();
                    if let Ok((200, text)) = http_get(admin, "/clusters") {
                        let at = Instant::now();
                        let state = project(&text);
                        let mut changes = lock(&shared.changes);
                        if changes.last().is_none_or(|last| last.state != state) {
                            let resolution = previous.map_or(Duration::ZERO, |p| at - p);
                            changes.push(Change {
                                at,
                                resolution,
                                state,
                            });
                        }
                        previous = Some(at);
                    }
                    if stopping {
                        break;
                    }
                    std::thread::sleep(every.saturating_sub(polled.elapsed()));
                }
            })
        };
        AdminWatch {
            shared,
            thread: Some(thread),
        }
    }

    /// Every state seen so far, oldest first.
    pub fn changes(&self) -> Vec<Change<T>> {
        lock(&self.shared.changes).clone()
    }

    /// The state of the latest answer.
    pub fn latest(&self) -> Option<Change<T>> {
        lock(&self.shared.changes).last().cloned()
    }

    /// The first state seen at or after `since` for which `f` holds.
    pub fn first_since(&self, since: Instant, f: impl Fn(&T) -> bool) -> Option<Change<T>> {
        lock(&self.shared.changes)
            .iter()
            .find(|change| change.at >= since && f(&change.state))
            .cloned()
    }

    /// Why the watch's thread could not watch, if it could not.
    pub fn error(&self) -> Option<String> {
        lock(&self.shared.error).clone()
    }

    /// Stops the watch (after one last poll); returns every state seen, oldest first.
    pub fn stop(mut self) -> Vec<Change<T>> {
        self.halt();
        self.changes()
    }

    fn halt(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl<T> Drop for AdminWatch<T> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::{io::Write, net::TcpListener};

    use super::*;

    /// An admin stand-in that answers `/clusters` with `bodies` in turn (the last one from then
    /// on).
    fn admin(bodies: Vec<&'static str>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for (i, stream) in listener.incoming().enumerate() {
                let Ok(mut stream) = stream else { return };
                let mut buf = [0u8; 1024];
                let _ = std::io::Read::read(&mut stream, &mut buf);
                let body = bodies[i.min(bodies.len() - 1)];
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        addr
    }

    #[test]
    fn keeps_each_change_with_its_resolution() {
        let addr = admin(vec!["one", "one", "two", "two", "three"]);
        let start = Instant::now();
        let watch = AdminWatch::start(addr, Duration::from_millis(5), None, str::to_owned);
        crate::wait_until(Duration::from_secs(10), "the third state", || {
            watch.first_since(start, |s| s == "three")
        });
        let changes = watch.stop();
        let states: Vec<&str> = changes.iter().map(|c| c.state.as_str()).collect();
        assert_eq!(states, ["one", "two", "three"]);
        assert_eq!(changes[0].resolution, Duration::ZERO);
        assert!(changes[1].resolution > Duration::ZERO);
        assert!(changes.windows(2).all(|w| w[0].at < w[1].at));
    }

    #[test]
    fn says_why_it_could_not_watch() {
        let watch = AdminWatch::start(
            "127.0.0.1:1".parse().unwrap(),
            Duration::from_millis(5),
            Some(Box::new(|| anyhow::bail!("no such host"))),
            str::to_owned,
        );
        crate::wait_until(Duration::from_secs(5), "the error", || watch.error());
        assert_eq!(watch.error().as_deref(), Some("no such host"));
        assert!(watch.stop().is_empty());
    }
}
