//! In-band ORCA (`orca = "in-band"`): each worker's latest load report, written where the worker
//! reads it without a syscall (the report slot of its own counter region,
//! [`peregrine_contract::report_slot`]), which it sends as the
//! `endpoint-load-metrics-bin` header. Envoy opens no stream per (Envoy, worker): its client-side
//! weighted round robin, with `enable_oob_load_report` off, reads the header instead.
//!
//! Each time the sampler publishes new loads, [`run`] writes every in-band worker's report: the same
//! [`report_for_pid`] the out-of-band streams send, encoded as an `xds.data.orca.v3.OrcaLoadReport`
//! and in base64, ready to send, so that the worker only copies bytes. The services that are in band
//! come from the xDS options (the balancer Envoy is told of, [`OrcaPolicy::in_band`]), so a reload
//! that turns a service in band or out is followed at the next sample; a worker whose service is no
//! longer in band has its slot emptied (it sends no header).
//!
//! The slot is found through the worker's counter region, which the process table holds for every
//! worker, adopted ones included (adoption duplicates the worker's descriptor): after a restart the
//! new supervisor writes the same slots. A worker started by an older supervisor has a region
//! without a slot: it gets no in-band report (Envoy gives it the median weight of its peers).
//!
//! Invariant: writes only report slots of workers that count their own requests (never the shared
//! lanes of passed-socket servers), one writer per slot (this task).

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

use peregrine_contract::{
    report_slot::ReportSlot,
    shm::{Access, ShmError},
};
use prost::Message;
use tokio::sync::watch;

use super::report_for_pid;
use crate::{
    balancer::Balancer,
    children::Children,
    registry::{Loads, Registry},
    xds::XdsOptions,
};

/// Writes in-band reports each time `registry`'s loads change, for the services `options` balance in
/// band, into the slots of `children`'s workers; returns when the registry goes away.
pub async fn run(
    registry: Arc<Registry>,
    children: Arc<Children>,
    mut options: watch::Receiver<XdsOptions>,
) {
    let mut loads = registry.subscribe_loads();
    let mut writer = Writer::default();
    loop {
        let services = in_band_services(&options.borrow_and_update());
        let current = loads.borrow_and_update().clone();
        writer.write(&current, &services, &children);
        tokio::select! {
            changed = loads.changed() => if changed.is_err() { return },
            changed = options.changed() => if changed.is_err() { return },
        }
    }
}

/// The services whose balancer takes in-band reports.
pub fn in_band_services(options: &XdsOptions) -> BTreeSet<String> {
    options
        .balancers
        .iter()
        .filter(|(_, balancer)| matches!(balancer, Balancer::Orca(policy) if policy.in_band))
        .map(|(name, _)| name.clone())
        .collect()
}

/// The report slots mapped so far, by worker pid.
#[derive(Debug, Default)]
pub struct Writer {
    /// `None`: the worker has no slot (it counts no requests of its own, or its region was made by
    /// an older supervisor); not tried again while it lives.
    slots: HashMap<u32, Option<Slot>>,
}

#[derive(Debug)]
struct Slot {
    slot: ReportSlot,
    /// Whether it holds a report now (an emptied slot is not emptied again).
    holds: bool,
}

impl Writer {
    /// Writes the report of every worker of `in_band` services in `loads` that has one, empties the
    /// slots of the others, and forgets the workers that left `loads`. Returns how many reports it
    /// wrote.
    pub fn write(
        &mut self,
        loads: &Loads,
        in_band: &BTreeSet<String>,
        children: &Children,
    ) -> usize {
        self.slots.retain(|pid, _| loads.by_pid(*pid).is_some());
        let mut written = 0;
        for load in loads.iter() {
            let wanted = in_band.contains(&load.service);
            // Every worker's slot is looked at once, in band or not: one left holding a report by an
            // earlier supervisor, or before a reload, is emptied.
            let entry = self
                .slots
                .entry(load.pid)
                .or_insert_with(|| map_slot(children, load.pid));
            let Some(slot) = entry else { continue };
            let report = wanted
                .then(|| report_for_pid(loads, load.pid))
                .flatten()
                .map(|report| base64(&report.encode_to_vec()));
            match report {
                Some(text) => match slot.slot.write(text.as_bytes()) {
                    Ok(()) => {
                        slot.holds = true;
                        written += 1;
                    }
                    Err(error) => {
                        tracing::warn!(pid = load.pid, %error, "Cannot write an in-band ORCA report")
                    }
                },
                // No real sample yet: the slot keeps what it has (nothing, or the last report).
                None if wanted => {}
                None if slot.holds => {
                    let _ = slot.slot.write(b"");
                    slot.holds = false;
                }
                None => {}
            }
        }
        written
    }
}

/// The report slot of worker `pid`, if it counts its own requests in a region that has one.
fn map_slot(children: &Children, pid: u32) -> Option<Slot> {
    let child = children.child(pid).filter(|child| child.counts_requests)?;
    match ReportSlot::map(child.counter.fd(), Access::ReadWrite) {
        Ok(slot) => {
            // A slot left by an earlier supervisor holds a report: it is rewritten or emptied.
            let holds = slot
                .read()
                .is_none_or(|report| !report.as_bytes().is_empty());
            Some(Slot { slot, holds })
        }
        Err(ShmError::TooSmall { .. }) => {
            tracing::info!(pid, slot = %child.slot, "The worker's counter region has no report slot (an older supervisor made it): no in-band ORCA reports for it until it is replaced");
            None
        }
        Err(error) => {
            tracing::warn!(pid, slot = %child.slot, %error, "Cannot map the worker's report slot: no in-band ORCA reports for it");
            None
        }
    }
}

/// `bytes` in standard base64 with padding (RFC 4648), as Envoy decodes a `-bin` header.
pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use std::{os::fd::AsFd, time::SystemTime};

    use peregrine_contract::counters::CounterRegion;
    use peregrine_proto::xds::data::orca::v3::OrcaLoadReport;

    use super::*;
    use crate::{children::Counters, registry::WorkerLoad};

    fn load(service: &str, pid: u32, rps: f64) -> WorkerLoad {
        WorkerLoad {
            service: service.into(),
            index: pid % 10,
            pid,
            cpu_cores: Some(0.5),
            runq_wait_cores: Some(0.25),
            requests_per_second: Some(rps),
            cpu_seconds_total: 1.0,
            runq_wait_seconds_total: 0.0,
            requests_total: 10,
            in_flight: None,
            in_flight_now: None,
            in_flight_utilization: None,
            smoothed: None,
            sampled_at: SystemTime::UNIX_EPOCH,
        }
    }

    /// A worker of `service` with its own region (`with_slot`: as this supervisor makes it; else as
    /// an older one did), and a reader of its slot if it has one.
    fn child(children: &Children, service: &str, pid: u32, with_slot: bool) -> Option<ReportSlot> {
        let (fd, region) = if with_slot {
            peregrine_contract::report_slot::create_worker_region().unwrap()
        } else {
            CounterRegion::create(1).unwrap()
        };
        let reader = ReportSlot::map(fd.as_fd(), Access::ReadOnly).ok();
        let counters = Arc::new(Counters::new(fd, region));
        children.insert_counted_for_test(pid, (service, pid % 10), 0, &counters, true);
        reader
    }

    fn decoded(slot: &ReportSlot) -> Option<OrcaLoadReport> {
        let report = slot.read().unwrap();
        let text = std::str::from_utf8(report.as_bytes()).unwrap();
        (!text.is_empty()).then(|| OrcaLoadReport::decode(unbase64(text).as_slice()).unwrap())
    }

    fn unbase64(text: &str) -> Vec<u8> {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap()
    }

    #[test]
    fn base64_is_rfc_4648_with_padding() {
        for (bytes, text) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg=="),
            (b"fooba", "Zm9vYmE="),
            (b"foobar", "Zm9vYmFy"),
            (&[0xfb, 0xff, 0xbf], "+/+/"),
        ] {
            assert_eq!(base64(bytes), text);
            assert_eq!(unbase64(text), bytes);
        }
    }

    #[test]
    fn in_band_workers_get_the_report_the_stream_would_send() {
        let children = Children::default();
        let web = child(&children, "web", 11, true).unwrap();
        let api = child(&children, "api", 12, true).unwrap();
        let loads = Loads::new(None, vec![load("web", 11, 200.0), load("api", 12, 100.0)]);
        let mut writer = Writer::default();
        let in_band = BTreeSet::from(["web".to_string()]);
        assert_eq!(writer.write(&loads, &in_band, &children), 1);
        assert_eq!(decoded(&web), report_for_pid(&loads, 11));
        let report = decoded(&web).unwrap();
        assert_eq!(report.rps_fractional, 200.0);
        assert!((report.application_utilization - 0.75).abs() < 1e-9);
        assert_eq!(decoded(&api), None, "out of band: no report in the slot");
        // A report of a few fields fits the slot with room to spare.
        let text = base64(&report.encode_to_vec());
        assert!(text.len() <= 48, "{text}");
    }

    #[test]
    fn a_service_taken_out_of_band_has_its_slots_emptied() {
        let children = Children::default();
        let web = child(&children, "web", 11, true).unwrap();
        let loads = Loads::new(None, vec![load("web", 11, 200.0)]);
        let mut writer = Writer::default();
        writer.write(&loads, &BTreeSet::from(["web".into()]), &children);
        assert!(decoded(&web).is_some());
        assert_eq!(writer.write(&loads, &BTreeSet::new(), &children), 0);
        assert_eq!(decoded(&web), None);
    }

    #[test]
    fn an_adopted_worker_with_a_report_left_in_its_slot_is_found_again() {
        let children = Children::default();
        let web = child(&children, "web", 11, true).unwrap();
        let loads = Loads::new(None, vec![load("web", 11, 200.0)]);
        Writer::default().write(&loads, &BTreeSet::from(["web".into()]), &children);
        // A new supervisor (a new writer), the service no longer in band: the old report goes.
        let mut next = Writer::default();
        next.write(&loads, &BTreeSet::new(), &children);
        assert_eq!(decoded(&web), None);
    }

    #[test]
    fn workers_without_a_slot_or_a_sample_are_skipped() {
        let children = Children::default();
        assert!(
            child(&children, "web", 11, false).is_none(),
            "an older region"
        );
        let fresh = child(&children, "web", 12, true).unwrap();
        let baseline = WorkerLoad {
            cpu_cores: None,
            requests_per_second: None,
            ..load("web", 12, 0.0)
        };
        let loads = Loads::new(None, vec![load("web", 11, 200.0), baseline]);
        let mut writer = Writer::default();
        let in_band = BTreeSet::from(["web".to_string()]);
        assert_eq!(writer.write(&loads, &in_band, &children), 0);
        assert_eq!(decoded(&fresh), None);
        // A worker that left the loads is forgotten.
        writer.write(&Loads::new(None, vec![]), &in_band, &children);
        assert!(writer.slots.is_empty());
    }

    #[test]
    fn options_name_the_in_band_services() {
        use crate::balancer::OrcaPolicy;
        let policy = OrcaPolicy {
            port: 1,
            reporting_period: std::time::Duration::from_secs(1),
            blackout_period: std::time::Duration::from_secs(1),
            weight_expiration_period: std::time::Duration::from_secs(3),
            weight_update_period: std::time::Duration::from_secs(1),
            tls: false,
            in_band: false,
        };
        let options = XdsOptions {
            balancers: [
                ("oob".to_string(), Balancer::Orca(policy)),
                (
                    "inband".to_string(),
                    Balancer::Orca(OrcaPolicy {
                        in_band: true,
                        ..policy
                    }),
                ),
                ("rr".to_string(), Balancer::RoundRobin),
            ]
            .into(),
            ..XdsOptions::default()
        };
        assert_eq!(
            in_band_services(&options),
            BTreeSet::from(["inband".to_string()])
        );
    }
}
