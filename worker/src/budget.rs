//! Bounds on the request-body bytes a worker buffers, and giving their memory back.
//!
//! A [`Budget`] is a number of bytes shared by everyone who charges it: one for the whole worker, and,
//! for an HTTP/2 connection, one per connection whose parent is the worker's. A [`Charge`] is what one
//! request (or one HTTP/1 connection's input buffer) holds of a budget; it grows only when every budget
//! up the chain has room, and gives everything back when it is dropped, however the request ends.
//!
//! Freed buffers only lower the process's resident memory if the allocator returns them to the system.
//! glibc's malloc serves allocations above its mmap threshold with `mmap` and unmaps them on free, but it
//! raises that threshold (up to 32 MiB) each time such a chunk is freed, after which buffers of a request
//! body's size come from the heap, whose freed pages it keeps. [`return_large_frees`] pins the
//! threshold, so every large buffer is its own mapping and is returned when freed.
//!
//! Architecture Invariant: knows nothing of HTTP; the protocol modules decide what to charge and when.

use std::{cell::Cell, rc::Rc};

/// A number of bytes that charges may hold together; optionally within a parent budget.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: usize,
    used: Cell<usize>,
    parent: Option<Rc<Budget>>,
}

// === impl Budget ===

impl Budget {
    /// A budget of `limit` bytes, within `parent` if given.
    pub(crate) fn new(limit: usize, parent: Option<Rc<Budget>>) -> Rc<Self> {
        Rc::new(Budget {
            limit,
            used: Cell::new(0),
            parent,
        })
    }

    /// The bytes charged now.
    pub(crate) fn used(&self) -> usize {
        self.used.get()
    }

    /// Takes `n` bytes if this budget and every parent have room; else takes nothing.
    fn try_take(&self, n: usize) -> bool {
        let used = self.used.get();
        if used.saturating_add(n) > self.limit {
            return false;
        }
        if let Some(parent) = &self.parent
            && !parent.try_take(n)
        {
            return false;
        }
        self.used.set(used + n);
        true
    }

    fn give(&self, n: usize) {
        self.used.set(self.used.get() - n);
        if let Some(parent) = &self.parent {
            parent.give(n);
        }
    }
}

/// Bytes held of a [`Budget`], given back on drop.
#[derive(Debug)]
pub(crate) struct Charge {
    budget: Rc<Budget>,
    held: usize,
}

// === impl Charge ===

impl Charge {
    /// A charge holding nothing yet.
    pub(crate) fn new(budget: &Rc<Budget>) -> Self {
        Charge {
            budget: budget.clone(),
            held: 0,
        }
    }

    /// The bytes held.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// Holds `n` more bytes; `false` (holding what it held) when a budget has no room.
    pub(crate) fn grow(&mut self, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        if !self.budget.try_take(n) {
            return false;
        }
        self.held += n;
        true
    }

    /// Holds exactly `total` bytes: giving back always succeeds, growing as [`Charge::grow`].
    pub(crate) fn set(&mut self, total: usize) -> bool {
        if total <= self.held {
            self.budget.give(self.held - total);
            self.held = total;
            true
        } else {
            self.grow(total - self.held)
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.give(self.held);
    }
}

/// Makes the allocator return every large buffer to the system when it is freed (see the module docs).
///
/// Process-wide and idempotent; does nothing but on glibc.
pub(crate) fn return_large_frees() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(glibc::pin_mmap_threshold);
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(
    unsafe_code,
    reason = "calls glibc's mallopt; the one use has a SAFETY line"
)]
mod glibc {
    use std::ffi::c_int;

    /// `M_MMAP_THRESHOLD` in glibc's `malloc.h`.
    const M_MMAP_THRESHOLD: c_int = -3;
    /// Allocations from this size on are mapped on their own (glibc's initial threshold, 128 KiB).
    const THRESHOLD: c_int = 128 * 1024;

    unsafe extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }

    pub(super) fn pin_mmap_threshold() {
        // SAFETY: mallopt takes two integers and only changes malloc's tuning; setting the threshold
        // explicitly also turns off its dynamic adjustment, which is the point.
        let ok = unsafe { mallopt(M_MMAP_THRESHOLD, THRESHOLD) };
        if ok != 1 {
            tracing::debug!("mallopt(M_MMAP_THRESHOLD) failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_grows_only_within_every_budget_and_gives_back_on_drop() {
        let worker = Budget::new(100, None);
        let conn = Budget::new(60, Some(worker.clone()));
        let mut a = Charge::new(&conn);
        assert!(a.grow(50));
        assert!(!a.grow(20), "over the connection's budget");
        assert_eq!((a.held(), conn.used(), worker.used()), (50, 50, 50));
        let mut b = Charge::new(&worker);
        assert!(!b.grow(51), "over the worker's budget");
        assert!(b.grow(50));
        assert!(!a.set(60), "the worker is full");
        assert!(a.set(10), "giving back always works");
        assert_eq!(worker.used(), 60);
        drop(b);
        drop(a);
        assert_eq!((conn.used(), worker.used()), (0, 0));
    }
}
