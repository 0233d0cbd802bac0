//! [`Root`]: a minimal Debian 12 root to run commands in as on a freshly installed machine.
//!
//! ```text
//! let root = fresh::Root::builder("package-test")   // lives in target/fresh/package-test/root
//!     .packages(&["ca-certificates"])               // apt-get installed into it
//!     .rust_toolchain()                             // optional: the host's toolchain at /opt/rust
//!     .prepare()?;                                  // from the cached debootstrap tarball
//! root.copy_in(&deb, "/tmp/peregrine.deb")?;        // a host file or folder, into the root
//! root.run("apt-get install -y /tmp/peregrine.deb")?;             // sh -c, in the chroot, checked
//! let out = root.transcript("peregrine --version", Duration::from_secs(60))?; // shown and kept
//! let mut command = root.command("peregrine");      // a chroot Command to finish yourself
//! drop(root);                                       // processes killed, mounts gone, root deleted
//! ```
//!
//! [`Builder::prepare`] (as root) installs `debootstrap` on the host when missing, makes or reuses
//! the base tarball ([`super::base`]), unpacks it, points apt at the host's Debian mirror, copies in
//! `/etc/resolv.conf` and the host's CA bundle (the file `SSL_CERT_FILE` names), binds the root on
//! itself (so that `/` is a mount point, as `ip netns` needs), mounts a new `/proc` and binds `/sys`
//! and `/dev` (slave binds: for eBPF), and installs the packages asked for
//! with `apt-get --no-install-recommends`. Services are not started in the root (a `policy-rc.d`
//! that says no). Every command runs through `chroot` with a clean environment ([`Root::env`]):
//! `PATH`, `HOME=/root`, `LANG=C.UTF-8`, the CA bundle in `SSL_CERT_FILE`, `CARGO_HTTP_CAINFO`,
//! `PIP_CERT` and `GIT_SSL_CAINFO`, and with the toolchain `CARGO_HOME=/root/.cargo` (writable, in
//! the root: crates are downloaded for real) and `/opt/rust/bin` first on `PATH`.
//!
//! Dropping the root, also on an error or after an interrupt, kills every process whose root is in
//! it, unmounts everything under it and deletes it only once `/proc/self/mountinfo` shows nothing
//! mounted there ([`super::mounts::remove`]); the logs beside it stay. A root left by a run that was
//! killed outright is removed the same way by the next `prepare` of that name.

use std::{
    fs,
    io::{BufRead, BufReader, Write as _},
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use peregrine_testenv::target_dir;
use rustix::process::{Pid, Signal, kill_process_group};
use xtask::{interrupt, packages};

use super::{base, mirror::Mirror, mounts};

/// The chroot program (coreutils).
const CHROOT: &str = "/usr/sbin/chroot";
/// Where the host's CA bundle is copied in the root: not the root's own
/// `/etc/ssl/certs/ca-certificates.crt`, which installing `ca-certificates` rewrites.
pub(crate) const CA_BUNDLE: &str = "/etc/ssl/host-ca-bundle.crt";
/// Where the host's Rust toolchain (its sysroot) is bound, read-only.
pub(crate) const TOOLCHAIN: &str = "/opt/rust";
/// `PATH` in the root, without the toolchain.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long the processes a finished command left behind may keep its output open.
const OUTPUT_GRACE: Duration = Duration::from_secs(5);

/// What to make: see [`Root::builder`].
#[derive(Debug)]
pub(crate) struct Builder {
    name: String,
    packages: Vec<String>,
    rust: bool,
}

/// A prepared root; torn down on drop. See the module's documentation.
#[derive(Debug)]
pub(crate) struct Root {
    /// `target/fresh/<name>`: the root and the logs of its set-up.
    dir: PathBuf,
    /// `<dir>/root`, resolved.
    root: PathBuf,
    /// The environment of every command in the root.
    env: Vec<(String, String)>,
    /// Each set-up phase and how long it took.
    phases: Vec<(String, Duration)>,
}

/// A command's merged stdout and stderr, and how it exited.
#[derive(Debug)]
pub(crate) struct Transcript {
    pub(crate) status: ExitStatus,
    pub(crate) text: String,
}

// === impl Builder ===

impl Builder {
    /// Debian packages to `apt-get install --no-install-recommends` into the root.
    pub(crate) fn packages(mut self, packages: &[&str]) -> Self {
        self.packages
            .extend(packages.iter().map(|&package| package.to_owned()));
        self
    }

    /// Binds the host's Rust toolchain (`rustc --print sysroot`) read-only at `/opt/rust`, with its
    /// `bin` first on `PATH` and a writable `CARGO_HOME` in the root.
    pub(crate) fn rust_toolchain(mut self) -> Self {
        self.rust = true;
        self
    }

    /// Makes the root; see the module's documentation. Needs root.
    pub(crate) fn prepare(self) -> anyhow::Result<Root> {
        ensure!(
            rustix::process::geteuid().is_root(),
            "a fresh root needs root (debootstrap, mounts, chroot)"
        );
        packages::ensure(packages::FRESH)?;
        let mirror = Mirror::of_host();
        let started = Instant::now();
        let made = base::ensure(&mirror.archive)?;
        let base_phase = if made {
            format!("debootstrap, cached in {}", base::tarball().display())
        } else {
            format!("base root from {}", base::tarball().display())
        };
        let dir = target_dir().join("fresh").join(&self.name);
        let root = dir.join("root");
        // What a run killed outright left.
        mounts::remove(&root)?;
        fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        let root = root.canonicalize()?;
        let mut this = Root {
            dir,
            root,
            env: Vec::new(),
            phases: Vec::new(),
        };
        // From here on, dropping `this` tears down whatever was set up.
        base::extract(&this.root)?;
        this.phases.push((base_phase, started.elapsed()));
        this.configure(&mirror, self.rust)?;
        this.mount(&self.name, self.rust)?;
        if !self.packages.is_empty() {
            let started = Instant::now();
            this.apt_get(&self.packages)?;
            this.phases.push((
                format!(
                    "apt-get install --no-install-recommends {}",
                    self.packages.join(" ")
                ),
                started.elapsed(),
            ));
        }
        Ok(this)
    }
}

// === impl Root ===

impl Root {
    /// A root named `name`, made in `target/fresh/<name>/root`: two roots of different names can
    /// live side by side.
    pub(crate) fn builder(name: &str) -> Builder {
        Builder {
            name: name.to_owned(),
            packages: Vec::new(),
            rust: false,
        }
    }

    /// The root's folder on the host.
    pub(crate) fn path(&self) -> &Path {
        &self.root
    }

    /// The folder beside the root for logs (`target/fresh/<name>`); it outlives the root.
    pub(crate) fn log_dir(&self) -> &Path {
        &self.dir
    }

    /// The host path of `inside`, a path in the root (`/etc/hosts`).
    pub(crate) fn host_path(&self, inside: &str) -> PathBuf {
        self.root.join(inside.trim_start_matches('/'))
    }

    /// The environment every command in the root gets, and nothing else.
    #[allow(dead_code, reason = "the root's API: for the package test")]
    pub(crate) fn env(&self) -> &[(String, String)] {
        &self.env
    }

    /// The set-up's phases and how long each took.
    pub(crate) fn phases(&self) -> &[(String, Duration)] {
        &self.phases
    }

    /// Copies the host file or folder `from` to `inside` (a path in the root, replaced if there),
    /// keeping modes; returns its host path.
    pub(crate) fn copy_in(&self, from: &Path, inside: &str) -> anyhow::Result<PathBuf> {
        let target = self.writable(inside)?;
        xtask::run_checked(Command::new("cp").arg("-aT").arg(from).arg(&target))?;
        Ok(target)
    }

    /// Writes `contents` to `inside` (a path in the root, replaced if there).
    pub(crate) fn write(&self, inside: &str, contents: &str) -> anyhow::Result<PathBuf> {
        let target = self.writable(inside)?;
        fs::write(&target, contents).with_context(|| format!("writing {}", target.display()))?;
        Ok(target)
    }

    /// `program` run in the root by chroot, with [`Self::env`] alone, in a process group of its
    /// own (Ctrl-C reaches the xtask, which stops it). Add arguments and run it.
    pub(crate) fn command(&self, program: &str) -> Command {
        let mut command = Command::new(CHROOT);
        command
            .arg(&self.root)
            .arg(program)
            .env_clear()
            .envs(self.env.iter().map(|(key, value)| (key, value)))
            .current_dir("/")
            .process_group(0);
        command
    }

    /// Runs `script` with `sh -c` in the root, its output shown; an error unless it exits 0.
    #[allow(dead_code, reason = "the root's API: for the package test")]
    pub(crate) fn run(&self, script: &str) -> anyhow::Result<()> {
        let mut command = self.command("/bin/sh");
        command.args(["-c", script]);
        let child = command
            .spawn()
            .with_context(|| format!("running {script:?} in {}", self.root.display()))?;
        let status = self.wait(child, None, script)?;
        ensure!(
            status.success(),
            "{script:?} failed in {}: {status}",
            self.root.display()
        );
        Ok(())
    }

    /// Runs `script` with `sh -c` in the root, its stdout and stderr merged, shown line by line as
    /// they come, and kept; an error (with the output's last lines) when it runs past `deadline` or
    /// a signal comes, not when it fails.
    pub(crate) fn transcript(
        &self,
        script: &str,
        deadline: Duration,
    ) -> anyhow::Result<Transcript> {
        let (reader, writer) = std::io::pipe().context("making a pipe")?;
        let child = {
            let mut command = self.command("/bin/sh");
            command
                .args(["-c", script])
                .stdin(Stdio::null())
                .stdout(writer.try_clone()?)
                .stderr(writer);
            command
                .spawn()
                .with_context(|| format!("running {script:?} in {}", self.root.display()))?
            // The command, and with it the parent's copies of the pipe's write end, is dropped
            // here: the reader sees the end once the script and its children are gone.
        };
        let (lines_tx, lines_rx) = std::sync::mpsc::channel::<String>();
        let reading = std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                println!("{line}");
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let waited = self.wait(child, Some(deadline), script);
        // Processes the script left behind may hold the pipe: they get a moment, then SIGKILL.
        let grace = Instant::now() + OUTPUT_GRACE;
        while !reading.is_finished() && Instant::now() < grace {
            std::thread::sleep(Duration::from_millis(50));
        }
        if !reading.is_finished() {
            mounts::kill_processes_in(&self.root)?;
        }
        let _ = reading.join();
        let text = lines_rx.try_iter().collect::<Vec<_>>().join("\n");
        match waited {
            Ok(status) => Ok(Transcript { status, text }),
            Err(error) => {
                let tail = text.lines().rev().take(40).collect::<Vec<_>>();
                let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
                Err(error.context(format!("its output ended with:\n{tail}")))
            }
        }
    }

    /// Waits for `child` (a process group leader), killing its group when `deadline` passes or a
    /// signal comes.
    fn wait(
        &self,
        mut child: Child,
        deadline: Option<Duration>,
        what: &str,
    ) -> anyhow::Result<ExitStatus> {
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            let stop = match interrupt::check() {
                Err(error) => Some(error),
                Ok(()) if deadline.is_some_and(|deadline| started.elapsed() >= deadline) => Some(
                    anyhow::anyhow!("{what:?} ran past {:?}", deadline.unwrap_or_default()),
                ),
                Ok(()) => None,
            };
            if let Some(error) = stop {
                if let Some(group) = Pid::from_raw(child.id() as i32) {
                    let _ = kill_process_group(group, Signal::KILL);
                }
                let _ = child.wait();
                return Err(error);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The host path of `inside`, ready to be written: its folder made, whatever is there removed
    /// (a symbolic link there is replaced, not followed), and the folder seen to be in the root.
    fn writable(&self, inside: &str) -> anyhow::Result<PathBuf> {
        let target = self.host_path(inside);
        let folder = target
            .parent()
            .with_context(|| format!("{inside} has no folder"))?;
        fs::create_dir_all(folder).with_context(|| format!("creating {}", folder.display()))?;
        ensure!(
            folder.canonicalize()?.starts_with(&self.root),
            "{inside} is outside the root {} (through a symbolic link)",
            self.root.display()
        );
        match fs::symlink_metadata(&target) {
            Ok(meta) if meta.is_dir() => fs::remove_dir_all(&target)?,
            Ok(_) => fs::remove_file(&target)?,
            Err(_) => {}
        }
        Ok(target)
    }

    /// Apt's sources, DNS, the CA bundle, no service starts, and the environment.
    fn configure(&mut self, mirror: &Mirror, rust: bool) -> anyhow::Result<()> {
        self.write("/etc/apt/sources.list", &mirror.sources_list())?;
        let resolv = fs::read_to_string("/etc/resolv.conf").context("reading /etc/resolv.conf")?;
        self.write("/etc/resolv.conf", &resolv)?;
        if !self.host_path("/etc/hosts").exists() {
            self.write(
                "/etc/hosts",
                "127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n",
            )?;
        }
        // Package scripts must not start services in the root (invoke-rc.d asks this first).
        let policy = self.write("/usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n")?;
        fs::set_permissions(&policy, fs::Permissions::from_mode(0o755))?;

        let mut path = PATH.to_owned();
        let mut env = vec![
            ("HOME", "/root".to_owned()),
            ("USER", "root".to_owned()),
            ("LOGNAME", "root".to_owned()),
            ("LANG", "C.UTF-8".to_owned()),
            ("TERM", "dumb".to_owned()),
        ];
        if let Some(bundle) = host_ca_bundle() {
            self.copy_in(&bundle, CA_BUNDLE)?;
            for var in [
                "SSL_CERT_FILE",
                "CARGO_HTTP_CAINFO",
                "PIP_CERT",
                "GIT_SSL_CAINFO",
            ] {
                env.push((var, CA_BUNDLE.to_owned()));
            }
        }
        if rust {
            fs::create_dir_all(self.host_path(TOOLCHAIN))?;
            fs::create_dir_all(self.host_path("/root/.cargo"))?;
            path = format!("{TOOLCHAIN}/bin:{path}");
            env.push(("CARGO_HOME", "/root/.cargo".to_owned()));
        }
        env.push(("PATH", path));
        self.env = env
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value))
            .collect();
        Ok(())
    }

    /// The root on itself, `/proc`, `/sys`, `/dev` (with `/dev/pts` and `/dev/shm`), apt's
    /// downloads, the toolchain.
    fn mount(&self, name: &str, rust: bool) -> anyhow::Result<()> {
        // A root that is a mount point, as on a machine: `ip netns exec` makes `/` a slave mount,
        // which fails on a plain folder.
        mounts::bind(&self.root, &self.root)?;
        mounts::mount_proc(&self.host_path("/proc"))?;
        mounts::bind_tree(Path::new("/sys"), &self.host_path("/sys"))?;
        mounts::bind_tree(Path::new("/dev"), &self.host_path("/dev"))?;
        let archives = base::apt_archives(name);
        fs::create_dir_all(archives.join("partial"))
            .with_context(|| format!("creating {}", archives.display()))?;
        mounts::bind(&archives, &self.host_path("/var/cache/apt/archives"))?;
        if rust {
            mounts::bind_read_only(&sysroot()?, &self.host_path(TOOLCHAIN))?;
        }
        Ok(())
    }

    /// `apt-get update` and `apt-get install --no-install-recommends packages` in the root,
    /// their output in `<log dir>/apt.log` (its end shown on failure).
    fn apt_get(&self, packages: &[String]) -> anyhow::Result<()> {
        let log_path = self.dir.join("apt.log");
        let mut log = fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        for args in [
            vec!["update".to_owned()],
            ["install", "-y", "--no-install-recommends"]
                .into_iter()
                .map(str::to_owned)
                .chain(packages.iter().cloned())
                .collect(),
        ] {
            writeln!(log, "$ apt-get {}", args.join(" "))?;
            let mut command = self.command("apt-get");
            command
                .args(&args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log.try_clone()?);
            let child = command.spawn().context("running apt-get in the root")?;
            let status = self.wait(child, None, "apt-get")?;
            if !status.success() {
                let text = fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                bail!(
                    "apt-get {} failed in the root: {status}; the end of {}:\n{}",
                    args.join(" "),
                    log_path.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
        Ok(())
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        if let Err(error) = mounts::remove(&self.root) {
            eprintln!(
                "error: tearing down the fresh root {}: {error:#}",
                self.root.display()
            );
        }
    }
}

/// The host's CA bundle: the file `SSL_CERT_FILE` names, else Debian's.
fn host_ca_bundle() -> Option<PathBuf> {
    std::env::var_os("SSL_CERT_FILE")
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from("/etc/ssl/certs/ca-certificates.crt")))
        .filter(|path| path.is_file())
}

/// The sysroot of the toolchain that runs the xtask (`rustc --print sysroot`).
fn sysroot() -> anyhow::Result<PathBuf> {
    let output = Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .context("running rustc --print sysroot")?;
    ensure!(
        output.status.success(),
        "rustc --print sysroot failed: {}",
        output.status
    );
    let sysroot = PathBuf::from(String::from_utf8(output.stdout)?.trim());
    ensure!(
        sysroot.join("bin/cargo").is_file(),
        "the sysroot {} has no bin/cargo",
        sysroot.display()
    );
    Ok(sysroot)
}
