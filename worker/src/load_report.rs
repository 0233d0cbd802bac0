//! In-band ORCA: the worker's latest load report, attached to every response as the
//! `endpoint-load-metrics-bin` header, which Envoy's client-side weighted round robin reads when the
//! service's `orca = "in-band"`.
//!
//! The supervisor writes the report, ready to send (the base64 text of an
//! `xds.data.orca.v3.OrcaLoadReport`), into the report slot of the worker's own counter region
//! ([`peregrine_contract::report_slot`]) each time its sampler publishes new loads; the worker maps
//! the slot once ([`attach`], beside its counter) and copies nothing but the header per response.
//!
//! Per response: one atomic load of the slot's sequence; while it is the one this thread last read,
//! the cached header value is handed out again (a reference count, no allocation, no syscall). A new
//! report is copied out of the slot once per thread (a seqlock read, and one allocation for the
//! value).
//!
//! No slot (a supervisor of an older version, a worker without a counter region) or an empty one
//! (the service is not in-band): no header.

use std::{cell::RefCell, os::fd::BorrowedFd, sync::OnceLock};

use http::{HeaderName, HeaderValue};
use peregrine_contract::{
    report_slot::ReportSlot,
    shm::{Access, ShmError},
};

/// The header Envoy reads a binary ORCA report from.
pub(crate) const LOAD_METRICS_HEADER: HeaderName =
    HeaderName::from_static("endpoint-load-metrics-bin");

/// The slot this worker reads its report from, once [`attach`] found one.
static SLOT: OnceLock<ReportSlot> = OnceLock::new();

/// The header value of the report a thread last read, and the slot sequence it was read under.
struct Cached {
    sequence: u64,
    value: Option<HeaderValue>,
}

thread_local! {
    static CACHED: RefCell<Cached> = const {
        // An odd sequence: never the sequence of a whole report, so the first call reads the slot.
        RefCell::new(Cached { sequence: u64::MAX, value: None })
    };
}

/// Maps the report slot of the worker region behind `fd`, if it has one; `Ok(false)` when it has
/// none (a region made by an older supervisor).
pub(crate) fn attach(fd: BorrowedFd<'_>) -> Result<bool, ShmError> {
    match ReportSlot::map(fd, Access::ReadOnly) {
        Ok(slot) => Ok(SLOT.set(slot).is_ok()),
        Err(ShmError::TooSmall { .. }) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Calls `f` with the header value of the latest report, or `None` when there is none.
pub(crate) fn with_header<R>(f: impl FnOnce(Option<&HeaderValue>) -> R) -> R {
    match SLOT.get() {
        None => f(None),
        Some(slot) => CACHED.with(|cached| latest(slot, &mut cached.borrow_mut(), f)),
    }
}

/// The header value of the latest report, or `None` when there is none.
pub(crate) fn header() -> Option<HeaderValue> {
    with_header(|value| value.cloned())
}

/// Calls `f` with the header value of `slot`'s report, read again into `cached` only when the slot's
/// sequence moved.
fn latest<R>(
    slot: &ReportSlot,
    cached: &mut Cached,
    f: impl FnOnce(Option<&HeaderValue>) -> R,
) -> R {
    let sequence = slot.sequence();
    if cached.sequence != sequence
        && let Some(report) = slot.read()
    {
        // A value that is no header (the slot holds base64 text, so never) counts as none.
        cached.value = Some(report.as_bytes())
            .filter(|bytes| !bytes.is_empty())
            .and_then(|bytes| HeaderValue::from_bytes(bytes).ok())
            .map(|mut value| {
                // Never indexed by HPACK: every report is a new value under the same name, and h2
                // walks all of a name's values left in its dynamic table (some 40 stale reports)
                // on every response before it finds the current one.
                value.set_sensitive(true);
                value
            });
        cached.sequence = report.sequence;
    }
    // While a report is being written the last whole one is sent again: it is at most one sample
    // old.
    f(cached.value.as_ref())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use peregrine_contract::counters::CounterRegion;

    use super::*;

    #[test]
    fn the_header_follows_the_slot() {
        let (fd, _counters) = CounterRegion::create_for_worker().unwrap();
        let writer = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        let reader = ReportSlot::map(fd.as_fd(), Access::ReadOnly).unwrap();
        let mut cached = Cached {
            sequence: u64::MAX,
            value: None,
        };
        let mut header = || latest(&reader, &mut cached, |value| value.cloned());
        assert_eq!(header(), None);
        writer.write(b"CQAAAAAAAOA/").unwrap();
        assert_eq!(header().unwrap(), "CQAAAAAAAOA/");
        assert_eq!(header().unwrap(), "CQAAAAAAAOA/", "from the cache");
        writer.write(b"MQAAAAAAAFlA").unwrap();
        assert_eq!(header().unwrap(), "MQAAAAAAAFlA");
        writer.write(b"").unwrap();
        assert_eq!(header(), None);
    }

    #[test]
    fn a_region_without_a_slot_attaches_none() {
        let (fd, _counters) = CounterRegion::create(1).unwrap();
        assert!(!attach(fd.as_fd()).unwrap());
    }
}
