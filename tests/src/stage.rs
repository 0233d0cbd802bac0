//! What the workers of another user run, where that user can reach it.
//!
//! The supervisor runs as root and starts a service's workers as its `user` (`nobody` in the
//! tests). A worker execs what its supervisor names: the built-in worker is the supervisor's own
//! binary (`current_exe`), a `command` whatever the config says (gunicorn, `register-as`,
//! `peregrine`). The kernel lets it only if every directory on the way grants that user search
//! permission, and the tests cannot choose where the checkout is: CI may clone it under `/root` or
//! into a `mktemp -d` directory (both 0700), and then no worker of another user runs anything under
//! `target/` nor reads the test applications in `tests/apps/`.
//!
//! A [`Stage`] answers for one account. [`Stage::program`] and [`Stage::tree`] return a path as it
//! is when the account may use it ([`usable`]: judged as the kernel judges a path, every directory
//! it walks through, symbolic links followed), else a copy in the stage: a directory of its own
//! that every user may enter (0755), in the first of `TMPDIR`, `/tmp` and `/var/tmp` the account
//! reaches, removed when the last clone of the stage is dropped. A copy is a hard link when the
//! file's own mode already grants the account what it needs (instant, even for the 200 MB debug
//! supervisor), else a real copy that every user may read (and execute, where its owner may), so
//! a checkout made under `umask 077` works too.
//!
//! gunicorn ([`Stage::gunicorn`]): a virtualenv's scripts do not move with it (their `#!` names
//! the original virtualenv's python), so a staged virtualenv runs as `<copy>/bin/python -m
//! gunicorn`. The copy's `bin/python` is still the symbolic link to the base python
//! (`/usr/bin/python3`, which `cargo xtask test` makes the test virtualenv from), and the
//! `pyvenv.cfg` beside it makes that python take the copy's `site-packages`. That is a few thousand
//! hard links, where a virtualenv made in the stage would take pip, and a network, per test.

use std::{
    collections::{BTreeMap, VecDeque},
    ffi::OsString,
    fs,
    io::Read,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Component, Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
};

use anyhow::{Context, bail, ensure};
use tempfile::TempDir;

use crate::{
    Account,
    paths::{gunicorn_command, test_app},
};

/// Read permission, in an `rwx` triplet.
pub const READ: u32 = 4;
/// Execute permission, or search for a directory, in an `rwx` triplet.
pub const EXECUTE: u32 = 1;

/// How many symbolic links the kernel follows in one path (`MAXSYMLINKS`).
const MAX_LINKS: u32 = 40;

/// Copies of what an account could not reach otherwise, in a directory it may enter; cloned, it is
/// the same stage, removed when the last clone is dropped.
#[derive(Clone, Debug)]
pub struct Stage {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    account: Account,
    /// Where the stage and [`Stage::open_temp_dir`]'s directories are made.
    base: PathBuf,
    dir: TempDir,
    /// Each path asked for and the path to use for it: itself, or its copy in `dir`.
    staged: Mutex<BTreeMap<PathBuf, PathBuf>>,
}

// === impl Stage ===

impl Stage {
    /// An empty stage for `account`.
    ///
    /// # Panics
    ///
    /// When no temporary directory is reachable by `account` (see [`Stage::try_new`]).
    #[track_caller]
    pub fn new(account: &Account) -> Stage {
        Stage::try_new(account)
            .unwrap_or_else(|error| panic!("a stage for {}: {error:#}", account.name))
    }

    /// An empty stage for `account`, in the first of `TMPDIR` (or `/tmp` when unset), `/tmp` and
    /// `/var/tmp` that `account` may reach and this process may write.
    pub fn try_new(account: &Account) -> anyhow::Result<Stage> {
        let mut refused = Vec::new();
        for base in [std::env::temp_dir(), "/tmp".into(), "/var/tmp".into()] {
            let made = usable(account, &base, EXECUTE)
                .and_then(|()| open_temp_dir_in(&base, "peregrine-stage-"));
            match made {
                Ok(dir) => {
                    return Ok(Stage {
                        inner: Arc::new(Inner {
                            account: account.clone(),
                            base,
                            dir,
                            staged: Mutex::default(),
                        }),
                    });
                }
                Err(error) => refused.push(format!("{}: {error:#}", base.display())),
            }
        }
        bail!("no temporary directory to use: {}", refused.join("; "))
    }

    /// The account it stages for.
    pub fn account(&self) -> &Account {
        &self.inner.account
    }

    /// The stage's directory.
    pub fn dir(&self) -> &Path {
        self.inner.dir.path()
    }

    /// A new empty directory, named `PREFIX...`, that every user may enter (0755), beside the stage
    /// (so the account reaches it too): for a supervisor's control socket and logs, or files its
    /// workers read. Removed when dropped.
    ///
    /// # Panics
    ///
    /// When it cannot be made.
    #[track_caller]
    pub fn open_temp_dir(&self, prefix: &str) -> TempDir {
        open_temp_dir_in(&self.inner.base, prefix).unwrap_or_else(|error| {
            panic!("a directory in {}: {error:#}", self.inner.base.display())
        })
    }

    /// `program` when the account may execute it, else its copy in the stage (the same file name).
    /// Only the file itself is judged: a script's interpreter is the caller's to stage (see
    /// [`Stage::gunicorn`]).
    ///
    /// # Panics
    ///
    /// When it cannot be copied.
    #[track_caller]
    pub fn program(&self, program: &Path) -> PathBuf {
        let account = self.account();
        self.stage(
            program,
            || usable(account, program, EXECUTE),
            |from, to| copy_file(account, from, to, EXECUTE),
        )
        .unwrap_or_else(|error| panic!("staging {}: {error:#}", program.display()))
    }

    /// The directory `dir` when the account may read and enter it and everything in it, else its
    /// copy in the stage (symbolic links copied as they are).
    ///
    /// # Panics
    ///
    /// When it cannot be copied.
    #[track_caller]
    pub fn tree(&self, dir: &Path) -> PathBuf {
        let account = self.account();
        self.stage(
            dir,
            || tree_usable(account, dir),
            |from, to| copy_tree(account, from, to),
        )
        .unwrap_or_else(|error| panic!("staging {}: {error:#}", dir.display()))
    }

    /// The program and arguments that start `gunicorn` (the script in a virtualenv's `bin`) as the
    /// account: the script itself when the account may run it, the python its `#!` names and
    /// everything in its virtualenv; else `<copy>/bin/python -m gunicorn` from the virtualenv's
    /// copy in the stage.
    ///
    /// # Panics
    ///
    /// When the script is in no virtualenv, or it cannot be copied.
    #[track_caller]
    pub fn gunicorn(&self, gunicorn: &Path) -> Vec<String> {
        let venv = gunicorn
            .parent()
            .and_then(Path::parent)
            .filter(|venv| venv.join("pyvenv.cfg").is_file())
            .unwrap_or_else(|| panic!("{} is in no virtualenv", gunicorn.display()));
        let account = self.account();
        let as_it_is = || -> anyhow::Result<()> {
            usable(account, gunicorn, READ | EXECUTE)?;
            if let Some(python) = interpreter(gunicorn)? {
                usable(account, &python, EXECUTE)?;
            }
            tree_usable(account, venv)
        };
        let staged = self
            .stage(venv, as_it_is, |from, to| copy_tree(account, from, to))
            .unwrap_or_else(|error| panic!("staging {}: {error:#}", venv.display()));
        if staged == venv {
            vec![gunicorn.display().to_string()]
        } else {
            let python = staged.join("bin/python");
            vec![python.display().to_string(), "-m".into(), "gunicorn".into()]
        }
    }

    /// [`gunicorn_command`] (gunicorn on the WSGI test application) as the account may run it:
    /// gunicorn from [`Stage::gunicorn`], the application's directory from [`Stage::tree`].
    #[track_caller]
    pub fn gunicorn_command(&self, gunicorn: &Path) -> Vec<String> {
        let mut command = self.gunicorn(gunicorn);
        let mut arguments: Vec<String> = gunicorn_command(gunicorn).into_iter().skip(1).collect();
        let chdir = arguments
            .iter()
            .position(|argument| argument == "--chdir")
            .expect("gunicorn_command sets --chdir")
            + 1;
        arguments[chdir] = self.tree(&test_app("")).display().to_string();
        command.extend(arguments);
        command
    }

    /// The path to use for `source`: itself when `as_it_is` finds the account may use it, else
    /// its copy (made by `copy`) in the stage. Each source is judged and copied once.
    fn stage(
        &self,
        source: &Path,
        as_it_is: impl FnOnce() -> anyhow::Result<()>,
        copy: impl FnOnce(&Path, &Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<PathBuf> {
        let mut staged = self
            .inner
            .staged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(path) = staged.get(source) {
            return Ok(path.clone());
        }
        let path = match as_it_is() {
            Ok(()) => source.to_path_buf(),
            Err(why) => {
                let name = source
                    .file_name()
                    .with_context(|| format!("{} names no file", source.display()))?;
                // The same file name, so that a program's name (its `comm`) stays what it was.
                let mut to = self.dir().join(name);
                if to.symlink_metadata().is_ok() {
                    let dir = self.dir().join(staged.len().to_string());
                    fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
                    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
                    to = dir.join(name);
                }
                copy(source, &to)
                    .with_context(|| format!("copying {} to {}", source.display(), to.display()))?;
                eprintln!(
                    "staged {} as {} for {}: {why:#}",
                    source.display(),
                    to.display(),
                    self.account().name
                );
                to
            }
        };
        staged.insert(source.to_path_buf(), path.clone());
        Ok(path)
    }
}

/// A new directory `PREFIX...` in `base`, mode 0755.
fn open_temp_dir_in(base: &Path, prefix: &str) -> anyhow::Result<TempDir> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .with_context(|| format!("creating a directory in {}", base.display()))?;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod 0755 {}", dir.path().display()))?;
    Ok(dir)
}

/// Whether `account`, holding no capability (as every worker), may use `path` for `access`
/// ([`READ`], [`EXECUTE`] or both), as the kernel judges it: every directory it looks a name up in,
/// walking the path and every symbolic link on it wherever it points, must grant the account
/// search; what it reaches must grant `access` ([`Account::may`]; no ACLs, no mount options).
/// The error names the first directory or file that refuses.
pub fn usable(account: &Account, path: &Path, access: u32) -> anyhow::Result<()> {
    let reached = resolve(account, path)?;
    let meta = fs::metadata(&reached).with_context(|| format!("reading {}", reached.display()))?;
    ensure!(
        account.may(access, ids(&meta)),
        "{} may not {} {}{}",
        account.name,
        verb(access, meta.is_dir()),
        reached.display(),
        mode_text(&meta)
    );
    Ok(())
}

/// What `path` names, walked as the kernel walks it for `account`: component by component from `/`
/// (a relative path from the current directory), each directory a name is looked up in checked for
/// search permission, each symbolic link replaced by its target (from `/` when absolute, else from
/// the directory it is in), `..` taken after the links before it.
fn resolve(account: &Account, path: &Path) -> anyhow::Result<PathBuf> {
    let path =
        std::path::absolute(path).with_context(|| format!("making {} absolute", path.display()))?;
    let mut pending = names(&path);
    let mut at = PathBuf::from("/");
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        // `at` is a directory reached through no symbolic link: its metadata are its own.
        let meta = fs::metadata(&at).with_context(|| format!("reading {}", at.display()))?;
        ensure!(meta.is_dir(), "{} is not a directory", at.display());
        ensure!(
            account.may(EXECUTE, ids(&meta)),
            "{} may not search {}{} (on the way to {})",
            account.name,
            at.display(),
            mode_text(&meta),
            path.display()
        );
        if name == ".." {
            at.pop();
            continue;
        }
        let next = at.join(&name);
        let meta =
            fs::symlink_metadata(&next).with_context(|| format!("reading {}", next.display()))?;
        if !meta.file_type().is_symlink() {
            at = next;
            continue;
        }
        links += 1;
        ensure!(
            links <= MAX_LINKS,
            "more than {MAX_LINKS} symbolic links in {}",
            path.display()
        );
        let target = fs::read_link(&next).with_context(|| format!("reading {}", next.display()))?;
        if target.has_root() {
            at = PathBuf::from("/");
        }
        for name in names(&target).into_iter().rev() {
            pending.push_front(name);
        }
    }
    Ok(at)
}

/// The names to look up for `path`, in order (`..` kept, `.` and the root left out).
fn names(path: &Path) -> VecDeque<OsString> {
    path.components()
        .filter_map(|component| match component {
            Component::Normal(name) => Some(name.to_owned()),
            Component::ParentDir => Some("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect()
}

/// Whether `account` may read and enter `dir`, read every file in it and below, and execute those
/// whose owner may; a symbolic link is judged by what it points to, wherever that is (a dangling
/// one is passed over: it is of no use to anyone).
fn tree_usable(account: &Account, dir: &Path) -> anyhow::Result<()> {
    usable(account, dir, READ | EXECUTE)?;
    entries_usable(account, dir)
}

/// [`tree_usable`] for what is in `dir`, which the account may read and enter.
fn entries_usable(account: &Account, dir: &Path) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let meta =
            fs::symlink_metadata(&path).with_context(|| format!("reading {}", path.display()))?;
        if meta.file_type().is_symlink() {
            if let Ok(target) = fs::metadata(&path) {
                usable(account, &path, needed(&target))?;
            }
            continue;
        }
        ensure!(
            account.may(needed(&meta), ids(&meta)),
            "{} may not {} {}{}",
            account.name,
            verb(needed(&meta), meta.is_dir()),
            path.display(),
            mode_text(&meta)
        );
        if meta.is_dir() {
            entries_usable(account, &path)?;
        }
    }
    Ok(())
}

/// Copies the directory `from` to `to` (which must not exist), every directory 0755, every file
/// by [`copy_file`], symbolic links as they are (an absolute one points where it did, a relative
/// one into the copy); other kinds of file (sockets, pipes) are left out.
fn copy_tree(account: &Account, from: &Path, to: &Path) -> anyhow::Result<()> {
    fs::create_dir(to).with_context(|| format!("creating {}", to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(0o755))?;
    for entry in fs::read_dir(from).with_context(|| format!("listing {}", from.display()))? {
        let entry = entry?;
        let (source, copy) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type()?;
        if kind.is_symlink() {
            let target = fs::read_link(&source)?;
            std::os::unix::fs::symlink(&target, &copy)
                .with_context(|| format!("linking {} to {}", copy.display(), target.display()))?;
        } else if kind.is_dir() {
            copy_tree(account, &source, &copy)?;
        } else if kind.is_file() {
            let meta = fs::metadata(&source)?;
            copy_file(account, &source, &copy, needed(&meta))?;
        }
    }
    Ok(())
}

/// Puts the file `from` at `to`: a hard link when the file's own mode already grants `account`
/// `access` and both are on one filesystem, else a copy that every user may read, and execute
/// where the owner may.
fn copy_file(account: &Account, from: &Path, to: &Path, access: u32) -> anyhow::Result<()> {
    let meta = fs::metadata(from).with_context(|| format!("reading {}", from.display()))?;
    if account.may(access, ids(&meta)) && fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    let executable = if meta.mode() & 0o100 != 0 { 0o111 } else { 0 };
    let mode = meta.mode() & 0o777 | 0o444 | executable;
    fs::set_permissions(to, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", to.display()))
}

/// The interpreter the `#!` line of `script` names, if it starts with one.
fn interpreter(script: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut head = [0u8; 256];
    let read = fs::File::open(script)
        .and_then(|mut file| file.read(&mut head))
        .with_context(|| format!("reading {}", script.display()))?;
    let head = &head[..read];
    let Some(line) = head.strip_prefix(b"#!") else {
        return Ok(None);
    };
    let line = line.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    Ok(line.split_whitespace().next().map(PathBuf::from))
}

/// What a file of `meta` must grant to be of use: read and enter a directory, read a file, and
/// execute it too when its owner may.
fn needed(meta: &fs::Metadata) -> u32 {
    if meta.is_dir() || meta.mode() & 0o100 != 0 {
        READ | EXECUTE
    } else {
        READ
    }
}

/// Owner, group and mode of a file, as [`Account::may`] takes them.
fn ids(meta: &fs::Metadata) -> (u32, u32, u32) {
    (meta.uid(), meta.gid(), meta.mode())
}

/// ` (mode 700, owner 0, group 0)`, for messages.
fn mode_text(meta: &fs::Metadata) -> String {
    format!(
        " (mode {:o}, owner {}, group {})",
        meta.mode() & 0o7777,
        meta.uid(),
        meta.gid()
    )
}

/// What `access` is called, for messages.
fn verb(access: u32, dir: bool) -> &'static str {
    match (access & READ != 0, access & EXECUTE != 0, dir) {
        (true, true, true) => "read and enter",
        (true, true, false) => "read and execute",
        (false, true, true) => "search",
        (false, true, false) => "execute",
        _ => "read",
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn nobody() -> Account {
        Account {
            name: "nobody".into(),
            uid: 65534,
            gid: 65534,
            groups: [65534].into(),
        }
    }

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A tree of this process's user, as a checkout in a directory only its owner may enter:
    /// `closed/` (0700) holding `bin/tool` (0755), `apps/app.py` (0644) and `venv/` whose
    /// `bin/python` links to `/bin/sh` and whose `bin/gunicorn` names that python in its `#!`.
    fn closed_checkout(top: &Path) -> PathBuf {
        let closed = top.join("closed");
        for dir in ["bin", "apps", "venv/bin"] {
            fs::create_dir_all(closed.join(dir)).unwrap();
        }
        fs::write(closed.join("bin/tool"), "#!/bin/sh\necho tool\n").unwrap();
        chmod(&closed.join("bin/tool"), 0o755);
        fs::write(closed.join("apps/app.py"), "print(1)\n").unwrap();
        fs::write(closed.join("venv/pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        symlink("/bin/sh", closed.join("venv/bin/python")).unwrap();
        let gunicorn = closed.join("venv/bin/gunicorn");
        fs::write(
            &gunicorn,
            format!(
                "#!{}\nimport gunicorn\n",
                closed.join("venv/bin/python").display()
            ),
        )
        .unwrap();
        chmod(&gunicorn, 0o755);
        chmod(&closed, 0o700);
        closed
    }

    #[test]
    fn a_path_is_judged_by_every_directory_on_the_way_and_every_link_followed() {
        let top = tempfile::tempdir().unwrap();
        chmod(top.path(), 0o755);
        let closed = closed_checkout(top.path());
        let nobody = nobody();
        let tool = closed.join("bin/tool");
        let error = usable(&nobody, &tool, EXECUTE).unwrap_err().to_string();
        assert!(
            error.contains(&format!("may not search {}", closed.display())),
            "{error}"
        );
        assert!(usable(&nobody, Path::new("/bin/sh"), EXECUTE).is_ok());
        // Opened: the tool is reached; through `..` and a link out of the open part, it is not.
        chmod(&closed, 0o755);
        assert!(usable(&nobody, &tool, READ | EXECUTE).is_ok());
        let inner = closed.join("inner");
        fs::create_dir(&inner).unwrap();
        chmod(&inner, 0o700);
        assert!(usable(&nobody, &inner.join("../bin/tool"), EXECUTE).is_err());
        symlink(&inner, top.path().join("link")).unwrap();
        fs::write(inner.join("file"), "").unwrap();
        let error = usable(&nobody, &top.path().join("link/file"), READ)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(&format!("search {}", inner.display())),
            "{error}"
        );
        // A relative link is followed from its own directory.
        symlink("bin/tool", closed.join("tool")).unwrap();
        assert!(usable(&nobody, &closed.join("tool"), EXECUTE).is_ok());
        chmod(&tool, 0o700);
        assert!(usable(&nobody, &closed.join("tool"), EXECUTE).is_err());
    }

    #[test]
    fn what_nobody_cannot_reach_is_staged_and_what_it_can_is_not() {
        let top = tempfile::tempdir().unwrap();
        chmod(top.path(), 0o755);
        let closed = closed_checkout(top.path());
        let nobody = nobody();
        let stage = Stage::new(&nobody);
        assert_eq!(stage.program(Path::new("/bin/sh")), Path::new("/bin/sh"));

        let tool = stage.program(&closed.join("bin/tool"));
        assert_eq!(tool, stage.dir().join("tool"));
        assert!(usable(&nobody, &tool, READ | EXECUTE).is_ok());
        assert_eq!(stage.program(&closed.join("bin/tool")), tool, "staged once");
        let apps = stage.tree(&closed.join("apps"));
        assert!(usable(&nobody, &apps.join("app.py"), READ).is_ok());

        let command = stage.gunicorn(&closed.join("venv/bin/gunicorn"));
        let venv = stage.dir().join("venv");
        assert_eq!(
            command,
            [
                venv.join("bin/python").display().to_string(),
                "-m".into(),
                "gunicorn".into()
            ]
        );
        assert_eq!(
            fs::read_link(venv.join("bin/python")).unwrap(),
            Path::new("/bin/sh")
        );
        assert!(venv.join("pyvenv.cfg").is_file());
        assert!(usable(&nobody, &venv.join("bin/python"), EXECUTE).is_ok());

        // A file only its owner may read is copied, readable by all, not linked.
        let secret = closed.join("apps/secret.py");
        fs::write(&secret, "").unwrap();
        chmod(&secret, 0o600);
        let copy = stage.tree(&closed.join("apps/"));
        assert_eq!(copy, apps, "the same directory, written with a slash");
        let other = Stage::new(&nobody);
        let copy = other.tree(&closed.join("apps"));
        let meta = fs::metadata(copy.join("secret.py")).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o644);
        assert_ne!(meta.ino(), fs::metadata(&secret).unwrap().ino());

        // Once the checkout is open, nothing is staged.
        chmod(&closed, 0o755);
        chmod(&secret, 0o644);
        let open = Stage::new(&nobody);
        assert_eq!(
            open.program(&closed.join("bin/tool")),
            closed.join("bin/tool")
        );
        assert_eq!(
            open.gunicorn(&closed.join("venv/bin/gunicorn")),
            [closed.join("venv/bin/gunicorn").display().to_string()]
        );
        let dir = open.dir().to_path_buf();
        drop(open);
        assert!(!dir.exists(), "a stage is removed when dropped");
    }

    #[test]
    fn the_interpreter_is_read_from_the_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("script");
        fs::write(&script, "#!/venv/bin/python -E\nimport sys\n").unwrap();
        assert_eq!(
            interpreter(&script).unwrap(),
            Some(PathBuf::from("/venv/bin/python"))
        );
        fs::write(&script, "\x7fELF").unwrap();
        assert_eq!(interpreter(&script).unwrap(), None);
    }
}
