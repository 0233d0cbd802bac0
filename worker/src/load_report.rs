//! In-band ORCA: the worker's latest load report, attached to responses as the
//! `endpoint-load-metrics-bin` header, which Envoy's client-side weighted round robin reads when the
//! service's `orca = "in-band"`.
//!
//! The supervisor writes the report, ready to send (the base64 text of an
//! `xds.data.orca.v3.OrcaLoadReport`), into the report slot of the worker's own counter region
//! ([`peregrine_contract::report_slot`]) each time its sampler publishes new loads; the worker maps
//! the slot once ([`attach`], beside its counter) and copies nothing but the header per response.
//!
//! Each connection carries each report once: on its first response after the supervisor wrote it
//! ([`Carried`]). The supervisor writes every in-band worker's report at each sample (every 200 ms
//! by default) whether or not it changed, so a connection that serves carries one at least that
//! often, and Envoy, which keeps a host's last reported weight until it expires (Envoy's
//! `weight_expiration_period`), holds the latest report as if every response carried it. Sending it
//! on every response cost `h2`'s HPACK encoder about 0.4 us per h2c response (a never-indexed,
//! Huffman-coded literal of some 60 bytes); the rest of a connection's responses now cost one atomic
//! load and a comparison.
//!
//! Per response: one atomic load of the slot's sequence; while it is the one this thread last read,
//! the cached header value is handed out again (a reference count, no allocation, no syscall). A new
//! report is copied out of the slot once per thread (a seqlock read, and one allocation for the
//! value).
//!
//! No slot (a supervisor of an older version, a worker without a counter region) or an empty one
//! (the service is not in-band): no header.

use std::{
    cell::{Cell, RefCell},
    os::fd::BorrowedFd,
    sync::OnceLock,
};

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

impl Cached {
    /// Nothing read yet: an odd sequence, never that of a whole report, so the first look reads
    /// the slot.
    const NONE: Cached = Cached {
        sequence: u64::MAX,
        value: None,
    };
}

thread_local! {
    static CACHED: RefCell<Cached> = const { RefCell::new(Cached::NONE) };
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

/// Which report a connection last carried (the slot sequence it was read under).
#[derive(Debug)]
pub(crate) struct Carried(Cell<u64>);

impl Default for Carried {
    fn default() -> Self {
        // Odd: never the sequence of a whole report.
        Carried(Cell::new(u64::MAX))
    }
}

/// Calls `f` with the header value of the latest report if the connection of `carried` has not
/// carried it yet, and counts it carried; with `None` when it has, or when there is no report.
pub(crate) fn with_new_header<R>(
    carried: &Carried,
    f: impl FnOnce(Option<&HeaderValue>) -> R,
) -> R {
    match SLOT.get() {
        None => f(None),
        Some(slot) => CACHED.with(|cached| {
            let cached = &mut cached.borrow_mut();
            refresh(slot, cached);
            f(new_for(carried, cached))
        }),
    }
}

/// The header value of the latest report if the connection of `carried` has not carried it yet.
pub(crate) fn new_header(carried: &Carried) -> Option<HeaderValue> {
    with_new_header(carried, |value| value.cloned())
}

/// `cached`'s report, unless `carried` already holds its sequence (or there is none); counts it
/// carried.
fn new_for<'a>(carried: &Carried, cached: &'a Cached) -> Option<&'a HeaderValue> {
    let value = cached.value.as_ref()?;
    (carried.0.replace(cached.sequence) != cached.sequence).then_some(value)
}

/// Reads `slot`'s report into `cached` when the slot's sequence moved. While a report is being
/// written the last whole one stays: it is at most one sample old.
fn refresh(slot: &ReportSlot, cached: &mut Cached) {
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
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use peregrine_contract::counters::CounterRegion;

    use super::*;

    /// A worker's region, its slot as the supervisor writes it and as the worker reads it.
    fn slot() -> (CounterRegion, ReportSlot, ReportSlot) {
        let (fd, counters) = peregrine_contract::report_slot::create_worker_region().unwrap();
        let writer = ReportSlot::map(fd.as_fd(), Access::ReadWrite).unwrap();
        let reader = ReportSlot::map(fd.as_fd(), Access::ReadOnly).unwrap();
        (counters, writer, reader)
    }

    #[test]
    fn the_header_follows_the_slot() {
        let (_counters, writer, reader) = slot();
        let mut cached = Cached::NONE;
        let mut header = || {
            refresh(&reader, &mut cached);
            cached.value.clone()
        };
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
    fn a_connection_carries_each_report_once() {
        let (_counters, writer, reader) = slot();
        let mut cached = Cached::NONE;
        let (one, two) = (Carried::default(), Carried::default());
        let mut carries = |carried: &Carried| {
            refresh(&reader, &mut cached);
            new_for(carried, &cached).cloned()
        };
        assert_eq!(carries(&one), None, "no report yet");
        writer.write(b"CQAAAAAAAOA/").unwrap();
        assert_eq!(carries(&one).unwrap(), "CQAAAAAAAOA/");
        assert_eq!(carries(&one), None, "carried already");
        assert_eq!(carries(&two).unwrap(), "CQAAAAAAAOA/", "each connection");
        // The same report written again (the next sample) is carried again.
        writer.write(b"CQAAAAAAAOA/").unwrap();
        assert_eq!(carries(&one).unwrap(), "CQAAAAAAAOA/");
        writer.write(b"").unwrap();
        assert_eq!(carries(&two), None, "an emptied slot");
        writer.write(b"MQAAAAAAAFlA").unwrap();
        assert_eq!(carries(&two).unwrap(), "MQAAAAAAAFlA");
    }

    #[test]
    fn a_region_without_a_slot_attaches_none() {
        let (fd, _counters) = CounterRegion::create(1).unwrap();
        assert!(!attach(fd.as_fd()).unwrap());
    }
}
