//! Telling a stalled worker from an idle one.
//!
//! A worker that serves nothing looks idle to the sampler (no CPU, no requests), and an idle worker's
//! load report draws *more* traffic to it. But a worker that is stopped (SIGSTOP, a debugger) or hung
//! (a deadlock, a blocking call that never returns) also serves nothing, while requests to it pile
//! up. Two facts the kernel keeps tell them apart, and both are looked at only for a worker that
//! served no request during the last interval:
//!
//! - its state in `/proc/PID/stat`: `T` (stopped by a signal) or `t` (stopped by a tracer);
//! - what waits in its own sockets ([`queued_in`]): for each socket descriptor it holds, taken with
//!   `pidfd_getfd(2)`, the bytes unread on a connection (`FIONREAD`) or the connections not yet
//!   accepted on a TCP listener (`TCP_INFO`). An idle worker takes everything at once; a worker that
//!   leaves something waiting through two samples in a row while serving nothing, on less than
//!   [`BUSY_CORES`] of CPU, is not reading. (A worker busy with one long request is on a CPU: it is
//!   loaded, not stalled, and its load report says so.)
//!
//! The cost is the worker's own descriptors, not the host's sockets: scanning `/proc/net/tcp`
//! instead (every socket of the namespace, tens of thousands of TIME_WAIT ones under load) took
//! enough kernel time on a worker's core to skew the very loads the sampler measures.

use crate::registry::Stall;

/// A worker using at least this much CPU over an interval is busy, not stalled.
pub const BUSY_CORES: f64 = 0.05;

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

/// What waits in the sockets process `pid` holds: unread bytes on its connections, plus connections
/// not yet accepted on its TCP listeners. `None` when its descriptors cannot be read (it is gone, or
/// not ours to look at).
pub fn queued_in(pid: u32) -> Option<u64> {
    use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};
    let pid_number = Pid::from_raw(i32::try_from(pid).ok()?)?;
    let pidfd = rustix::process::pidfd_open(pid_number, PidfdFlags::empty()).ok()?;
    let mut queued = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten() {
        let is_socket = std::fs::read_link(entry.path()).is_ok_and(|target| {
            target
                .as_os_str()
                .as_encoded_bytes()
                .starts_with(b"socket:")
        });
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // A duplicate shares the socket; closing it closes nothing of the worker's.
        let Ok(socket) = rustix::process::pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()) else {
            continue;
        };
        queued += if rustix::net::sockopt::socket_acceptconn(&socket).unwrap_or(false) {
            accept_queue(&socket).unwrap_or(0)
        } else {
            rustix::io::ioctl_fionread(&socket).unwrap_or(0)
        };
    }
    Some(queued)
}

/// The connections waiting to be accepted on a TCP listener (`tcpi_unacked` of `TCP_INFO`, which
/// holds the accept queue's length for a socket in LISTEN); `None` for another kind of socket.
fn accept_queue(listener: &std::os::fd::OwnedFd) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a writable buffer of `len` bytes, zeroed so that a shorter answer leaves
    // valid values; the descriptor is open for the duration of the call.
    let status = unsafe {
        libc::getsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    // SAFETY: zero-initialised, and the kernel wrote at most `len` bytes of a `tcp_info`.
    (status == 0).then(|| u64::from(unsafe { info.assume_init() }.tcpi_unacked))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_unread_bytes_and_unaccepted_connections_of_a_process() {
        use std::io::Write;
        // This very process holds the sockets: a listener with one connection waiting, and an
        // accepted connection with 5 bytes unread.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let before = queued_in(std::process::id()).unwrap();
        let mut first = std::net::TcpStream::connect(addr).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        first.write_all(b"hello").unwrap();
        let _waiting = std::net::TcpStream::connect(addr).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut queued = 0;
        while std::time::Instant::now() < deadline {
            queued = queued_in(std::process::id()).unwrap() - before;
            if queued == 6 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            queued,
            5 + 1,
            "5 bytes unread and 1 connection not accepted"
        );
        assert_eq!(queued_in(u32::MAX), None);
        assert_eq!(queued_in(0x3fff_fff0), None, "no such process");
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
