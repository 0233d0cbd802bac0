//! Memory given back to the system after a flood, whatever brought it.
//!
//! glibc's allocator keeps what it frees: each of the runtime's threads allocates from an arena of
//! its own, and only the top of the main heap goes back to the system on its own. Thousands of ORCA
//! streams multiplexed on a few connections, a flood of registration connections or one xDS request
//! naming 100,000 resources all leave tens to hundreds of MB free in the arenas once they are gone,
//! held for good: not a leak (a second flood reuses it), but the supervisor's RSS stays at the
//! flood's peak. Every [`PERIOD`], this task reads how much the allocator holds free
//! (`mallinfo2(3)`) and, when that is at least [`FREE_FLOOR`] and at least a [`FREE_SHARE`] of what
//! is in use, calls `malloc_trim(0)`, which returns every arena's free pages.
//!
//! `malloc_trim` returns the free chunks of every arena and the main heap's top, but not the free
//! top of a thread's arena: that goes back only as it is freed, and only when it is over the
//! allocator's trim threshold, which glibc raises to twice the largest mmapped block freed (up to
//! 64 MiB). A large fleet's ranges and snapshots free blocks of several MiB, and a supervisor kept
//! 19-25 MiB of free arena tops resident for good after 25,000 workers left (1 MiB in use, every
//! trim run). [`spawn`] fixes the threshold at [`TRIM_THRESHOLD`], glibc's default, so an arena's
//! top goes back as it is freed.
//!
//! Even so, a thread arena's free top stays resident (below); [`one_arena`], called before the
//! runtime starts, gives every thread the main arena, whose free memory `malloc_trim` returns whole.
//!
//! Invariant: a trim happens only when much is free, so a steady state (whose free memory stays
//! within a share of its use) is never trimmed over and over; at most one trim per [`PERIOD`].

use std::time::Duration;

/// How often the allocator's free memory is looked at.
pub const PERIOD: Duration = Duration::from_secs(5);

/// Free memory below which no trim is worth it.
pub const FREE_FLOOR: usize = 16 << 20;

/// The share of the memory in use that must be free, too, for a trim (one in `FREE_SHARE`).
pub const FREE_SHARE: usize = 4;

/// The allocator's trim threshold: a thread arena's free top over it goes back to the system as it
/// is freed. glibc's default, held so that glibc does not raise it (which also keeps its mmap
/// threshold at its default, 128 KiB: larger blocks are mapped and unmapped on their own).
pub const TRIM_THRESHOLD: usize = 128 << 10;

/// Whether `free` bytes held by the allocator, with `in_use` bytes allocated, are worth a trim.
pub fn worth_trimming(free: usize, in_use: usize) -> bool {
    free >= FREE_FLOOR && free >= in_use / FREE_SHARE
}

/// Holds the allocator's trim threshold at [`TRIM_THRESHOLD`] and starts the task that trims when
/// the allocator holds much free memory; it runs for the life of the runtime. Must be called within
/// a tokio runtime, before the supervisor allocates much. Does nothing on other allocators than
/// glibc's, which give memory back on their own.
pub fn spawn() {
    if allocator().is_none() {
        return;
    }
    hold_trim_threshold();
    tokio::spawn(async {
        let mut ticks = tokio::time::interval(PERIOD);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Ok(Some((free, in_use))) = tokio::task::spawn_blocking(allocator).await else {
                continue;
            };
            if !worth_trimming(free, in_use) {
                continue;
            }
            let returned = tokio::task::spawn_blocking(trim).await.unwrap_or(false);
            tracing::debug!(
                free_mib = free >> 20,
                in_use_mib = in_use >> 20,
                returned,
                "Gave the allocator's free memory back to the system"
            );
        }
    });
}

/// The allocator's free bytes (in its arenas, mmapped chunks aside) and bytes in use.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn allocator() -> Option<(usize, usize)> {
    // SAFETY: mallinfo2 takes every arena's lock itself and only reads the allocator's own state;
    // it returns a plain struct by value.
    let info = unsafe { libc::mallinfo2() };
    Some((info.fordblks, info.uordblks.saturating_add(info.hblkhd)))
}

/// Other allocators are not looked at.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn allocator() -> Option<(usize, usize)> {
    None
}

/// How many arenas glibc's allocator may have: one, its main arena, whatever the threads.
pub const ARENAS: i32 = 1;

/// Has glibc's allocator serve every thread from its main arena ([`ARENAS`]), as
/// `MALLOC_ARENA_MAX=1` would. Must be called before any other thread starts (before the runtime):
/// a thread keeps the arena it got.
///
/// `malloc_trim` returns the main arena's free top and every free page of every arena, but not a
/// thread arena's free top, which goes back only when a free of 64 KiB or more lands on it. After a
/// fleet of 25,000 workers left, one thread arena kept 20 MB resident for good, with 1 MB in use,
/// in about one run in six of `tests/tests/fleet_records.rs`; with one arena, none did in eight.
/// The supervisor is a control plane of a few threads, whose small allocations come from each
/// thread's cache (glibc's tcache) without taking the arena's lock.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn one_arena() {
    // SAFETY: mallopt only sets the allocator's own parameters, under its own lock.
    let set = unsafe { libc::mallopt(libc::M_ARENA_MAX, ARENAS) };
    if set != 1 {
        tracing::warn!("The allocator refused its arena limit: freed memory may stay resident");
    }
}

/// Other allocators have no arenas to limit.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn one_arena() {}

/// Sets glibc's trim threshold to [`TRIM_THRESHOLD`], which also stops glibc from raising it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn hold_trim_threshold() {
    // SAFETY: mallopt only sets the allocator's own parameters, under its own lock.
    let set = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) };
    if set != 1 {
        tracing::warn!("The allocator refused its trim threshold: freed memory may stay resident");
    }
}

/// Other allocators have no trim threshold.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn hold_trim_threshold() {}

/// Returns the allocator's free memory to the system; whether any was. The one `malloc_trim` of the
/// crate (the fleet's trim after its view shrinks calls it too).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn trim() -> bool {
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas; it takes the
    // arenas' locks itself and touches no memory in use.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Other allocators give memory back on their own.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn trim() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_much_free_memory_is_trimmed() {
        assert!(!worth_trimming(FREE_FLOOR - 1, 0), "below the floor");
        assert!(worth_trimming(FREE_FLOOR, 10 << 20), "after a flood");
        assert!(
            !worth_trimming(100 << 20, 1 << 30),
            "a large steady state's churn"
        );
        assert!(worth_trimming(300 << 20, 1 << 30), "a large share free");
    }
}
