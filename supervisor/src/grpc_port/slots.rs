//! The gRPC port's connection slots: how many one address may hold, and whose slot a new connection
//! takes when they are all held.
//!
//! Every connection holds a slot from its accept to its close. The port has `cap` slots and one
//! address (an IP; a v4-mapped v6 address counts as the v4 one) may hold `per_peer` of them. A
//! connection is *unproven* until it shows it is a client: its TLS handshake completed with a client
//! certificate the CA signed, or, on a port that asks for none, one of its streams carried a
//! client's request (an xDS request that names a node, an ORCA request for a registered worker:
//! [`super::ClientProof`]; a stream that sends nothing proves nothing). A new
//! connection that finds its address's slots all held takes the slot of that address's oldest
//! unproven connection; one that finds the port's slots all held takes the port's oldest unproven
//! connection's. It is refused only when every slot in question is held by a proven connection.
//!
//! Invariant: a proven connection is never evicted. Whoever cannot complete a handshake (on a
//! mutual TLS port: whoever has no certificate from the CA) can only take slots from others who
//! cannot either, however many connections and addresses it has. On a cleartext port a client's
//! request is the only proof there is, so a local process that sends xDS requests can still hold
//! its address's share.
//!
//! [`Table`] is the bookkeeping alone (a plain value, tested beside it); [`Slots`] shares it between
//! the accept loops and the connections, and tells an evicted connection to close.

use std::{
    collections::{BTreeSet, HashMap},
    future::poll_fn,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use futures::task::AtomicWaker;

/// Which cap a new connection found full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Full {
    /// Its address held `per_peer` slots.
    Peer,
    /// The port held `cap` slots.
    Port,
}

/// A connection evicted to make room for a new one.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Evicted<E> {
    /// What the table was given with the evicted connection (how to tell it to close).
    pub(super) handle: E,
    /// Its address.
    pub(super) peer: IpAddr,
    /// Which cap was full.
    pub(super) full: Full,
}

/// The slots' bookkeeping: who holds them, from which address, in which order, and which are
/// proven. Every operation is a few map updates (`O(log n)`).
#[derive(Debug)]
pub(super) struct Table<E> {
    cap: usize,
    per_peer: usize,
    next_id: u64,
    held: HashMap<u64, Holder<E>>,
    /// The unproven connections' ids; ids grow with time, so the first is the oldest.
    unproven: BTreeSet<u64>,
    peers: HashMap<IpAddr, Peer>,
}

#[derive(Debug)]
struct Holder<E> {
    peer: IpAddr,
    handle: E,
}

/// One address's share: how many slots it holds, and which of them are unproven.
#[derive(Debug, Default)]
struct Peer {
    held: usize,
    unproven: BTreeSet<u64>,
}

// === impl Table ===

impl<E> Table<E> {
    /// A table of `cap` slots, `per_peer` of them at most for one address (both at least 1;
    /// `per_peer` at most `cap`).
    pub(super) fn new(cap: usize, per_peer: usize) -> Self {
        let cap = cap.max(1);
        Table {
            cap,
            per_peer: per_peer.clamp(1, cap),
            next_id: 0,
            held: HashMap::new(),
            unproven: BTreeSet::new(),
            peers: HashMap::new(),
        }
    }

    /// A slot for a new, unproven connection from `peer`, known by `handle`: its id, and the
    /// connection evicted for it if a cap was full; or the cap that is full of proven connections.
    pub(super) fn admit(
        &mut self,
        peer: IpAddr,
        handle: E,
    ) -> Result<(u64, Option<Evicted<E>>), Full> {
        let peer = peer.to_canonical();
        let share = self.peers.get(&peer);
        let evicted = if share.is_some_and(|share| share.held >= self.per_peer) {
            let oldest = share.and_then(|share| share.unproven.first().copied());
            Some(self.evict(oldest.ok_or(Full::Peer)?, Full::Peer))
        } else if self.held.len() >= self.cap {
            let oldest = self.unproven.first().copied();
            Some(self.evict(oldest.ok_or(Full::Port)?, Full::Port))
        } else {
            None
        };
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, Holder { peer, handle });
        self.unproven.insert(id);
        let share = self.peers.entry(peer).or_default();
        share.held += 1;
        share.unproven.insert(id);
        Ok((id, evicted))
    }

    /// Marks connection `id` proven: it is never evicted. Nothing if it is gone.
    pub(super) fn prove(&mut self, id: u64) {
        let Some(holder) = self.held.get(&id) else {
            return;
        };
        self.unproven.remove(&id);
        if let Some(share) = self.peers.get_mut(&holder.peer) {
            share.unproven.remove(&id);
        }
    }

    /// Gives connection `id`'s slot back (it closed). Nothing if it is gone (evicted).
    pub(super) fn release(&mut self, id: u64) -> Option<E> {
        let holder = self.held.remove(&id)?;
        self.unproven.remove(&id);
        if let Some(share) = self.peers.get_mut(&holder.peer) {
            share.held -= 1;
            share.unproven.remove(&id);
            if share.held == 0 {
                self.peers.remove(&holder.peer);
            }
        }
        Some(holder.handle)
    }

    fn evict(&mut self, id: u64, full: Full) -> Evicted<E> {
        let peer = self.held[&id].peer;
        let handle = self.release(id).expect("an unproven id is held");
        Evicted { handle, peer, full }
    }

    /// How many slots are held.
    pub(super) fn held(&self) -> usize {
        self.held.len()
    }

    /// How many slots `peer` holds.
    #[cfg(test)]
    fn held_by(&self, peer: IpAddr) -> usize {
        self.peers
            .get(&peer.to_canonical())
            .map_or(0, |share| share.held)
    }

    /// The port's cap.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// One address's cap.
    pub(super) fn per_peer(&self) -> usize {
        self.per_peer
    }
}

/// Tells a connection it was evicted, and wakes the task that polls it.
#[derive(Debug, Default)]
struct Eviction {
    evicted: AtomicBool,
    waker: AtomicWaker,
}

impl Eviction {
    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.waker.wake();
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.evicted.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        if self.evicted.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// The port's [`Table`], shared by its accept loops and its connections.
#[derive(Debug)]
pub(super) struct Slots {
    table: Mutex<Table<Arc<Eviction>>>,
}

// === impl Slots ===

impl Slots {
    /// `cap` slots, at most `per_peer` for one address (see [`Table::new`]).
    pub(super) fn new(cap: usize, per_peer: usize) -> Arc<Slots> {
        Arc::new(Slots {
            table: Mutex::new(Table::new(cap, per_peer)),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table<Arc<Eviction>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a new connection from `peer` (see [`Table::admit`]); an evicted connection is told
    /// to close, and its address and the cap that was full are returned.
    pub(super) fn take(
        self: &Arc<Self>,
        peer: SocketAddr,
    ) -> Result<(Slot, Option<(IpAddr, Full)>), Full> {
        let eviction = Arc::new(Eviction::default());
        let (id, evicted) = self.table().admit(peer.ip(), eviction.clone())?;
        let evicted = evicted.map(|evicted| {
            evicted.handle.evict();
            (evicted.peer, evicted.full)
        });
        let slot = Slot {
            id,
            slots: self.clone(),
            eviction,
        };
        Ok((slot, evicted))
    }

    /// How many slots are held.
    pub(super) fn held(&self) -> usize {
        self.table().held()
    }

    /// The port's cap.
    pub(super) fn cap(&self) -> usize {
        self.table().cap()
    }

    /// One address's cap.
    pub(super) fn per_peer(&self) -> usize {
        self.table().per_peer()
    }
}

/// One connection's slot, given back when it is dropped.
#[derive(Debug)]
pub(super) struct Slot {
    id: u64,
    slots: Arc<Slots>,
    eviction: Arc<Eviction>,
}

// === impl Slot ===

impl Slot {
    /// A handle that marks this connection proven (it may outlive the slot: then it does nothing).
    pub(super) fn prover(&self) -> Prover {
        Prover {
            id: self.id,
            slots: self.slots.clone(),
        }
    }

    /// Ready once the slot was given to a newer connection: the connection must close. Registers
    /// the waker of the one task that polls it.
    pub(super) fn poll_evicted(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.eviction.poll(cx)
    }

    /// Completes once the slot was given to a newer connection.
    pub(super) async fn evicted(&self) {
        poll_fn(|cx| self.poll_evicted(cx)).await
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.table().release(self.id);
    }
}

/// Marks a connection proven: see [`Slot::prover`].
#[derive(Clone, Debug)]
pub(super) struct Prover {
    id: u64,
    slots: Arc<Slots>,
}

impl Prover {
    /// The connection showed it is a client: it is never evicted.
    pub(super) fn prove(&self) {
        self.slots.table().prove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv6Addr, task::Waker};

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn one_address_takes_its_own_oldest_unproven_slot_and_no_more() {
        let mut table = Table::new(10, 3);
        let ids: Vec<u64> = (0..3)
            .map(|n| table.admit(ip(2), n).unwrap())
            .map(|(id, evicted)| {
                assert_eq!(evicted, None);
                id
            })
            .collect();
        // The fourth from the same address takes the first's slot.
        let (_, evicted) = table.admit(ip(2), 3).unwrap();
        assert_eq!(
            evicted,
            Some(Evicted {
                handle: 0,
                peer: ip(2),
                full: Full::Peer
            })
        );
        assert_eq!((table.held_by(ip(2)), table.held()), (3, 3));
        // Another address is not held back.
        assert_eq!(table.admit(ip(3), 10).unwrap().1, None);
        // Once its connections are proven, the address is refused rather than evicting them.
        let (fifth, _) = table.admit(ip(2), 4).unwrap();
        table.prove(ids[2]);
        let (sixth, evicted) = table.admit(ip(2), 5).unwrap();
        assert_eq!(evicted.map(|e| e.handle), Some(3));
        table.prove(fifth);
        table.prove(sixth);
        assert_eq!(table.admit(ip(2), 6), Err(Full::Peer));
        assert_eq!(table.held_by(ip(2)), 3);
        // A closed one makes room again.
        assert_eq!(table.release(fifth), Some(4));
        assert_eq!(table.admit(ip(2), 7).unwrap().1, None);
    }

    #[test]
    fn a_full_port_evicts_its_oldest_unproven_connection_and_never_a_proven_one() {
        let mut table = Table::new(4, 4);
        let (proven, _) = table.admit(ip(1), "client").unwrap();
        table.prove(proven);
        for (n, name) in ["a", "b", "c"].into_iter().enumerate() {
            table.admit(ip(10 + n as u8), name).unwrap();
        }
        assert_eq!(table.held(), 4);
        // New connections take the unproven ones' slots, oldest first, whatever their address.
        for (name, gone) in [("d", "a"), ("e", "b"), ("f", "c"), ("g", "d")] {
            let (_, evicted) = table.admit(ip(20), name).unwrap();
            let evicted = evicted.unwrap();
            assert_eq!((evicted.handle, evicted.full), (gone, Full::Port));
        }
        assert_eq!(table.held(), 4);
        // The proven client's slot is never taken: with every slot proven, the next is refused.
        let ids: Vec<u64> = (0..3)
            .map(|_| {
                let (id, evicted) = table.admit(ip(1), "client").unwrap();
                assert_ne!(evicted.map(|e| e.handle), Some("client"));
                table.prove(id);
                id
            })
            .collect();
        assert_eq!(table.admit(ip(30), "h"), Err(Full::Port));
        assert_eq!(table.release(ids[0]), Some("client"));
        assert!(table.admit(ip(30), "h").is_ok());
    }

    #[test]
    fn an_evicted_or_closed_connection_leaves_nothing_behind() {
        let mut table = Table::new(2, 1);
        let (first, _) = table.admit(ip(2), 1).unwrap();
        let (second, evicted) = table.admit(ip(2), 2).unwrap();
        assert_eq!(evicted.map(|e| e.handle), Some(1));
        // The evicted one closes later: its release and its proof change nothing.
        table.prove(first);
        assert_eq!(table.release(first), None);
        assert_eq!(table.held(), 1);
        assert_eq!(table.release(second), Some(2));
        assert_eq!(table.held(), 0);
        assert!(table.peers.is_empty() && table.unproven.is_empty());
        // A v4-mapped v6 address is its v4 address.
        let mapped = IpAddr::from(Ipv6Addr::from(0xffff_7f00_0002_u128));
        table.admit(ip(2), 3).unwrap();
        assert_eq!(table.admit(mapped, 4).unwrap().1.map(|e| e.handle), Some(3));
    }

    #[test]
    fn the_caps_are_at_least_one_and_the_address_cap_at_most_the_port_cap() {
        let table = Table::<()>::new(0, 0);
        assert_eq!((table.cap(), table.per_peer()), (1, 1));
        let table = Table::<()>::new(16, 1024);
        assert_eq!((table.cap(), table.per_peer()), (16, 16));
    }

    #[test]
    fn an_evicted_slot_wakes_its_connection_and_a_dropped_one_is_given_back() {
        let slots = Slots::new(1, 1);
        let peer = SocketAddr::from(([127, 0, 0, 2], 1));
        let (first, evicted) = slots.take(peer).unwrap();
        assert_eq!(evicted, None);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(first.poll_evicted(&mut cx).is_pending());
        let (second, evicted) = slots.take(peer).unwrap();
        assert_eq!(evicted, Some((peer.ip(), Full::Peer)));
        assert!(first.poll_evicted(&mut cx).is_ready());
        drop(first);
        assert_eq!(
            slots.held(),
            1,
            "the evicted slot was the new one's already"
        );
        second.prover().prove();
        assert_eq!(slots.take(peer).unwrap_err(), Full::Peer);
        drop(second);
        assert_eq!(slots.held(), 0);
    }
}
