//! The VM's disk image: `debootstrap` of a Debian release with its stock kernel and systemd, one
//! unit of the check's own, made into an ext4 image without a loop device (`mkfs.ext4 -d`), and
//! cached with the kernel and initramfs taken out of it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context;
use xtask::run_checked;

use super::Release;
use crate::fresh::{mirror::Mirror, mounts};
use crate::package::output;

/// Where the images are kept, one folder per release.
const CACHE: &str = "/var/cache/peregrine/vm";
/// What the image is made of; a cached image of another recipe is made again.
const RECIPE: &str = "4: minbase + systemd-sysv udev kmod linux-image-amd64 initramfs-tools \
                      e2fsprogs python3 adduser; vm-check.service; root without a password";
/// The packages beyond `--variant=minbase`: systemd as PID 1, the stock kernel and what boots it,
/// Python for the check's server and load, and what the package depends on beyond minbase
/// (adduser): the VM installs it with no network.
const INCLUDE: &str =
    "systemd-sysv,udev,kmod,linux-image-amd64,initramfs-tools,e2fsprogs,python3,adduser";
/// The image's size (a sparse file: only what is written takes room).
const SIZE: &str = "3G";
/// The unit that runs the payload's check at boot and powers the VM off however it ends (at once,
/// by the kernel: the disk is a throwaway overlay, and nothing the check started may hold the
/// power-off back). Its output goes to the serial console, QEMU's standard output.
const UNIT: &str = "\
[Unit]
Description=Runs the payload's check, then powers off
After=local-fs.target systemd-udev-settle.service
ConditionKernelCommandLine=!peregrine.shell

[Service]
Type=oneshot
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
ExecStart=/bin/sh -c 'mkdir -p /payload && mount -o ro /dev/vdb /payload && /payload/run.sh; echo \"vm-check: exit $?\"; sync; systemctl poweroff -ff'
FailureAction=poweroff-force

[Install]
WantedBy=multi-user.target
";

/// A release's image, ready to boot.
#[derive(Debug, Clone)]
pub(crate) struct Image {
    pub(crate) release: Release,
    /// The root file system (ext4, raw).
    pub(crate) disk: PathBuf,
    pub(crate) kernel: PathBuf,
    pub(crate) initrd: PathBuf,
}

/// The image of `release`, made now unless a cached one of this recipe is there (or `rebuild`).
pub(crate) fn ensure(release: Release, rebuild: bool) -> anyhow::Result<Image> {
    let folder = Path::new(CACHE).join(format!("debian-{}", release.number()));
    let image = Image {
        release,
        disk: folder.join("root.img"),
        kernel: folder.join("vmlinuz"),
        initrd: folder.join("initrd.img"),
    };
    let stamp = folder.join("recipe");
    let cached = std::fs::read_to_string(&stamp).is_ok_and(|recipe| recipe == RECIPE)
        && [&image.disk, &image.kernel, &image.initrd]
            .iter()
            .all(|path| path.is_file());
    if cached && !rebuild {
        return Ok(image);
    }
    std::fs::create_dir_all(&folder).with_context(|| format!("creating {}", folder.display()))?;
    let _ = std::fs::remove_file(&stamp);
    let staging = folder.join("root.staging");
    mounts::remove(&staging)?;
    let mirror = Mirror::of_host().archive;
    println!(
        "making the Debian {} image: debootstrap {} from {mirror} (cached in {})",
        release.number(),
        release.suite(),
        folder.display()
    );
    let made = debootstrap(release, &staging, &mirror)
        .and_then(|()| configure(&staging))
        .and_then(|()| take_out_boot_files(&staging, &image))
        .and_then(|()| make_disk(&staging, &image.disk));
    // debootstrap mounts /proc and /sys in the root it makes, and may leave them on failure.
    let removed = mounts::remove(&staging);
    made.and(removed)?;
    std::fs::write(&stamp, RECIPE).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(image)
}

fn debootstrap(release: Release, root: &Path, mirror: &str) -> anyhow::Result<()> {
    output(
        Command::new("debootstrap")
            .args(["--variant=minbase", &format!("--include={INCLUDE}")])
            .arg(release.suite())
            .arg(root)
            .arg(mirror),
    )
    .map(drop)
}

/// The check's unit, enabled; the root file system in fstab; a host name; root without a
/// password (for `--shell` on the console: the VM has no network).
fn configure(root: &Path) -> anyhow::Result<()> {
    let write = |path: &str, text: &str| {
        let path = root.join(path);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("etc/systemd/system/vm-check.service", UNIT)?;
    let wants = root.join("etc/systemd/system/multi-user.target.wants");
    std::fs::create_dir_all(&wants).with_context(|| format!("creating {}", wants.display()))?;
    let link = wants.join("vm-check.service");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("/etc/systemd/system/vm-check.service", &link)
        .with_context(|| format!("linking {}", link.display()))?;
    write("etc/fstab", "/dev/vda / ext4 defaults 0 1\n")?;
    write("etc/hostname", "peregrine-vm\n")?;
    run_checked(
        Command::new("chroot")
            .arg(root)
            .args(["passwd", "-d", "root"]),
    )
}

/// The newest kernel and its initramfs, copied out of the root's `/boot`.
fn take_out_boot_files(root: &Path, image: &Image) -> anyhow::Result<()> {
    let boot = root.join("boot");
    let newest = |prefix: &str| -> anyhow::Result<PathBuf> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(&boot)
            .with_context(|| format!("reading {}", boot.display()))?
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| name.starts_with(prefix))
            })
            .collect();
        found.sort();
        found
            .pop()
            .with_context(|| format!("no {prefix}* in {}", boot.display()))
    };
    for (prefix, to) in [("vmlinuz-", &image.kernel), ("initrd.img-", &image.initrd)] {
        let from = newest(prefix)?;
        std::fs::copy(&from, to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    Ok(())
}

/// An ext4 image of `root`, written beside `disk` and renamed into place.
fn make_disk(root: &Path, disk: &Path) -> anyhow::Result<()> {
    let partial = disk.with_extension("img.partial");
    let _ = std::fs::remove_file(&partial);
    output(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "peregrine-vm", "-d"])
            .arg(root)
            .arg(&partial)
            .arg(SIZE),
    )?;
    std::fs::rename(&partial, disk)
        .with_context(|| format!("renaming {} to {}", partial.display(), disk.display()))
}
