//! How many times a server enters the kernel per request: its system calls and its io_uring
//! submissions over one run, counted by `perf stat` on two tracepoints (`raw_syscalls:sys_enter`,
//! `io_uring:io_uring_submit_req`) for the server's process and all its threads.
//!
//! Counting costs the traced process a little per event, so these runs are separate from the runs
//! whose CPU per request is reported: a count never skews a timing.

use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, ensure};

use super::server::LOAD_CPU;

/// The tracepoints counted, in the order of [`Ops`]' fields.
const EVENTS: [&str; 2] = ["raw_syscalls:sys_enter", "io_uring:io_uring_submit_req"];

/// What a process did in the kernel over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Ops {
    /// System calls entered (an `io_uring_enter` is one).
    pub(super) syscalls: u64,
    /// io_uring submission queue entries the kernel took (each operation submitted, a multishot one
    /// once for all its completions).
    pub(super) submissions: u64,
}

/// `perf stat` attached to one process until [`Counting::stop`].
#[derive(Debug)]
pub(super) struct Counting {
    perf: Child,
}

/// How long perf may take to open its counters and acknowledge that they count.
const ATTACH_DEADLINE: Duration = Duration::from_secs(10);

impl Counting {
    /// Starts counting for `pid`, with perf pinned to the load generator's core, and returns once
    /// perf has said its counters count.
    ///
    /// perf starts with its counters off (`--delay=-1`) and takes commands on its stdin, answering
    /// `ack` on its stdout (`--control fd:0,1`; its counts go to stderr): the `enable` it
    /// acknowledges is the condition waited on. A fixed wait instead lost every count on a busy
    /// machine, where the SIGINT of [`Counting::stop`] reached perf before its handler was set.
    pub(super) fn start(pid: u32) -> anyhow::Result<Counting> {
        let mut perf = Command::new("taskset")
            .args(["-c", LOAD_CPU, "perf", "stat", "-x", ",", "--delay=-1"])
            .args(["--control", "fd:0,1", "-e"])
            .arg(EVENTS.join(","))
            .args(["-p", &pid.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running perf stat (Debian: apt install linux-perf)")?;
        match enable(&mut perf) {
            Ok(()) => Ok(Counting { perf }),
            Err(error) => {
                let _ = perf.kill();
                let output = perf.wait_with_output().context("waiting for perf stat")?;
                Err(error.context(format!(
                    "perf stat did not start counting:\n{}",
                    String::from_utf8_lossy(&output.stderr)
                )))
            }
        }
    }

    /// Stops counting (SIGINT, which makes perf print its totals) and reads the counts.
    pub(super) fn stop(self) -> anyhow::Result<Ops> {
        let pid = rustix::process::Pid::from_raw(self.perf.id() as i32).context("perf's pid")?;
        rustix::process::kill_process(pid, rustix::process::Signal::INT)
            .context("stopping perf stat")?;
        let output = self
            .perf
            .wait_with_output()
            .context("waiting for perf stat")?;
        let text = String::from_utf8_lossy(&output.stderr);
        parse(&text).with_context(|| format!("perf stat printed no counts for {EVENTS:?}:\n{text}"))
    }
}

/// Sends perf `enable` and waits, up to [`ATTACH_DEADLINE`], for its `ack`.
fn enable(perf: &mut Child) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let control = perf.stdin.as_mut().context("perf's stdin")?;
    control
        .write_all(b"enable\n")
        .context("writing enable to perf")?;
    let acks = perf.stdout.as_mut().context("perf's stdout")?;
    let deadline = std::time::Instant::now() + ATTACH_DEADLINE;
    let mut answer = Vec::new();
    // perf writes `ack\n` and its string's terminating NUL.
    while !answer.windows(4).any(|window| window == b"ack\n") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        ensure!(
            !left.is_zero(),
            "no ack from perf within {ATTACH_DEADLINE:?}"
        );
        let timeout = rustix::event::Timespec::try_from(left).context("poll timeout")?;
        let mut fds = [rustix::event::PollFd::new(
            acks,
            rustix::event::PollFlags::IN,
        )];
        if rustix::event::poll(&mut fds, Some(&timeout)).context("waiting for perf's ack")? == 0 {
            continue;
        }
        let mut chunk = [0u8; 64];
        let read = acks.read(&mut chunk).context("reading perf's ack")?;
        ensure!(read > 0, "perf closed its stdout before it acknowledged");
        answer.extend_from_slice(&chunk[..read]);
    }
    Ok(())
}

/// The counts in `perf stat -x ,` output: one `value,unit,event,...` line per event.
fn parse(text: &str) -> anyhow::Result<Ops> {
    let count = |event: &str| -> anyhow::Result<u64> {
        let line = text
            .lines()
            .find(|line| line.split(',').nth(2) == Some(event))
            .with_context(|| format!("no line for {event}"))?;
        let value = line.split(',').next().unwrap_or_default();
        ensure!(
            !value.starts_with('<'),
            "{event} is {value} here (tracepoints need root and tracefs)"
        );
        value.parse().with_context(|| format!("{event}: {value:?}"))
    };
    Ok(Ops {
        syscalls: count(EVENTS[0])?,
        submissions: count(EVENTS[1])?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_perfs_csv() {
        let text = "1234,,raw_syscalls:sys_enter,5003417446,100.00,,\n\
                    56,,io_uring:io_uring_submit_req,5003417446,100.00,,\n";
        assert_eq!(
            parse(text).unwrap(),
            Ops {
                syscalls: 1234,
                submissions: 56
            }
        );
        assert!(parse("<not supported>,,raw_syscalls:sys_enter,0,100.00,,\n").is_err());
        assert!(parse("").is_err());
    }

    #[test]
    fn counts_the_system_calls_of_this_process() {
        if xtask::packages::program_path("perf").is_err() {
            peregrine_e2e::skip(
                "counts_the_system_calls_of_this_process",
                "no perf (apt install linux-perf)",
            );
            return;
        }
        let counting = Counting::start(std::process::id()).unwrap();
        for _ in 0..1000 {
            let _ = std::fs::metadata("/");
        }
        let ops = counting.stop().unwrap();
        assert!(ops.syscalls >= 1000, "{ops:?}");
    }
}
