//! Booting an image under QEMU with the payload disk, no network device, and what its check said.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use xtask::{run_checked, workspace_root};

use super::image::Image;
use crate::package::output;

/// How long a boot and its check may take under TCG before the VM is stopped.
const TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// The variable that picks the accelerator: `tcg` (the default) or `kvm`.
const ACCEL_VAR: &str = "PEREGRINE_VM_ACCEL";
/// The payload disk's size (sparse).
const PAYLOAD_SIZE: &str = "1G";

/// One step of the check, as the VM printed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    pub(crate) name: String,
    /// `ok: ...`, `FAILED: ...` or `skipped: ...`.
    pub(crate) outcome: String,
}

impl Step {
    pub(crate) fn passed(&self) -> bool {
        self.outcome.starts_with("ok")
    }
}

/// What one boot and check gave.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) steps: Vec<Step>,
    /// The kernel's facts the script printed (`fact: KEY: VALUE`), by key.
    pub(crate) facts: BTreeMap<String, String>,
    /// Whether the script ran to its end (the unit printed its exit).
    pub(crate) finished: bool,
    pub(crate) took: Duration,
    pub(crate) accelerator: String,
    /// The whole console output.
    pub(crate) log: PathBuf,
}

/// The step a console line reports, if it is one: `check: NAME: OUTCOME` anywhere in the line (the
/// console may put its escapes before it).
fn step_in(line: &str) -> Option<Step> {
    let rest = &line[line.find("check: ")? + "check: ".len()..];
    let (name, outcome) = rest.split_once(": ")?;
    (!name.is_empty() && !name.contains(' ')).then(|| Step {
        name: name.to_owned(),
        outcome: outcome.trim_end().to_owned(),
    })
}

/// The fact a console line reports, if it is one: `fact: KEY: VALUE` anywhere in the line.
fn fact_in(line: &str) -> Option<(String, String)> {
    let rest = &line[line.find("fact: ")? + "fact: ".len()..];
    let (key, value) = rest.split_once(": ")?;
    (!key.is_empty() && !key.contains(' ')).then(|| (key.to_owned(), value.trim_end().to_owned()))
}

/// Boots `image` with the payload in `payload` and collects the check's steps.
pub(crate) fn check(image: &Image, payload: &Path) -> anyhow::Result<Run> {
    let (overlay, disk) = disks(image, payload)?;
    let accelerator = std::env::var(ACCEL_VAR).unwrap_or_else(|_| "tcg".to_owned());
    let mut command = qemu(image, &overlay, &disk, &accelerator, false);
    let log = workspace_root().join(format!("target/vm/debian-{}.log", image.release.number()));
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let stdout = child.stdout.take().context("QEMU's output")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut console = String::new();
    let mut steps = Vec::new();
    let mut facts = BTreeMap::new();
    let mut finished = false;
    let deadline = started + TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let line = line.replace('\r', "");
                if let Some(step) = step_in(&line) {
                    println!(
                        "  Debian {}: {}: {}",
                        image.release.number(),
                        step.name,
                        step.outcome
                    );
                    steps.push(step);
                }
                facts.extend(fact_in(&line));
                finished |= line.contains("vm-check: exit");
                console.push_str(&line);
                console.push('\n');
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                console.push_str(&format!("(stopped after {TIMEOUT:?})\n"));
                break;
            }
        }
    }
    let status = child.wait().context("waiting for QEMU")?;
    let took = started.elapsed();
    let mut stderr = String::new();
    if let Some(mut err) = child.stderr.take() {
        use std::io::Read as _;
        let _ = err.read_to_string(&mut stderr);
    }
    console.push_str(&stderr);
    std::fs::write(&log, &console).with_context(|| format!("writing {}", log.display()))?;
    if !status.success() && steps.is_empty() {
        bail!(
            "QEMU failed ({status}): {stderr}\nconsole: {}",
            log.display()
        );
    }
    Ok(Run {
        steps,
        facts,
        finished,
        took,
        accelerator,
        log,
    })
}

/// Boots `image` with a root shell on this terminal's console, the check left out.
pub(crate) fn shell(image: &Image, payload: &Path) -> anyhow::Result<()> {
    let (overlay, disk) = disks(image, payload)?;
    let accelerator = std::env::var(ACCEL_VAR).unwrap_or_else(|_| "tcg".to_owned());
    println!("root on the console, no password; the payload is /dev/vdb; Ctrl-A X quits QEMU");
    run_checked(&mut qemu(image, &overlay, &disk, &accelerator, true))
}

/// A copy-on-write overlay of the image (which stays as built) and the payload's disk.
fn disks(image: &Image, payload: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let folder = workspace_root().join("target/vm");
    std::fs::create_dir_all(&folder).with_context(|| format!("creating {}", folder.display()))?;
    let overlay = folder.join(format!("debian-{}.qcow2", image.release.number()));
    let _ = std::fs::remove_file(&overlay);
    output(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&image.disk)
            .arg(&overlay),
    )?;
    // One payload disk per release: the releases' checks may run at once.
    let disk = folder.join(format!("payload-{}.img", image.release.number()));
    let _ = std::fs::remove_file(&disk);
    output(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-d"])
            .arg(payload)
            .arg(&disk)
            .arg(PAYLOAD_SIZE),
    )?;
    Ok((overlay, disk))
}

/// QEMU with no network device, the serial console on standard input and output, the image's
/// kernel booting the overlay as its root, and the payload read-only.
fn qemu(image: &Image, overlay: &Path, payload: &Path, accelerator: &str, shell: bool) -> Command {
    let mut append = "root=/dev/vda rw console=ttyS0 quiet systemd.show_status=0".to_owned();
    if shell {
        append.push_str(" peregrine.shell");
    } else {
        // The console's getty would hang up the check's output on the same terminal.
        append.push_str(" systemd.mask=serial-getty@ttyS0.service");
    }
    // TCG's threads (one per vCPU) let a CPU run code another just patched (a tracepoint's static
    // key, switched on as the sampler attaches): Debian 13's kernel then died on the patch's int3
    // in __schedule. One thread for every vCPU keeps the patching coherent.
    let accel = match accelerator {
        "tcg" => "tcg,thread=single",
        other => other,
    };
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(["-machine", "q35", "-accel", accel, "-cpu", "max"])
        .args([
            "-m",
            "2048",
            "-smp",
            "2",
            "-nic",
            "none",
            "-nographic",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(&image.initrd)
        .args(["-append", &append])
        .arg("-drive")
        .arg(format!("file={},if=virtio,format=qcow2", overlay.display()))
        .arg("-drive")
        .arg(format!(
            "file={},if=virtio,format=raw,readonly=on",
            payload.display()
        ));
    command
}

/// Where Debian's qemu-utils here is a backport (whose version qemu-system-x86 must match, or the
/// two conflict), has apt take QEMU from the same backports: adds `<suite>-backports` to apt's
/// sources and pins QEMU's packages to it. Does nothing once qemu-system-x86_64 is there.
pub(crate) fn prefer_backports_where_qemu_utils_is_one() -> anyhow::Result<()> {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    let version = Command::new("dpkg-query")
        .args(["-W", "-f", "${Version}", "qemu-utils"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    if !version.contains("~bpo") {
        return Ok(());
    }
    let os_release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let suite = os_release
        .lines()
        .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
        .context("no VERSION_CODENAME in /etc/os-release")?
        .trim_matches('"')
        .to_owned();
    let archive = crate::fresh::mirror::Mirror::of_host().archive;
    let sources = Path::new("/etc/apt/sources.list.d/peregrine-backports.sources");
    if !sources.exists() {
        std::fs::write(
            sources,
            format!(
                "Types: deb\nURIs: {archive}\nSuites: {suite}-backports\nComponents: main\n\
                 Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            ),
        )
        .with_context(|| format!("writing {}", sources.display()))?;
    }
    let pin = Path::new("/etc/apt/preferences.d/peregrine-qemu");
    std::fs::write(
        pin,
        format!(
            "# qemu-utils {version} is a backport: QEMU's other packages must match it.\n\
             Package: qemu-* ipxe-qemu seabios\nPin: release n={suite}-backports\nPin-Priority: 990\n"
        ),
    )
    .with_context(|| format!("writing {}", pin.display()))?;
    println!("qemu-utils {version} is a backport: QEMU from {suite}-backports");
    run_checked(Command::new("apt-get").args(["update", "-qq"]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_steps_off_the_console() {
        assert_eq!(
            step_in("\u{1b}[0mcheck: kernel: ok: 6.1.0-50-amd64 (Debian GNU/Linux 12)"),
            Some(Step {
                name: "kernel".into(),
                outcome: "ok: 6.1.0-50-amd64 (Debian GNU/Linux 12)".into()
            })
        );
        let failed = step_in("check: probe: FAILED: test result: FAILED. 3 passed").unwrap();
        assert!(!failed.passed());
        assert_eq!(step_in("[    1.2] systemd[1]: Started something."), None);
        assert_eq!(step_in("a check: of sorts"), None);
        assert_eq!(
            fact_in("\u{1b}[0mfact: sends: counted at the return of tcp_sendmsg"),
            Some((
                "sends".into(),
                "counted at the return of tcp_sendmsg".into()
            ))
        );
        assert_eq!(fact_in("a fact: of sorts"), None);
    }
}
