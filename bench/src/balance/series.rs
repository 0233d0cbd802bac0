//! The over-time series of every run: what the monitor samples every [`STEP`] (the sampler's figures,
//! ORCA reports, Envoy's weights, the kernel's own schedstat), the requests each worker got per step,
//! and their CSVs and plot.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context;
use peregrine_contract::procfs::{self, Schedstat};
use peregrine_e2e::{hosts, http_get};

use super::{
    Bench, Options, Run, Sample, WorkerInfo, WorkerSample,
    openloop::{Answer, Record},
};
use crate::plot;

/// The step of the over-time series.
pub(super) const STEP: Duration = Duration::from_millis(500);
/// The plotting script.
const PLOT_SCRIPT: &str = include_str!("plot.py");

impl Bench<'_> {
    /// Samples the workers of `service` and Envoy's weights every [`STEP`] from `start` until `stop`.
    pub(super) fn monitor(
        &self,
        service: &str,
        workers: &[WorkerInfo; 2],
        start: Instant,
        stop: &AtomicBool,
    ) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut next = start;
        let mut kernel_before: [Option<(Instant, Schedstat)>; 2] = [None, None];
        while !stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            if next > now {
                thread::sleep((next - now).min(Duration::from_millis(50)));
                continue;
            }
            next += STEP;
            let mut sample = Sample {
                t: now.saturating_duration_since(start),
                workers: [WorkerSample::default(); 2],
            };
            // A sample that cannot be taken stays empty: the run's figures do not depend on it.
            for (i, worker) in workers.iter().enumerate() {
                // Threads that exited are missing from the sum: fine for a check over one step.
                let now = (
                    Instant::now(),
                    procfs::process_schedstat(worker.pid).unwrap_or_default(),
                );
                if let Some((then, before)) = kernel_before[i] {
                    let secs = (now.0 - then).as_secs_f64();
                    sample.workers[i].kernel_cpu =
                        Some(now.1.on_cpu_ns.saturating_sub(before.on_cpu_ns) as f64 / 1e9 / secs);
                    sample.workers[i].kernel_wait = Some(
                        now.1.runq_wait_ns.saturating_sub(before.runq_wait_ns) as f64 / 1e9 / secs,
                    );
                }
                kernel_before[i] = Some(now);
            }
            let status = self.supervisor.status_json().unwrap_or_default();
            for row in status["workers"].as_array().into_iter().flatten() {
                if row["service"] != service {
                    continue;
                }
                let Some(i) = workers
                    .iter()
                    .position(|w| row["pid"].as_u64() == Some(u64::from(w.pid)))
                else {
                    continue;
                };
                let s = &mut sample.workers[i];
                s.cpu = row["cpu_cores"].as_f64();
                s.wait = row["runq_wait_cores"].as_f64();
                s.reported = row["orca_last_report"]["application_utilization"].as_f64();
            }
            let clusters =
                http_get(self.admin, "/clusters").map_or_else(|_| String::new(), |a| a.1);
            for host in hosts(&clusters, service) {
                if let Some(i) = workers.iter().position(|w| w.hostname == host.hostname) {
                    sample.workers[i].weight = Some(host.weight);
                }
            }
            samples.push(sample);
        }
        samples
    }
}

/// Requests per worker per [`STEP`] by send time, over the whole run; `index` names the worker of an
/// answer.
pub(super) fn steps(records: &[Record], index: impl Fn(Answer) -> Option<usize>) -> Vec<[u64; 2]> {
    let steps = (records
        .iter()
        .filter(|r| r.answer != Answer::NotSent)
        .map(|r| r.sent.as_millis() / STEP.as_millis())
        .max()
        .unwrap_or(0)
        + 1) as usize;
    let mut per_step = vec![[0u64; 2]; steps];
    for record in records {
        if let Some(i) = index(record.answer) {
            per_step[(record.sent.as_millis() / STEP.as_millis()) as usize][i] += 1;
        }
    }
    per_step
}

/// Writes the series to `out/balance-requests.csv` and `out/balance-samples.csv` and plots them
/// (a warning when it cannot); returns the two CSVs.
pub(super) fn write(
    out: &Path,
    runs: &[Run],
    options: &Options,
) -> anyhow::Result<(PathBuf, PathBuf)> {
    let (requests_csv, samples_csv) = (
        out.join("balance-requests.csv"),
        out.join("balance-samples.csv"),
    );
    write_csvs(runs, &requests_csv, &samples_csv)?;
    match plot(out, &requests_csv, &samples_csv, options) {
        Ok(png) => eprintln!("plot: {}", png.display()),
        Err(error) => eprintln!("warning: no plot: {error:#}"),
    }
    Ok((requests_csv, samples_csv))
}

/// The requests per step and the monitor's samples of every run, as CSV.
fn write_csvs(runs: &[Run], requests: &Path, samples: &Path) -> anyhow::Result<()> {
    let mut r = String::from("scenario,policy,round,t_s,worker0,worker1\n");
    let mut s = String::from(
        "scenario,policy,round,t_s,cpu0,wait0,reported0,weight0,kcpu0,kwait0,cpu1,wait1,reported1,weight1,kcpu1,kwait1\n",
    );
    let opt = |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_default();
    for run in runs {
        let key = format!(
            "{},{},{}",
            run.scenario.key(),
            run.policy.service(),
            run.round + 1
        );
        for (i, step) in run.steps.iter().enumerate() {
            let t = (STEP * i as u32).as_secs_f64();
            writeln!(r, "{key},{t:.3},{},{}", step[0], step[1])?;
        }
        for sample in &run.samples {
            write!(s, "{key},{:.3}", sample.t.as_secs_f64())?;
            for w in &sample.workers {
                write!(
                    s,
                    ",{},{},{},{},{},{}",
                    opt(w.cpu),
                    opt(w.wait),
                    opt(w.reported),
                    w.weight.map(|v| v.to_string()).unwrap_or_default(),
                    opt(w.kernel_cpu),
                    opt(w.kernel_wait),
                )?;
            }
            s.push('\n');
        }
    }
    std::fs::write(requests, r).with_context(|| format!("writing {}", requests.display()))?;
    std::fs::write(samples, s).with_context(|| format!("writing {}", samples.display()))?;
    Ok(())
}

/// Draws the first round of each scenario into `out/balance.png` with matplotlib.
fn plot(out: &Path, requests: &Path, samples: &Path, options: &Options) -> anyhow::Result<PathBuf> {
    let png = out.join("balance.png");
    plot::run(
        out,
        "balance-plot.py",
        PLOT_SCRIPT,
        [
            requests.as_os_str().to_owned(),
            samples.as_os_str().to_owned(),
            png.as_os_str().to_owned(),
            options.warmup.to_string().into(),
            options.duration.to_string().into(),
        ],
    )?;
    Ok(png)
}
