//! What the ORCA service tells about its streams: per worker hostname, how many streams Envoy holds
//! open and the last report sent. `peregrine status` shows it.

use std::{collections::BTreeMap, time::SystemTime};

/// One report as sent to Envoy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReportSummary {
    /// `cpu_utilization`.
    pub cpu_utilization: f64,
    /// `application_utilization`.
    pub application_utilization: f64,
    /// `rps_fractional`.
    pub rps_fractional: f64,
    /// When it was sent.
    pub sent_at: SystemTime,
}

/// The ORCA streams of one worker instance.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OrcaStreams {
    /// Streams open now (Envoy holds one per endpoint; more than one while a stream is replaced).
    pub open: u32,
    /// Reports sent over all its streams.
    pub reports: u64,
    /// The last report sent.
    pub last_report: Option<ReportSummary>,
}

/// ORCA stream state by worker hostname.
pub type OrcaByHostname = BTreeMap<String, OrcaStreams>;
