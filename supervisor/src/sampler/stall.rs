//! Telling a stalled worker from an idle one.
//!
//! A worker that serves nothing looks idle to the sampler (no CPU, no requests), and an idle worker's
//! load report draws *more* traffic to it. But a worker that is stopped (SIGSTOP, a debugger) or hung
//! (a deadlock, a blocking call that never returns) also serves nothing, while requests to it pile
//! up. Two facts the kernel keeps tell them apart, and both are looked at only for a worker that
//! served no request during the last interval:
//!
//! - its state in `/proc/PID/stat`: `T` (stopped by a signal) or `t` (stopped by a tracer);
//! - bytes waiting in its sockets: for every TCP socket on its own port (its listener's accept queue,
//!   and its connections' receive queues, from `/proc/net/tcp` and `tcp6`), what the kernel holds that
//!   the worker has not taken. An idle worker takes everything at once; a worker that leaves bytes
//!   unread through two samples in a row while serving nothing, on less than
//!   [`BUSY_CORES`] of CPU, is not reading. (A worker busy with one long request is on a CPU: it is
//!   loaded, not stalled, and its load report says so.)
//!
//! Workers on Unix sockets are judged by their state alone: `/proc/net/unix` shows no queues.

use std::collections::HashMap;

use crate::registry::Stall;

/// A worker using at least this much CPU over an interval is busy, not stalled.
pub const BUSY_CORES: f64 = 0.05;

/// The scheduler state letter of `/proc/PID/stat` (field 3).
pub fn process_state(stat: &str) -> Option<char> {
    stat.get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// What one sample saw of a worker that served no request in the interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// Its scheduler state letter, if it could be read.
    pub state: Option<char>,
    /// Its CPU use over the interval, in cores.
    pub cpu_cores: f64,
    /// The bytes queued on its TCP sockets (`None` for a worker without TCP listeners).
    pub queued_bytes: Option<u64>,
}

/// The verdict of one sample, given the previous one's `suspect` flag: whether the worker is stalled
/// now, and whether it is suspect (bytes unread once, which a second sample confirms or clears).
pub fn judge(seen: Observation, suspect_before: bool) -> (Option<Stall>, bool) {
    if matches!(seen.state, Some('T' | 't')) {
        return (Some(Stall::Stopped), false);
    }
    let unread = seen.queued_bytes.filter(|&bytes| bytes > 0);
    match unread {
        Some(bytes) if seen.cpu_cores < BUSY_CORES => {
            let stall = suspect_before.then_some(Stall::NotReading {
                queued_bytes: bytes,
            });
            (stall, true)
        }
        _ => (None, false),
    }
}

/// The bytes queued per local TCP port, from the text of `/proc/net/tcp` or `/proc/net/tcp6`: the
/// receive queue of each connection, and the accept queue of each listener (what the kernel shows
/// as `rx_queue` for a socket in LISTEN).
pub fn queued_by_port(text: &str, into: &mut HashMap<u16, u64>) {
    for line in text.lines().skip(1) {
        let mut fields = line.split_whitespace();
        let (Some(_slot), Some(local), Some(_remote), Some(_state), Some(queues)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let Some(port) = local
            .rsplit_once(':')
            .and_then(|(_, port)| u16::from_str_radix(port, 16).ok())
        else {
            continue;
        };
        let Some(rx) = queues
            .split_once(':')
            .and_then(|(_, rx)| u64::from_str_radix(rx, 16).ok())
        else {
            continue;
        };
        if rx > 0 {
            *into.entry(port).or_default() += rx;
        }
    }
}

/// Reads the queues of every TCP socket of this network namespace, by local port.
pub fn read_queues() -> HashMap<u16, u64> {
    let mut queues = HashMap::new();
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(file) {
            queued_by_port(&text, &mut queues);
        }
    }
    queues
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_state_letter_after_the_command_name() {
        assert_eq!(process_state("42 (peregrine) S 1 42"), Some('S'));
        assert_eq!(
            process_state("42 (a) b) T 1 42"),
            Some('T'),
            "a name with ')'"
        );
        assert_eq!(process_state("42 (x"), None);
    }

    const TCP: &str = "\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000003 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000200 00:00000000 00000000     0        0 2 1 0 20 4 30 10 -1
   2: 0100007F:0050 0100007F:D432 01 00000010:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
";

    #[test]
    fn sums_accept_and_receive_queues_by_local_port() {
        let mut queues = HashMap::new();
        queued_by_port(TCP, &mut queues);
        // Port 8080: 3 connections waiting to be accepted, 512 bytes unread.
        assert_eq!(queues.get(&8080), Some(&(3 + 0x200)));
        assert_eq!(queues.get(&80), None, "only a send queue");
    }

    #[test]
    fn stopped_is_at_once_unread_bytes_take_two_samples_and_cpu_means_busy() {
        let seen = |state, cpu_cores, queued_bytes| Observation {
            state: Some(state),
            cpu_cores,
            queued_bytes,
        };
        assert_eq!(
            judge(seen('T', 0.0, Some(0)), false),
            (Some(Stall::Stopped), false)
        );
        assert_eq!(
            judge(seen('t', 0.0, None), false),
            (Some(Stall::Stopped), false)
        );
        // Idle: nothing waits.
        assert_eq!(judge(seen('S', 0.0, Some(0)), true), (None, false));
        assert_eq!(judge(seen('S', 0.0, None), true), (None, false));
        // Bytes wait: suspect once, stalled the second time.
        assert_eq!(judge(seen('S', 0.0, Some(10)), false), (None, true));
        assert_eq!(
            judge(seen('D', 0.01, Some(10)), true),
            (Some(Stall::NotReading { queued_bytes: 10 }), true)
        );
        // On a CPU: busy with a long request, not stalled.
        assert_eq!(judge(seen('R', 1.0, Some(10)), true), (None, false));
    }
}
