//! Giving memory back after a flood of connections.

use std::{sync::Arc, time::Duration};

use super::Admission;

/// Gives the allocator's free memory back to the system after a wave of connections has gone: glibc
/// keeps what thousands of connections freed (in every thread's arena) unless asked, so a flood
/// would leave the supervisor hundreds of MB larger for good. Looks every 10 s; trims when the
/// open connections fell by at least 256 since the highest count seen after the last trim. Runs
/// until the admission is dropped.
pub fn spawn_trimmer(admission: &Arc<Admission>) {
    let admission = Arc::downgrade(admission);
    tokio::spawn(async move {
        let mut peak = 0;
        let mut ticks = tokio::time::interval(Duration::from_secs(10));
        loop {
            ticks.tick().await;
            let Some(admission) = admission.upgrade() else {
                return;
            };
            let open = admission.open();
            peak = peak.max(open);
            if peak >= open + 256 {
                tracing::debug!(
                    peak,
                    open,
                    "Giving freed connection memory back to the system"
                );
                peak = open;
                let _ = tokio::task::spawn_blocking(trim).await;
            }
        }
    });
}

/// `malloc_trim(3)`: releases free memory at the top of the heap and in every arena.
fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim is thread-safe in glibc and only touches the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}
