//! Connections that have not sent their first message yet, per socket: at most [`PENDING_CAP`] of
//! them; a new connection takes the place of the oldest, which is closed.
//!
//! A worker sends its registration as soon as it connects, so its connection is pending for as long
//! as the supervisor takes to read it. A peer that connects and sends nothing would otherwise hold a
//! descriptor until the first message's deadline, and a loop of such connections every descriptor
//! the supervisor has. With the cap, whoever holds silent connections holds at most this many of one
//! socket's, and never keeps a new connection out.
//!
//! Invariant: a socket holds at most [`PENDING_CAP`] connections that sent no message yet; a new
//! one is always accepted.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
};

use tokio::sync::Notify;

/// How many connections of one socket may wait for their first message at once.
pub(super) const PENDING_CAP: usize = 64;

/// One socket's pending connections, oldest first.
#[derive(Debug)]
pub(super) struct Pending {
    cap: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    queue: VecDeque<(u64, Arc<Notify>)>,
}

/// A pending connection's place; given back when dropped (its first message read, or it closed).
#[derive(Debug)]
pub(super) struct Ticket {
    id: u64,
    evicted: Arc<Notify>,
    pending: Arc<Pending>,
}

// === impl Pending ===

impl Pending {
    /// At most `cap` (at least 1) pending connections.
    pub(super) fn new(cap: usize) -> Arc<Self> {
        Arc::new(Pending {
            cap: cap.max(1),
            state: Mutex::new(State::default()),
        })
    }

    /// A place for a new connection; `true` beside it when the oldest one was told to close to make
    /// room.
    pub(super) fn enter(self: &Arc<Self>) -> (Ticket, bool) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut evicted_one = false;
        while state.queue.len() >= self.cap {
            if let Some((_, oldest)) = state.queue.pop_front() {
                // Stored if its connection is not waiting yet: it closes as soon as it does.
                oldest.notify_one();
                evicted_one = true;
            }
        }
        let id = state.next;
        state.next += 1;
        let evicted = Arc::new(Notify::new());
        state.queue.push_back((id, evicted.clone()));
        let ticket = Ticket {
            id,
            evicted,
            pending: self.clone(),
        };
        (ticket, evicted_one)
    }

    /// How many connections are pending.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .queue
            .len()
    }
}

// === impl Ticket ===

impl Ticket {
    /// Completes once a newer connection has taken this one's place.
    pub(super) async fn evicted(&self) {
        self.evicted.notified().await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.pending.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = state.queue.iter().position(|(id, _)| *id == self.id) {
            state.queue.remove(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_new_connection_takes_the_place_of_the_oldest_pending_one() {
        let pending = Pending::new(2);
        let (first, evicted) = pending.enter();
        assert!(!evicted);
        let (second, evicted) = pending.enter();
        assert!(!evicted);
        let (third, evicted) = pending.enter();
        assert!(evicted, "the cap was reached");
        assert_eq!(pending.len(), 2);
        tokio::time::timeout(Duration::from_secs(1), first.evicted())
            .await
            .expect("the oldest is told to close");
        let not_yet = tokio::time::timeout(Duration::from_millis(20), second.evicted()).await;
        assert!(not_yet.is_err(), "the second keeps its place");
        // One that read its first message gives its place back: no one is evicted for the next.
        drop(second);
        let (_fourth, evicted) = pending.enter();
        assert!(!evicted);
        drop(first);
        assert_eq!(pending.len(), 2);
        drop(third);
        assert_eq!(pending.len(), 1);
    }
}
