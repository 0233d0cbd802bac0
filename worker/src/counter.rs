//! The worker's request counter.
//!
//! One relaxed increment per request, read without locking; a sampler may read it at any time.

use std::sync::atomic::{AtomicU64, Ordering};

static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// How many requests this process has handed to its application so far.
pub fn requests() -> u64 {
    REQUESTS.load(Ordering::Relaxed)
}

/// Counts one request.
pub(crate) fn record_request() {
    REQUESTS.fetch_add(1, Ordering::Relaxed);
}
