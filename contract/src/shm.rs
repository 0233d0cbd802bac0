//! A shared memory mapping that can never be read past the object behind it.
//!
//! The one `mmap` wrapper of the workspace: the request counters (a `memfd`, or the eBPF sampler's
//! mmapable array map) and the eBPF sampler's per-CPU cells are mapped through it, by the worker, the
//! supervisor and the eBPF loader. A mapping longer than its object does not fail: it ends in `SIGBUS`
//! at the first touch past the end. So [`SharedMemory::map`] asks the kernel how big the object is
//! first ([`object_size`]), and every access is bounds- and alignment-checked.
//!
//! Invariant: memory is only ever touched through atomics (the other side is another process or the
//! kernel), and a read-only mapping hands out no reference that could write.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
};

use rustix::mm::{MapFlags, ProtFlags};

/// Why a shared object could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The object is smaller than the mapping asked for.
    #[error("the shared object holds {size} bytes, {needed} needed")]
    TooSmall {
        /// Its size.
        size: u64,
        /// The bytes asked for.
        needed: u64,
    },
    /// The descriptor is neither a regular file (a `memfd`) nor a BPF array map.
    #[error("the descriptor is neither a memfd nor a BPF array map")]
    NotShareable,
    /// An empty mapping was asked for.
    #[error("a shared mapping needs at least one byte")]
    Empty,
    /// A file whose holders may still shrink it: not a memfd sealed with `F_SEAL_SHRINK`.
    #[error(
        "the shared object is not sealed against shrinking (F_SEAL_SHRINK): its holder could cut it \
         short under the mapping"
    )]
    Resizable,
    /// A system call failed.
    #[error("cannot map the shared object")]
    Io(#[from] io::Error),
}

/// Whether a mapping may be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Loads only.
    ReadOnly,
    /// Loads and stores.
    ReadWrite,
}

/// A `MAP_SHARED` mapping of the first bytes of a memfd or a BPF array map.
#[derive(Debug)]
pub struct SharedMemory {
    base: NonNull<u8>,
    /// The bytes asked for: every access stays below this.
    len: usize,
    /// The bytes mapped: `len` rounded up to whole pages.
    mapped: usize,
    access: Access,
}

// SAFETY: the mapping is only accessed through atomics (`Sync`), and unmapped once, on drop.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Maps the first `len` bytes of the object behind `fd`, once the object is known to hold them.
    pub fn map(fd: BorrowedFd<'_>, len: usize, access: Access) -> Result<SharedMemory, ShmError> {
        if len == 0 {
            return Err(ShmError::Empty);
        }
        let size = object_size(fd)?;
        if size < len as u64 {
            return Err(ShmError::TooSmall {
                size,
                needed: len as u64,
            });
        }
        let page = rustix::param::page_size();
        let mapped = len.div_ceil(page) * page;
        let prot = match access {
            Access::ReadOnly => ProtFlags::READ,
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        };
        // SAFETY: a fresh shared mapping (null hint: the kernel picks the address) of `fd` from offset
        // 0; nothing else in this process aliases it. Its first `len` bytes are inside the object
        // (checked above); the rest of the last page is never accessed (`at` checks against `len`). It
        // stays mapped until `Drop` unmaps it.
        let ptr = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), mapped, prot, MapFlags::SHARED, fd, 0)
        }
        .map_err(io::Error::from)?;
        let base =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(SharedMemory {
            base,
            len,
            mapped,
            access,
        })
    }

    /// [`SharedMemory::map`] for an object another process holds too, and so could resize: refused
    /// unless it can never shrink ([`ensure_fixed_size`]). A check of its size alone would hold only
    /// until that process truncates it.
    pub fn map_fixed(
        fd: BorrowedFd<'_>,
        len: usize,
        access: Access,
    ) -> Result<SharedMemory, ShmError> {
        ensure_fixed_size(fd)?;
        SharedMemory::map(fd, len, access)
    }

    /// The bytes that may be accessed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte may be accessed (never: [`SharedMemory::map`] refuses an empty mapping).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A pointer to the `size`-byte word at `offset`, which must be in bounds and aligned.
    fn at(&self, offset: usize, size: usize) -> NonNull<u8> {
        assert!(
            offset.is_multiple_of(size) && offset.checked_add(size).is_some_and(|e| e <= self.len),
            "shared word at {offset} (of {size} bytes) outside 0..{} or misaligned",
            self.len
        );
        // SAFETY: `offset + size <= len <= mapped`, so the result stays inside the mapping.
        unsafe { self.base.add(offset) }
    }

    /// Loads the `u64` at byte `offset` with `order`.
    ///
    /// # Panics
    ///
    /// When the word is not inside the mapping or not 8-byte aligned.
    pub fn load_u64(&self, offset: usize, order: Ordering) -> u64 {
        let word = self.at(offset, 8).cast::<AtomicU64>();
        // SAFETY: in bounds and aligned (checked by `at`; the base is page-aligned). Other processes
        // and the kernel write these words with aligned stores or atomics, which an atomic load
        // observes whole. A shared reference to an atomic allows no write through a read-only mapping
        // here: only `load` is called.
        unsafe { word.as_ref() }.load(order)
    }

    /// Loads the `u32` at byte `offset` with `order`.
    ///
    /// # Panics
    ///
    /// As [`SharedMemory::load_u64`], for 4 bytes.
    pub fn load_u32(&self, offset: usize, order: Ordering) -> u32 {
        let word = self.at(offset, 4).cast::<AtomicU32>();
        // SAFETY: as in `load_u64`.
        unsafe { word.as_ref() }.load(order)
    }

    /// The `u64` at byte `offset`, to load, store or add to.
    ///
    /// # Panics
    ///
    /// When the mapping is read-only, or as [`SharedMemory::load_u64`].
    pub fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert_eq!(
            self.access,
            Access::ReadWrite,
            "a read-only mapping cannot be written"
        );
        let word = self.at(offset, 8).cast::<AtomicU64>();
        // SAFETY: in bounds and aligned (checked by `at`) in a writable mapping; the memory is only
        // ever accessed atomically, here and in every other process that maps it. The reference
        // borrows `self`, so it cannot outlive the mapping.
        unsafe { word.as_ref() }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: `base` and `mapped` are exactly what `mmap` returned; references handed out borrow
        // `self`, so none outlives this.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.mapped) };
    }
}

/// Checks that the object behind `fd` can never become smaller: a memfd sealed with `F_SEAL_SHRINK`,
/// or something that is not a file at all (a BPF array map is sized once, at its creation). A
/// descriptor taken from another process ([`SharedMemory::map_fixed`]) must pass this: [`object_size`]
/// says how big an object is now, and a holder that shrinks it later would turn the next access of
/// the mapping into `SIGBUS`.
pub fn ensure_fixed_size(fd: BorrowedFd<'_>) -> Result<(), ShmError> {
    let stat = rustix::fs::fstat(fd).map_err(io::Error::from)?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return Ok(());
    }
    // EINVAL: a file that cannot carry seals (not a memfd) can always be truncated by its writers.
    match rustix::fs::fcntl_get_seals(fd) {
        Ok(seals) if seals.contains(rustix::fs::SealFlags::SHRINK) => Ok(()),
        Ok(_) | Err(rustix::io::Errno::INVAL) => Err(ShmError::Resizable),
        Err(error) => Err(ShmError::Io(error.into())),
    }
}

/// The bytes of the object behind `fd`: a regular file's size (a `memfd`), or a BPF array map's
/// `max_entries * value_size` from its `fdinfo`.
pub fn object_size(fd: BorrowedFd<'_>) -> Result<u64, ShmError> {
    let stat = rustix::fs::fstat(fd).map_err(io::Error::from)?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::RegularFile {
        return Ok(stat.st_size as u64);
    }
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))?;
    bpf_array_size(&info).ok_or(ShmError::NotShareable)
}

/// The bytes of a BPF array map, from its `/proc/self/fdinfo` text.
fn bpf_array_size(fdinfo: &str) -> Option<u64> {
    let field = |name: &str| {
        fdinfo.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim().parse::<u64>().ok())?
        })
    };
    // BPF_MAP_TYPE_ARRAY
    (field("map_type")? == 2).then_some(())?;
    field("max_entries")?.checked_mul(field("value_size")?)
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, OwnedFd};

    use super::*;

    fn memfd(bytes: u64) -> OwnedFd {
        let fd = rustix::fs::memfd_create("shm-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, bytes).unwrap();
        fd
    }

    #[test]
    fn two_mappings_share_their_words() {
        let fd = memfd(4096);
        let writer = SharedMemory::map(fd.as_fd(), 4096, Access::ReadWrite).unwrap();
        let reader = SharedMemory::map(fd.as_fd(), 4096, Access::ReadOnly).unwrap();
        writer.u64_at(4088).store(7, Ordering::Relaxed);
        assert_eq!(reader.load_u64(4088, Ordering::Relaxed), 7);
        assert_eq!(
            reader.load_u32(4088, Ordering::Relaxed),
            7,
            "little-endian low half"
        );
        assert_eq!(reader.len(), 4096);
    }

    #[test]
    fn an_object_smaller_than_the_mapping_is_refused_not_a_sigbus() {
        let fd = memfd(64);
        let error = SharedMemory::map(fd.as_fd(), 128, Access::ReadOnly).unwrap_err();
        assert!(
            matches!(
                error,
                ShmError::TooSmall {
                    size: 64,
                    needed: 128
                }
            ),
            "{error:?}"
        );
        assert!(matches!(
            SharedMemory::map(fd.as_fd(), 0, Access::ReadOnly),
            Err(ShmError::Empty)
        ));
    }

    #[test]
    fn an_object_its_holder_could_shrink_is_refused_by_map_fixed() {
        use rustix::fs::{MemfdFlags, SealFlags};
        // Unsealed: its holder could truncate it under the mapping.
        let unsealed = memfd(4096);
        assert!(matches!(
            SharedMemory::map_fixed(unsealed.as_fd(), 64, Access::ReadOnly),
            Err(ShmError::Resizable)
        ));
        // Sealed against growing only: still shrinkable.
        let sealable =
            rustix::fs::memfd_create("shm-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&sealable, 4096).unwrap();
        rustix::fs::fcntl_add_seals(&sealable, SealFlags::GROW).unwrap();
        assert!(matches!(
            SharedMemory::map_fixed(sealable.as_fd(), 64, Access::ReadOnly),
            Err(ShmError::Resizable)
        ));
        // A plain file is never sealed.
        let file = tempfile_of(4096);
        assert!(matches!(
            SharedMemory::map_fixed(file.as_fd(), 64, Access::ReadOnly),
            Err(ShmError::Resizable)
        ));
        // Sealed against shrinking: mapped, and it stays whole.
        rustix::fs::fcntl_add_seals(&sealable, SealFlags::SHRINK).unwrap();
        let map = SharedMemory::map_fixed(sealable.as_fd(), 64, Access::ReadOnly).unwrap();
        assert!(rustix::fs::ftruncate(&sealable, 0).is_err());
        assert_eq!(map.load_u64(56, Ordering::Relaxed), 0);
    }

    /// An unlinked regular file of `bytes` on the temporary file system.
    fn tempfile_of(bytes: u64) -> std::fs::File {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("shm-test-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(bytes).unwrap();
        file
    }

    #[test]
    fn a_descriptor_that_is_not_shared_memory_is_refused() {
        let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(matches!(
            SharedMemory::map(socket.as_fd(), 8, Access::ReadOnly),
            Err(ShmError::NotShareable)
        ));
    }

    #[test]
    fn accesses_are_bounds_and_alignment_checked() {
        let fd = memfd(4096);
        let map = SharedMemory::map(fd.as_fd(), 16, Access::ReadOnly).unwrap();
        let caught =
            |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        let load = |offset| {
            map.load_u64(offset, Ordering::Relaxed);
        };
        assert!(!caught(&|| load(8)));
        assert!(caught(&|| load(16)), "past the asked length");
        assert!(caught(&|| load(4)), "misaligned");
        assert!(
            caught(&|| {
                map.u64_at(0);
            }),
            "read-only"
        );
    }

    #[test]
    fn reads_a_bpf_array_size_from_fdinfo() {
        let info = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nmap_type:\t2\n\
                    key_size:\t4\nvalue_size:\t64\nmax_entries:\t96\nmap_flags:\t0x400\n";
        assert_eq!(bpf_array_size(info), Some(96 * 64));
        assert_eq!(
            bpf_array_size(&info.replace("map_type:\t2", "map_type:\t1")),
            None
        );
    }
}
