//! The demo's load steering: the two workers pinned to cores of their own, steady CPU-heavy load
//! through Envoy, then a CPU hog beside worker 0 and, later, no hog again. A timeline printed as it
//! happens shows, every [`TICK`], Envoy's weight for each worker (admin `/clusters`) and how many
//! requests each answered (by the worker's pid in the answers); a one-line conclusion gives worker
//! 0's share of the answers before, during and after the hog and how soon it moved.
//!
//! Nothing here fails the demo for a machine that is busy: other processes may take the cores the
//! workers were pinned to, which blurs the shift. The conclusion says what it measured and how much
//! of the machine other processes took meanwhile ([`procfs::Busy`]), and calls the cores not idle
//! beyond [`MAX_OTHERS`]. A failed request does fail it, as everywhere in the demo.
//!
//! Everything is bounded: the load by [`LOAD_LIMIT`] (and stopped after the timeline), the timeline
//! by its ticks. The hog is a thread of this process pinned to worker 0's core ([`Hog`]), stopped
//! when dropped, so it cannot outlive the demo however the demo ends.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use peregrine_contract::procfs::Busy;
use peregrine_e2e::{
    Envoy, Load, LoadOptions, Supervisor,
    cpus::{MAX_OTHERS, allowed_cpus, pin_threads},
    hosts, try_wait_until,
};

use super::{CLUSTER, CONVERGE, WORKERS};

/// CPU each request asks of its worker (`GET /?cpu=MS`): enough that a worker sharing its core
/// with the hog takes several times as long per request.
const CPU_MS: u64 = 2;
/// HTTP/1.1 keep-alive clients, one request after another.
const CLIENTS: usize = 8;
/// Each client's pause after each answer: 8 clients make about 330 requests a second, about 0.75
/// of a core of the workers' CPU in all (measured, debug build), well within the two cores. The
/// load is bounded by [`LOAD_LIMIT`]: at most 8 requests in flight, for at most a minute.
const PAUSE: Duration = Duration::from_millis(20);
/// The load stops by itself after this long, should the demo not stop it first.
const LOAD_LIMIT: Duration = Duration::from_secs(60);
/// The load runs this long before the timeline, for Envoy's weights to follow the pinning.
const WARM_UP: Duration = Duration::from_secs(1);
/// One line of the timeline.
const TICK: Duration = Duration::from_millis(250);
/// Ticks before the hog, with it, and after it.
const BEFORE: u32 = 6;
const HOGGED: u32 = 12;
const AFTER: u32 = 12;
/// The first ticks of a phase that its level leaves out: the time the weights take to move.
const SETTLING: u32 = 4;
/// The least change of worker 0's share that the conclusion calls a shift.
const CLEAR: f64 = 0.08;
/// Busy threads of the hog: a neighbour that wants more than the core, as a noisy one does, so
/// worker 0 gets about a quarter of its core while the hog runs.
const HOG_THREADS: usize = 3;
/// Timelines at most: a second one only when other processes kept the cores busy during the first
/// and it showed no clear shift.
const ATTEMPTS: u32 = 2;
/// The longest the demo waits for other processes to leave the cores idle before the timeline.
const IDLE_WAIT: Duration = Duration::from_secs(10);

/// One line of the timeline: when it ended, whether the hog ran, Envoy's weights and the answers
/// of each worker in the window.
#[derive(Clone, Copy, Debug)]
struct Tick {
    at: Duration,
    hog: bool,
    weights: [Option<u64>; 2],
    answers: [u64; 2],
}

/// A worker of the demo's service, by index.
#[derive(Clone, Debug)]
struct Worker {
    pid: u32,
    hostname: String,
}

/// Pins the workers, loads them, and prints the timeline of a hog that comes and goes, then the
/// conclusion. Prints the `peregrine status` table (with its `sampler:` line) under load in any case.
pub(super) fn show(
    supervisor: &mut Supervisor,
    envoy: &mut Envoy,
    listener: SocketAddr,
) -> anyhow::Result<()> {
    let cpus = allowed_cpus(0).context("reading the CPUs this process may use")?;
    let workers = workers(supervisor)?;
    let steer = if cpus.len() < WORKERS {
        println!(
            "\nthis process may use CPU {cpus:?} only: the workers cannot have a core each, so no \
             hog is started"
        );
        false
    } else {
        match pin(&workers, &cpus) {
            Ok(pinned) => {
                println!("\npinned {pinned}");
                idle_cores();
                true
            }
            Err(error) => {
                println!("\nthe workers could not be pinned, so no hog is started: {error:#}");
                false
            }
        }
    };
    println!(
        "loading the workers through Envoy: {CLIENTS} HTTP/1.1 clients send `GET /?cpu={CPU_MS}` \
         ({CPU_MS} ms of a worker's CPU each), one after another with {PAUSE:?} pauses"
    );
    let load = Load::start_with(
        listener,
        LoadOptions {
            pause: PAUSE,
            path: format!("/?cpu={CPU_MS}"),
            ..LoadOptions::new(CLIENTS, 0, LOAD_LIMIT)
        },
    );
    let warmed = Instant::now();
    let table = try_wait_until(CONVERGE, "ORCA weights for both workers", || {
        let weighted = weights(envoy, &workers)
            .iter()
            .all(|w| w.is_some_and(|w| w > 1));
        let reported = supervisor.status_json().ok().is_some_and(|status| {
            status["workers"].as_array().is_some_and(|rows| {
                rows.len() == WORKERS
                    && rows.iter().all(|row| {
                        row["orca_last_report"]["rps_fractional"]
                            .as_f64()
                            .is_some_and(|rps| rps > 1.0)
                    })
            })
        });
        (weighted && reported && warmed.elapsed() >= WARM_UP)
            .then(|| supervisor.status_table().ok())
            .flatten()
    })?;
    println!(
        "\n`peregrine status` under this load; each worker's sampled load goes to Envoy over ORCA:\n{}",
        table.trim_end()
    );

    if !steer {
        return stop(load).map(|_| ());
    }
    for attempt in 1..=ATTEMPTS {
        let before = Busy::now_for_this_tree().ok();
        let (ticks, hogged_status) = timeline((supervisor, envoy, &load), &workers, cpus[0])?;
        let others = before
            .and_then(|before| Some(Busy::now_for_this_tree().ok()?.since(before).1))
            .unwrap_or(0.0);
        if let Some(table) = hogged_status {
            println!(
                "\n`peregrine status` just before the hog stopped (RUNQ WAIT: the time a worker \
                 waited for its core, which its ORCA reports count as busy):\n{}",
                table.trim_end()
            );
        }
        let (line, clear) = conclusion(&ticks, others);
        println!("\n{line}");
        if clear || others <= MAX_OTHERS || attempt == ATTEMPTS {
            break;
        }
        println!("\nonce more, as other processes kept the cores busy");
        idle_cores();
    }
    stop(load).map(|_| ())
}

/// Pins worker `i` to `cpus[i]`, every thread of it; says what it pinned.
fn pin(workers: &[Worker], cpus: &[usize]) -> anyhow::Result<String> {
    let mut pinned = Vec::new();
    for (index, (worker, cpu)) in workers.iter().zip(cpus).enumerate() {
        let threads = pin_threads(worker.pid, *cpu)
            .with_context(|| format!("pinning worker {index} (pid {})", worker.pid))?;
        pinned.push(format!(
            "worker {index} (pid {}, {threads} thread{}) to CPU {cpu}",
            worker.pid,
            if threads == 1 { "" } else { "s" },
        ));
    }
    Ok(pinned.join(", "))
}

/// Waits up to [`IDLE_WAIT`] for a second in which other processes take at most [`MAX_OTHERS`]
/// cores, and says what it found: on a busy machine the demo goes on, and its figures are blurred.
fn idle_cores() {
    let started = Instant::now();
    let mut others = f64::NAN;
    while started.elapsed() < IDLE_WAIT {
        let Ok(before) = Busy::now_for_this_tree() else {
            return;
        };
        thread::sleep(Duration::from_secs(1));
        let Ok(now) = Busy::now_for_this_tree() else {
            return;
        };
        others = now.since(before).1;
        if others <= MAX_OTHERS {
            println!("the cores are idle: other processes use {others:.2} cores");
            return;
        }
    }
    println!(
        "other processes kept {others:.2} cores busy for {IDLE_WAIT:?}: going on, on cores that are \
         not idle"
    );
}

/// The demo service's workers by index, from `peregrine status --json`.
fn workers(supervisor: &Supervisor) -> anyhow::Result<Vec<Worker>> {
    let status = supervisor.status_json()?;
    let mut rows: Vec<(u64, Worker)> = status["workers"]
        .as_array()
        .with_context(|| format!("no workers in {status}"))?
        .iter()
        .filter_map(|row| {
            Some((
                row["index"].as_u64()?,
                Worker {
                    pid: u32::try_from(row["pid"].as_u64()?).ok()?,
                    hostname: row["hostname"].as_str()?.to_owned(),
                },
            ))
        })
        .collect();
    rows.sort_by_key(|(index, _)| *index);
    if rows.len() != WORKERS {
        bail!("expected {WORKERS} workers in {status}");
    }
    Ok(rows.into_iter().map(|(_, worker)| worker).collect())
}

/// Envoy's weight for each worker, `None` where Envoy does not list it.
fn weights(envoy: &Envoy, workers: &[Worker]) -> [Option<u64>; 2] {
    let hosts = envoy
        .admin_get("/clusters")
        .map(|text| hosts(&text, CLUSTER))
        .unwrap_or_default();
    let weight = |worker: &Worker| {
        hosts
            .iter()
            .find(|host| host.hostname == worker.hostname)
            .map(|host| host.weight)
    };
    [weight(&workers[0]), weight(&workers[1])]
}

/// Stops the load; an error if any request failed.
fn stop(load: Load) -> anyhow::Result<u64> {
    let report = load.stop();
    if let Some(first) = report.failures.first() {
        bail!(
            "{} of {} requests failed under the steering load, the first ({:?}): {}",
            report.failures.len(),
            report.served() + report.failures.len() as u64,
            first.protocol,
            first.what
        );
    }
    Ok(report.served())
}

/// The timeline, printed as it happens: [`BEFORE`] ticks, then a hog on `hog_cpu` for [`HOGGED`]
/// ticks, then [`AFTER`] ticks without it. Returns the ticks, and `peregrine status` as the hog
/// stopped.
fn timeline(
    (supervisor, envoy, load): (&mut Supervisor, &mut Envoy, &Load),
    workers: &[Worker],
    hog_cpu: usize,
) -> anyhow::Result<(Vec<Tick>, Option<String>)> {
    let answered = || {
        let seen = load.snapshot();
        let of = |worker: &Worker| seen.by_pid.get(&worker.pid).copied().unwrap_or(0);
        ([of(&workers[0]), of(&workers[1])], seen.failures.len())
    };
    println!(
        "\nevery {TICK:?}: Envoy's weight for each worker, the requests each answered, and worker 0's \
         share of the answers"
    );
    println!(
        "  {:>6}  {:<14}  {:>8}  {:>8}  {:>10}  {:>10}  worker 0's share",
        "time", "CPU 0 runs", "weight 0", "weight 1", "answered 0", "answered 1"
    );
    let start = Instant::now();
    let (mut last, _) = answered();
    let mut hog = None;
    let mut hogged_status = None;
    let mut ticks = Vec::new();
    for n in 1..=BEFORE + HOGGED + AFTER {
        thread::sleep((start + TICK * n).saturating_duration_since(Instant::now()));
        supervisor.process().ensure_running()?;
        envoy.process().ensure_running()?;
        let (now, failed) = answered();
        let tick = Tick {
            at: start.elapsed(),
            hog: hog.is_some(),
            weights: weights(envoy, workers),
            answers: [now[0] - last[0], now[1] - last[1]],
        };
        last = now;
        println!("{}", line(&tick, failed));
        ticks.push(tick);
        if n == BEFORE {
            hog = Some(Hog::start(hog_cpu, HOG_THREADS)?);
            println!(
                "  -- a CPU hog ({HOG_THREADS} busy threads) starts on CPU {hog_cpu}, beside worker 0"
            );
        } else if n == BEFORE + HOGGED {
            hogged_status = supervisor.status_table().ok();
            drop(hog.take());
            println!("  -- the hog stops");
        }
    }
    Ok((ticks, hogged_status))
}

/// One line of the timeline.
fn line(tick: &Tick, failed: usize) -> String {
    let weight = |w: Option<u64>| w.map_or_else(|| "-".to_owned(), |w| w.to_string());
    let mut line = format!(
        "  {:>4.2} s  {:<14}  {:>8}  {:>8}  {:>10}  {:>10}  ",
        tick.at.as_secs_f64(),
        if tick.hog {
            "worker 0 + hog"
        } else {
            "worker 0"
        },
        weight(tick.weights[0]),
        weight(tick.weights[1]),
        tick.answers[0],
        tick.answers[1],
    );
    match share(std::slice::from_ref(tick)) {
        Some(share) => {
            let bar = (share * 40.0).round() as usize;
            let _ = write!(line, "{:>3.0}% {}", share * 100.0, "#".repeat(bar));
        }
        None => line.push_str("  -"),
    }
    if failed > 0 {
        let _ = write!(line, "  ({failed} failed so far)");
    }
    line
}

/// Worker 0's share of the answers over `ticks`; `None` without answers.
fn share(ticks: &[Tick]) -> Option<f64> {
    let (first, second) = ticks.iter().fold((0, 0), |(a, b), tick| {
        (a + tick.answers[0], b + tick.answers[1])
    });
    (first + second > 0).then(|| first as f64 / (first + second) as f64)
}

/// Worker 0's share of Envoy's weights over `ticks` (their mean); `None` without weights.
fn weight_share(ticks: &[Tick]) -> Option<f64> {
    let shares: Vec<f64> = ticks
        .iter()
        .filter_map(|tick| match tick.weights {
            [Some(a), Some(b)] if a + b > 0 => Some(a as f64 / (a + b) as f64),
            _ => None,
        })
        .collect();
    (!shares.is_empty()).then(|| shares.iter().sum::<f64>() / shares.len() as f64)
}

/// From a phase's start to the end of the first window from which two windows in a row have worker
/// 0's share at least three quarters of the way from `from` to `to`; `None` if none.
fn moved(phase: &[Tick], from: f64, to: f64) -> Option<Duration> {
    let there = |tick: &Tick| {
        share(std::slice::from_ref(tick)).is_some_and(|share| (from - share) / (from - to) >= 0.75)
    };
    (0..phase.len())
        .find(|&k| there(&phase[k]) && phase.get(k + 1).is_none_or(there))
        .map(|k| TICK * (k as u32 + 1))
}

/// A phase without its first [`SETTLING`] ticks.
fn settled(phase: &[Tick]) -> &[Tick] {
    &phase[(SETTLING as usize).min(phase.len())..]
}

/// The one-line conclusion: worker 0's share before, during and after the hog, how soon it moved,
/// Envoy's weights, and how much of the machine other processes took (`others`, in cores); and
/// whether the share moved clearly ([`CLEAR`]).
fn conclusion(ticks: &[Tick], others: f64) -> (String, bool) {
    let (before, rest) = ticks.split_at(BEFORE as usize);
    let (hogged, after) = rest.split_at(HOGGED as usize);
    let (Some(b), Some(h), Some(a)) =
        (share(before), share(settled(hogged)), share(settled(after)))
    else {
        return ("load steering: too few answers to tell".to_owned(), false);
    };
    let pct = |share: f64| format!("{:.0}%", share * 100.0);
    let within = |phase: &[Tick], from: f64, to: f64, what: &str| match moved(phase, from, to) {
        Some(time) => format!("within {:.2} s of {what}", time.as_secs_f64()),
        None => format!(
            "not within the {:.2} s after {what}",
            (TICK * phase.len() as u32).as_secs_f64()
        ),
    };
    let mut line = String::from("load steering: ");
    let clear = b - h >= CLEAR;
    if clear {
        let _ = write!(
            line,
            "worker 0's share of the answers fell from {} to {} {}, and {}",
            pct(b),
            pct(h),
            within(hogged, b, h, "the hog starting"),
            if a - h >= CLEAR / 2.0 {
                format!(
                    "came back to {} {}",
                    pct(a),
                    within(after, h, a, "it stopping")
                )
            } else {
                format!("stayed at {} after it stopped", pct(a))
            }
        );
    } else {
        let _ = write!(
            line,
            "worker 0's share of the answers went from {} to {} with the hog and {} after it: no \
             clear shift",
            pct(b),
            pct(h),
            pct(a)
        );
    }
    if let (Some(b), Some(h), Some(a)) = (
        weight_share(before),
        weight_share(settled(hogged)),
        weight_share(settled(after)),
    ) {
        let _ = write!(
            line,
            " (its weight: {}, {}, {} of Envoy's total)",
            pct(b),
            pct(h),
            pct(a)
        );
    }
    let _ = write!(line, "; other processes used {others:.2} cores meanwhile");
    if others > MAX_OTHERS {
        line.push_str(" (the cores were not idle)");
    }
    (line, clear)
}

// === impl Hog ===

/// Threads of this process spinning on one CPU until dropped: a noisy neighbour for the worker
/// pinned there. Threads rather than a process, so that nothing is left spinning however the demo
/// ends.
#[derive(Debug)]
struct Hog {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Hog {
    /// Starts `threads` threads on `cpu`, once each is pinned there.
    fn start(cpu: usize, threads: usize) -> anyhow::Result<Hog> {
        let mut hog = Hog {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        let (pinned, is_pinned) = mpsc::channel();
        for n in 0..threads {
            let (spinning, pinned) = (hog.stop.clone(), pinned.clone());
            let thread = thread::Builder::new()
                .name(format!("hog-{n}"))
                .spawn(move || {
                    let mut set = rustix::thread::CpuSet::new();
                    set.set(cpu);
                    let result = rustix::thread::sched_setaffinity(None, &set);
                    let ok = result.is_ok();
                    let _ = pinned.send(result);
                    while ok && !spinning.load(Ordering::Relaxed) {
                        for i in 0..10_000u64 {
                            std::hint::black_box(i);
                        }
                    }
                })
                .context("starting a thread of the hog")?;
            hog.threads.push(thread);
        }
        for _ in 0..threads {
            is_pinned
                .recv()
                .context("a thread of the hog ended")?
                .with_context(|| format!("pinning the hog to CPU {cpu}"))?;
        }
        Ok(hog)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A timeline whose windows give worker 0 these shares of 100 answers, and weights in the
    /// same proportion.
    fn ticks(shares: &[u64]) -> Vec<Tick> {
        shares
            .iter()
            .enumerate()
            .map(|(k, &share)| Tick {
                at: TICK * (k as u32 + 1),
                hog: (BEFORE as usize..(BEFORE + HOGGED) as usize).contains(&k),
                weights: [Some(share * 10), Some((100 - share) * 10)],
                answers: [share, 100 - share],
            })
            .collect()
    }

    /// Six windows at 50%, the hog's twelve (its first window at `first`, then 25%), and twelve
    /// after it (the first at 30%, then 50%).
    fn hog_timeline(first: u64) -> Vec<Tick> {
        let mut shares = vec![50; BEFORE as usize];
        shares.push(first);
        shares.extend([25; HOGGED as usize - 1]);
        shares.push(30);
        shares.extend([50; AFTER as usize - 1]);
        ticks(&shares)
    }

    #[test]
    fn a_clear_shift_says_how_far_and_how_soon() {
        let (line, clear) = conclusion(&hog_timeline(40), 0.02);
        assert!(clear);
        assert_eq!(
            line,
            "load steering: worker 0's share of the answers fell from 50% to 25% within 0.50 s of \
             the hog starting, and came back to 50% within 0.50 s of it stopping (its weight: 50%, \
             25%, 50% of Envoy's total); other processes used 0.02 cores meanwhile"
        );
        let (line, _) = conclusion(&hog_timeline(25), 0.02);
        assert!(line.contains("within 0.25 s of the hog starting"), "{line}");
    }

    #[test]
    fn one_window_that_gets_there_is_not_enough() {
        // Three quarters of the way from 50% to 25% is 31.25%: the second window gets there, the
        // third does not, the fourth and after do.
        let phase = ticks(&[45, 30, 40, 30, 25, 25]);
        assert_eq!(moved(&phase, 0.5, 0.25), Some(TICK * 4));
        assert_eq!(moved(&ticks(&[45, 45]), 0.5, 0.25), None);
    }

    #[test]
    fn no_shift_on_busy_cores_is_said_so() {
        let (line, clear) = conclusion(&ticks(&[50; 30]), 0.9);
        assert!(!clear);
        assert_eq!(
            line,
            "load steering: worker 0's share of the answers went from 50% to 50% with the hog and \
             50% after it: no clear shift (its weight: 50%, 50%, 50% of Envoy's total); other \
             processes used 0.90 cores meanwhile (the cores were not idle)"
        );
    }

    #[test]
    fn a_share_that_does_not_come_back_is_reported_as_it_is() {
        let mut shares = vec![50; BEFORE as usize];
        shares.extend([25; (HOGGED + AFTER) as usize]);
        let (line, clear) = conclusion(&ticks(&shares), 0.0);
        assert!(clear);
        assert!(
            line.contains("and stayed at 25% after it stopped"),
            "{line}"
        );
    }
}
