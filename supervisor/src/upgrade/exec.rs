//! The exec of an upgrade: the strings built first, then every descriptor closed on exec, the
//! signal mask emptied, and `execve(2)` in this very process.
//!
//! What the new image inherits: the pid (systemd's main pid), the environment as it is, the
//! standard streams, the children (the workers, adopted again), and nothing else. Descriptors the
//! supervisor opens are close-on-exec already (std, tokio, rustix and socket2 open them so, and
//! `bpf(2)` and `pidfd_open(2)` descriptors always are); [`mark_close_on_exec`] makes sure of it
//! before the exec, so that the `flock` of the instance lock, the sockets and the eBPF programs go
//! with the old image. Descriptors the supervisor inherited when it started without the flag (a
//! jobserver's pipe; systemd passes none) are closed too. Signal handlers are reset by `execve` itself; the mask, which it keeps, is
//! emptied.

use std::{
    ffi::{CString, OsString},
    io,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::Path,
};

/// Why an exec cannot be prepared.
#[derive(Debug, thiserror::Error)]
#[error("cannot pass {what} to execve: it holds a NUL byte")]
pub(super) struct PrepareError {
    what: String,
}

/// An `execve(2)` ready to go: every string it needs already built, so that nothing fails halfway.
#[derive(Debug)]
pub(super) struct Prepared {
    program: CString,
    args: Vec<CString>,
    env: Vec<CString>,
}

impl Prepared {
    /// `program` with `args` (the program's name first) and this process's environment as it is now.
    pub(super) fn new(program: &Path, args: &[OsString]) -> Result<Prepared, PrepareError> {
        let c_string = |bytes: Vec<u8>, what: &dyn Fn() -> String| {
            CString::new(bytes).map_err(|_| PrepareError { what: what() })
        };
        let program = c_string(program.as_os_str().as_bytes().to_vec(), &|| {
            format!("the program {}", program.display())
        })?;
        let args = args
            .iter()
            .map(|arg| {
                c_string(arg.as_bytes().to_vec(), &|| {
                    format!("the argument {}", arg.to_string_lossy())
                })
            })
            .collect::<Result<_, _>>()?;
        let env = std::env::vars_os()
            .map(|(name, value)| {
                let mut pair = name.clone().into_vec();
                pair.push(b'=');
                pair.extend_from_slice(value.as_bytes());
                c_string(pair, &|| {
                    format!("the environment variable {}", name.to_string_lossy())
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Prepared { program, args, env })
    }

    /// The program, for messages.
    pub(super) fn program_display(&self) -> std::borrow::Cow<'_, str> {
        self.program.to_string_lossy()
    }
}

/// Execs `prepared` in this process; returns only if `execve` failed, with why.
pub(super) fn replace_image(prepared: &Prepared) -> io::Error {
    for (fd, target) in mark_close_on_exec() {
        // Inherited at start (a test harness's or a make jobserver's pipe, say: systemd passes
        // none) or, were it one of the supervisor's own, a bug: either way not the new image's.
        tracing::info!(fd, %target, "Closing at the exec a descriptor that was not close-on-exec");
    }
    use nix::sys::signal::{SigSet, SigmaskHow, pthread_sigmask};
    if let Err(error) = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None) {
        tracing::warn!(%error, "Cannot empty the signal mask before the exec");
    }
    tracing::info!(program = %prepared.program.to_string_lossy(), "Executing the new program in place");
    match nix::unistd::execve(&prepared.program, &prepared.args, &prepared.env) {
        Err(errno) => io::Error::from(errno),
        Ok(never) => match never {},
    }
}

/// Sets close-on-exec on every descriptor above the standard streams that lacks it; returns those
/// it had to set, each with what it is (`/proc/self/fd`'s link).
pub(super) fn mark_close_on_exec() -> Vec<(i32, String)> {
    use std::os::fd::BorrowedFd;

    use rustix::io::FdFlags;
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let fds: Vec<i32> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    let mut marked = Vec::new();
    for fd in fds {
        // SAFETY: the borrow lives for these two calls only, on a number `/proc/self/fd` listed as
        // open. Should another thread close it meanwhile, the calls fail with EBADF; should the
        // number be reused at once, the new descriptor is marked, which it must be as well.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let Ok(flags) = rustix::io::fcntl_getfd(borrowed) else {
            continue;
        };
        if flags.contains(FdFlags::CLOEXEC) {
            continue;
        }
        if rustix::io::fcntl_setfd(borrowed, flags | FdFlags::CLOEXEC).is_ok() {
            let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            marked.push((fd, target));
        }
    }
    marked
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, AsRawFd};

    use rustix::io::FdFlags;

    use super::*;

    #[test]
    fn a_descriptor_without_close_on_exec_is_marked_and_named() {
        let file = tempfile::tempfile().unwrap();
        // dup(2) gives a descriptor without close-on-exec.
        let inherited = rustix::io::dup(file.as_fd()).unwrap();
        assert!(
            !rustix::io::fcntl_getfd(&inherited)
                .unwrap()
                .contains(FdFlags::CLOEXEC)
        );
        let marked = mark_close_on_exec();
        assert!(
            marked.iter().any(|(fd, _)| *fd == inherited.as_raw_fd()),
            "{marked:?}"
        );
        assert!(
            rustix::io::fcntl_getfd(&inherited)
                .unwrap()
                .contains(FdFlags::CLOEXEC)
        );
        assert!(
            rustix::io::fcntl_getfd(&file)
                .unwrap()
                .contains(FdFlags::CLOEXEC)
        );
    }

    #[test]
    fn an_argument_with_a_nul_byte_is_refused_before_anything_happens() {
        let args = [OsString::from("peregrine"), OsString::from("run\0x")];
        let error = Prepared::new(Path::new("/usr/bin/peregrine"), &args).unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot pass the argument run\0x to execve: it holds a NUL byte"
        );
        let fine = Prepared::new(Path::new("/usr/bin/peregrine"), &args[..1]).unwrap();
        assert_eq!(fine.args.len(), 1);
        assert!(!fine.env.is_empty() || std::env::vars_os().next().is_none());
    }
}
