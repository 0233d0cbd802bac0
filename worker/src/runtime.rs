//! The worker's runtime: a tokio current-thread runtime that hosts the worker's io_uring driver.
//!
//! tokio runs the connections' tasks, the application's futures (so an application may use tokio's
//! timers, channels and sockets as anywhere else) and every timer. The driver does the sockets' IO:
//! its ring is registered with tokio, so a completion wakes the thread when it waits, and it submits
//! everything queued during a turn in one `io_uring_enter` just before the thread parks.
//!
//! One runtime runs on one thread, and every task of it stays there: nothing needs to be `Send`.

use std::{
    future::Future,
    io,
    os::fd::{AsRawFd, RawFd},
};

use tokio::{io::unix::AsyncFd, task::JoinHandle};

use crate::driver::{self, Sizes};

/// How the runtime is set up; [`Builder::default`] suits a worker.
#[derive(Clone, Debug, Default)]
pub struct Builder {
    sizes: Sizes,
}

impl Builder {
    /// The default: a ring of 128 submission and 512 completion entries, and 512 receive buffers of
    /// 4 KiB ([`peregrine_contract::rings`]).
    pub fn new() -> Self {
        Builder::default()
    }

    /// Sizes the provided buffer ring every connection receives into: `count` buffers (a power of
    /// two, at most 32768) of `size` bytes. Fewer buffers bound the receive memory more tightly; a
    /// ring that runs dry holds the peers back (their bytes wait in the sockets), it loses nothing.
    ///
    /// # Panics
    ///
    /// When `count` is not a power of two.
    pub fn buffers(mut self, count: u16, size: usize) -> Self {
        assert!(
            count.is_power_of_two(),
            "the buffer count must be a power of two"
        );
        self.sizes.buffers = count;
        self.sizes.buffer_size = size;
        self
    }

    /// How long a connection closed with bytes still to send may take to send them (10 s by default).
    #[cfg(test)]
    pub(crate) fn linger(mut self, linger: std::time::Duration) -> Self {
        self.sizes.linger = linger;
        self
    }

    /// Runs `future` to completion on this thread, which becomes the runtime's thread; tasks it
    /// spawned and has not awaited are dropped when it returns. Fails when the ring cannot be set up
    /// (a kernel without io_uring, or `io_uring_disabled`) or a runtime runs on this thread already.
    pub fn block_on<F: Future>(self, future: F) -> io::Result<F::Output> {
        let ring = driver::install(self.sizes)?;
        let _uninstall = Uninstall;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .on_thread_park(driver::turn)
            .build()?;
        let local = tokio::task::LocalSet::new();
        let output = local.block_on(&runtime, async move {
            let reaper = watch(ring)?;
            let reaper = tokio::task::spawn_local(async move {
                loop {
                    let Ok(mut ready) = reaper.readable().await else {
                        return;
                    };
                    driver::reap();
                    ready.clear_ready();
                }
            });
            let output = future.await;
            reaper.abort();
            Ok::<_, io::Error>(output)
        });
        // Tasks still alive drop here, while the driver is installed: their sockets cancel what the
        // kernel holds.
        drop(local);
        drop(runtime);
        output
    }
}

/// Registers the ring's descriptor with tokio, to be woken when completions are posted.
#[allow(unsafe_code, reason = "tokio's registration of a borrowed descriptor")]
fn watch(ring: RawFd) -> io::Result<AsyncFd<RingFd>> {
    // SAFETY: the descriptor is the driver's ring, which is uninstalled (and closed) only after the
    // tokio runtime, and with it this registration, has been dropped.
    unsafe { AsyncFd::register(RingFd(ring)) }.map_err(io::Error::from)
}

/// Uninstalls the driver however `block_on` ends.
struct Uninstall;

impl Drop for Uninstall {
    fn drop(&mut self) {
        driver::uninstall();
    }
}

/// The ring's descriptor, as tokio watches it.
struct RingFd(RawFd);

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Runs `future` on a new runtime with the default settings ([`Builder::block_on`]).
///
/// # Panics
///
/// When the runtime cannot start.
pub fn start<F: Future>(future: F) -> F::Output {
    Builder::new()
        .block_on(future)
        .expect("cannot start the worker's io_uring runtime")
}

/// Spawns a task on the current runtime's thread.
///
/// # Panics
///
/// When called outside a runtime's [`Builder::block_on`].
pub fn spawn<F>(future: F) -> JoinHandle<F::Output>
where
    F: Future + 'static,
    F::Output: 'static,
{
    tokio::task::spawn_local(future)
}
