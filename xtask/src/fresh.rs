//! `cargo xtask fresh`: the README's first command, `cargo xtask demo`, on a machine as fresh as a
//! new user's: a minimal Debian 12 root (`debootstrap --variant=minbase bookworm` from the host's
//! mirror, cached as a tarball, [`base`]) with only build-essential, git, python3 and
//! ca-certificates added and the host's Rust toolchain bound in read-only ([`Root`]), the tree at
//! HEAD cloned into it (committed work only), and the demo run there in a chroot with a clean
//! environment. It passes when the demo exits 0 and its output shows the eBPF sampler
//! (`sampler: ebpf` in `peregrine status`) and no failed request (its load reports say `0 failed`,
//! and none says more); see [`judge`]. Each phase is timed.
//!
//! Once the demo passed, the README's build from source runs on a root of its own
//! ([`from_source`]): its package line alone must be enough for `cargo build --release` with the
//! eBPF sampler required.
//!
//! Whatever the demo needs beyond those four packages (clang and libbpf's headers, python3-venv) the xtask must install itself, through the package list: this is
//! the check that a hole in that list cannot pass.
//!
//! Before that, the same command runs in the same root as an unprivileged user ([`USER`], made
//! there, with its own clone, `CARGO_HOME` and target folder in its home), to prove the other path
//! of the package list: it must stop, exiting non-zero, with one `sudo apt-get install` line that
//! names just the packages the demo needs and the root lacks (clang and libbpf's headers,
//! python3-venv), and have installed none of them (`dpkg -s`); see
//! [`judge_as_user`].
//!
//! `cargo xtask fresh --test` runs the README's other command, `cargo xtask test`, there instead,
//! with CI's `PEREGRINE_REQUIRE_*` (a test whose tool is missing fails instead of skipping; see
//! [`REQUIRE`]): it passes when every test passes and none skipped for the eBPF sampler, and shows
//! the skip report. It takes longer (every package the
//! tests use is installed, every test built and run), so `.ci/run` does not run it.
//!
//! [`Root`] is the reusable part: the package test installs the `.deb` into the same kind of root.

mod base;
pub(crate) mod from_source;
pub(crate) mod mirror;
pub(crate) mod mounts;
mod root;

use std::{
    fmt::Write as _,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use xtask::{USAGE, interrupt, packages, run_checked, workspace_root};

#[allow(
    unused_imports,
    reason = "the root's API, for the package test as much as for this command"
)]
pub(crate) use self::root::{Builder, Root, Transcript};

/// All that is added to the minimal root: what the README assumes a machine has.
const PACKAGES: &[&str] = &["build-essential", "git", "python3", "ca-certificates"];
/// Where the tree is cloned in the root.
const CLONE: &str = "/root/peregrine";
/// The unprivileged user the demo first runs as, made in the root; it has no sudo.
const USER: &str = "builder";
/// That user's home, where its clone, `CARGO_HOME` and target folder are.
const USER_HOME: &str = "/home/builder";
/// CI's variables: the tests that would skip for a missing tool fail instead. The xtask builds
/// without clang (it links no eBPF crate), so `PEREGRINE_REQUIRE_EBPF` holds from the first build
/// on; a skip for the eBPF sampler would fail the check all the same (see [`judge_test`]).
const REQUIRE: &str = "PEREGRINE_REQUIRE_EBPF=1 PEREGRINE_REQUIRE_VAGRANT=1 \
                       PEREGRINE_REQUIRE_SYSTEMD=1 PEREGRINE_REQUIRE_PROMETHEUS=1 \
                       PEREGRINE_REQUIRE_TMUX=1";

/// Which of the README's commands runs in the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// `cargo xtask demo`.
    Demo,
    /// `cargo xtask test`, with CI's `PEREGRINE_REQUIRE_*`.
    Test,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let check = match args {
        [] => Check::Demo,
        [flag] if flag == "--test" => Check::Test,
        _ => bail!("`cargo xtask fresh` takes --test or nothing, not {args:?}\n\n{USAGE}"),
    };
    interrupt::install()?;
    let started = Instant::now();
    let (commit, dirty) = head()?;
    println!(
        "fresh-machine check of commit {commit}: committed work only{}",
        if dirty {
            " (the checkout's uncommitted changes are not in it)"
        } else {
            ""
        }
    );
    let root = Root::builder(check.name())
        .packages(PACKAGES)
        .rust_toolchain()
        .prepare()?;
    let mut phases = root.phases().to_vec();

    let cloning = Instant::now();
    let clone = root.host_path(CLONE);
    run_checked(
        Command::new("git")
            .args(["clone", "--quiet", "--no-hardlinks"])
            .arg(workspace_root())
            .arg(&clone),
    )?;
    phases.push(("git clone of HEAD".to_owned(), cloning.elapsed()));

    if check == Check::Demo {
        let as_user = Instant::now();
        let verdict = demo_as_user(&root);
        phases.push((
            format!("cargo xtask demo as {USER} (stops at the apt-get line)"),
            as_user.elapsed(),
        ));
        match verdict? {
            Ok(line) => println!("\nas {USER}, the demo stopped as it should, saying:\n  {line}"),
            Err(why) => {
                let log = root.log_dir().join(format!("demo-as-{USER}.log"));
                drop(root);
                println!("\n{}", times(&phases, started.elapsed()));
                eprintln!(
                    "fresh-machine check failed: as {USER}, not root: {why} (the output: {})",
                    log.display()
                );
                return Ok(ExitCode::FAILURE);
            }
        }
    }

    let script = format!("cd {CLONE} && {}", check.command());
    println!("\n$ {script}   (in the root {})", root.path().display());
    let running = Instant::now();
    let transcript = root.transcript(&script, check.deadline())?;
    phases.push((
        format!("{} (the project built inside)", check.readme_command()),
        running.elapsed(),
    ));
    let log = root.log_dir().join(format!("{}.log", check.name()));
    std::fs::write(&log, &transcript.text).with_context(|| format!("writing {}", log.display()))?;

    let tearing_down = Instant::now();
    drop(root);
    phases.push(("teardown".to_owned(), tearing_down.elapsed()));

    let verdict = match check {
        Check::Demo => judge(transcript.status.success(), &transcript.text),
        Check::Test => judge_test(transcript.status.success(), &transcript.text),
    };
    // The README's build from source, on a root of its own: after the demo passed.
    let verdict = match verdict {
        Ok(lines) if check == Check::Demo => {
            let building = Instant::now();
            let built = from_source::check()?;
            phases.push((
                "the README's build from source (a root of its own)".to_owned(),
                building.elapsed(),
            ));
            match built {
                Ok(version) => Ok(lines.into_iter().chain([version]).collect()),
                Err(why) => Err(Problems::one(why)),
            }
        }
        other => other,
    };
    println!("\n{}", times(&phases, started.elapsed()));
    match verdict {
        Ok(lines) => {
            println!(
                "fresh-machine check passed: `{}` ran on a minimal Debian 12 root; it said:",
                check.readme_command()
            );
            for line in lines {
                println!("  {line}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(why) => {
            eprintln!(
                "fresh-machine check failed: {why} (the output: {})",
                log.display()
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `cargo xtask demo` run in `root` as [`USER`], made there with a clone of its own: its verdict
/// ([`judge_as_user`]), its output kept in `<log dir>/demo-as-<user>.log`.
fn demo_as_user(root: &Root) -> anyhow::Result<Result<String, Problems>> {
    let clone = format!("{USER_HOME}/peregrine");
    // `--no-hardlinks`: the user's objects are its own, not root's clone's files chowned.
    root.run(&format!(
        "useradd --create-home --home-dir {USER_HOME} --shell /bin/sh {USER} && \
         git clone --quiet --no-hardlinks {CLONE} {clone} && \
         chown -R {USER}:{USER} {clone}"
    ))?;
    // setpriv leaves the environment alone: the root's, with the user's own HOME, CARGO_HOME and
    // target folder.
    let script = format!(
        "setpriv --reuid={USER} --regid={USER} --init-groups \
         env HOME={USER_HOME} USER={USER} LOGNAME={USER} CARGO_HOME={USER_HOME}/.cargo \
         CARGO_TARGET_DIR={USER_HOME}/target sh -c 'cd {clone} && cargo xtask demo'"
    );
    println!("\n$ {script}   (in the root {})", root.path().display());
    let transcript = root.transcript(&script, Check::Demo.deadline())?;
    let log = root.log_dir().join(format!("demo-as-{USER}.log"));
    std::fs::write(&log, &transcript.text).with_context(|| format!("writing {}", log.display()))?;

    let expected = lacking();
    let mut installed = Vec::new();
    for name in &expected {
        let status = root
            .command("dpkg")
            .args(["-s", name])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .context("running dpkg -s in the root")?;
        if status.success() {
            installed.push(*name);
        }
    }
    Ok(judge_as_user(
        transcript.status.success(),
        &transcript.text,
        &expected,
        &installed,
    ))
}

/// The packages `cargo xtask demo` needs ([`packages::DEMO`]) that the root lacks: all but the
/// ones it was made with ([`PACKAGES`]).
fn lacking() -> Vec<&'static str> {
    packages::names(packages::DEMO)
        .into_iter()
        .filter(|name| !PACKAGES.contains(name))
        .collect()
}

/// What a verdict found wrong, each a sentence for the operator; shown joined by `; `.
#[derive(Debug, PartialEq, Eq)]
struct Problems(Vec<String>);

impl Problems {
    fn one(problem: impl Into<String>) -> Problems {
        Problems(vec![problem.into()])
    }
}

impl std::fmt::Display for Problems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join("; "))
    }
}

/// The verdict of `cargo xtask demo` run by a user that is not root, with `expected` missing: the
/// line it stopped with, or why it is not right. It passes when the demo exited non-zero, exactly
/// one line contains `apt-get install`, that line has `sudo apt-get install` followed by exactly
/// the `expected` packages (up to a closing backquote), and none of them is `installed`.
fn judge_as_user(
    exited_ok: bool,
    output: &str,
    expected: &[&str],
    installed: &[&str],
) -> Result<String, Problems> {
    let mut problems = Vec::new();
    if exited_ok {
        problems.push("the demo exited 0 without its packages".to_owned());
    }
    let lines: Vec<&str> = output
        .lines()
        .map(str::trim)
        .filter(|line| line.contains("apt-get install"))
        .collect();
    let line = match lines[..] {
        [line] => Some(line),
        [] => {
            problems.push("no line says `apt-get install`".to_owned());
            None
        }
        _ => {
            problems.push(format!(
                "{} lines say `apt-get install`, not one: {lines:?}",
                lines.len()
            ));
            None
        }
    };
    if let Some(line) = line {
        match line.split_once("sudo apt-get install ") {
            None => problems.push(format!(
                "the line does not say `sudo apt-get install`: {line:?}"
            )),
            Some((_, rest)) => {
                let named: Vec<&str> = rest
                    .split('`')
                    .next()
                    .unwrap_or_default()
                    .split_whitespace()
                    .collect();
                let unnamed: Vec<&str> = expected
                    .iter()
                    .copied()
                    .filter(|name| !named.contains(name))
                    .collect();
                let extra: Vec<&str> = named
                    .iter()
                    .copied()
                    .filter(|name| !expected.contains(name))
                    .collect();
                if !unnamed.is_empty() {
                    problems.push(format!("the line does not name {unnamed:?}: {line:?}"));
                }
                if !extra.is_empty() {
                    problems.push(format!(
                        "the line names {extra:?}, which the root has: {line:?}"
                    ));
                }
            }
        }
    }
    if !installed.is_empty() {
        problems.push(format!("installed all the same: {installed:?}"));
    }
    match (problems.is_empty(), line) {
        (true, Some(line)) => Ok(line.to_owned()),
        _ => Err(Problems(problems)),
    }
}

/// HEAD's short commit, and whether the checkout has uncommitted changes to tracked files.
fn head() -> anyhow::Result<(String, bool)> {
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let output = Command::new("git")
            .args(args)
            .current_dir(workspace_root())
            .output()
            .with_context(|| format!("running git {}", args.join(" ")))?;
        anyhow::ensure!(output.status.success(), "git {} failed", args.join(" "));
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"])?;
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    Ok((commit, dirty))
}

/// The demo's verdict from whether it exited 0 and its output: the lines that show it passed, or
/// why it did not. It passes when
///
/// - a line says `sampler: ebpf` (the `peregrine status` header: `sampler: ebpf, every 1000 ms`),
///   and no line names another sampler (`sampler: procfs`);
/// - at least one line counts failed requests as `<n> failed` (the load reports: `600 requests in
///   2.01s, 0 failed; by worker: ...`), and every such count is 0;
/// - no line reports failures as `failed <n>: ...` (the traffic rounds' failure lines).
fn judge(exited_ok: bool, output: &str) -> Result<Vec<String>, Problems> {
    let mut matched = Vec::new();
    let mut problems = Vec::new();
    if !exited_ok {
        problems.push("the demo did not exit 0".to_owned());
    }
    let mut ebpf = false;
    let mut counts = 0;
    for line in output.lines() {
        let trimmed = line.trim();
        if let Some(sampler) = trimmed.strip_prefix("sampler: ") {
            if sampler.starts_with("ebpf") {
                if !ebpf {
                    matched.push(trimmed.to_owned());
                }
                ebpf = true;
            } else {
                problems.push(format!(
                    "the demo's supervisor ran another sampler: {trimmed:?}"
                ));
            }
        }
        if trimmed
            .strip_prefix("failed ")
            .and_then(|rest| rest.trim_start().split_once(':'))
            .is_some_and(|(count, _)| count.parse::<u64>().is_ok())
        {
            problems.push(format!("requests failed: {trimmed:?}"));
        }
        let words: Vec<&str> = trimmed.split_whitespace().collect();
        for pair in words.windows(2) {
            let [count, word] = pair else { continue };
            if !word.starts_with("failed") {
                continue;
            }
            let Ok(count) = count
                .trim_matches(|c: char| !c.is_ascii_digit())
                .parse::<u64>()
            else {
                continue;
            };
            counts += 1;
            if count == 0 {
                matched.push(trimmed.to_owned());
            } else {
                problems.push(format!("{count} requests failed: {trimmed:?}"));
            }
        }
    }
    if !ebpf {
        problems.push("no `sampler: ebpf` line (the eBPF sampler did not run)".to_owned());
    }
    if counts == 0 {
        problems.push("no `0 failed` line (no load report)".to_owned());
    }
    if problems.is_empty() {
        Ok(matched)
    } else {
        Err(Problems(problems))
    }
}

/// The verdict of `cargo xtask test` in the root: the skip report's lines when it exited 0 (with
/// [`REQUIRE`], a missing tool fails its test) and no test skipped for the eBPF sampler, else why
/// not.
fn judge_test(exited_ok: bool, output: &str) -> Result<Vec<String>, Problems> {
    let mut report = Vec::new();
    let mut in_report = false;
    for line in output.lines() {
        if line == "No test skipped." || line.starts_with("Tests skipped (") {
            report.push(line.to_owned());
            in_report = line.starts_with("Tests skipped (");
        } else if in_report && line.starts_with("  ") {
            report.push(line.trim().to_owned());
        } else {
            in_report = false;
        }
    }
    let ebpf: Vec<&String> = report.iter().filter(|line| line.contains("eBPF")).collect();
    match (exited_ok, report.is_empty()) {
        (false, _) => Err(Problems::one(
            "a test failed (or the run stopped before the tests)",
        )),
        (true, true) => Err(Problems::one("the test run printed no skip report")),
        (true, false) if !ebpf.is_empty() => Err(Problems::one(format!(
            "tests skipped for the eBPF sampler: {ebpf:?}"
        ))),
        (true, false) => Ok(report),
    }
}

// === impl Check ===

impl Check {
    /// The root's name (`target/fresh/<name>/`).
    fn name(self) -> &'static str {
        match self {
            Check::Demo => "demo",
            Check::Test => "test",
        }
    }

    /// The command, as the README gives it.
    fn readme_command(self) -> &'static str {
        match self {
            Check::Demo => "cargo xtask demo",
            Check::Test => "cargo xtask test",
        }
    }

    /// The command as it runs (the tests with [`REQUIRE`]).
    fn command(self) -> String {
        match self {
            Check::Demo => self.readme_command().to_owned(),
            Check::Test => format!("{REQUIRE} {}", self.readme_command()),
        }
    }

    /// How long it may take, building on a small machine included.
    fn deadline(self) -> Duration {
        match self {
            Check::Demo => Duration::from_secs(90 * 60),
            Check::Test => Duration::from_secs(180 * 60),
        }
    }
}

/// The phases' times as a table, with the total.
fn times(phases: &[(String, Duration)], total: Duration) -> String {
    let width = phases
        .iter()
        .map(|(phase, _)| phase.len())
        .max()
        .unwrap_or(0)
        .max(5);
    let mut table = String::from("fresh-machine check times:\n");
    for (phase, took) in phases {
        let _ = writeln!(table, "  {phase:<width$}  {}", minutes(*took));
    }
    let _ = write!(table, "  {:<width$}  {}", "total", minutes(total));
    table
}

/// `12m 05s`, or `4.2s` under a minute.
fn minutes(took: Duration) -> String {
    let seconds = took.as_secs();
    if seconds < 60 {
        format!("{:.1}s", took.as_secs_f64())
    } else {
        format!("{}m {:02}s", seconds / 60, seconds % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of today's demo that the check reads, among others.
    const PASSING: &str = "\
Envoy lists 2 hosts after 1.21s:
`peregrine status` once every worker's load went to Envoy over ORCA (2.02s):
sampler: ebpf, every 1000 ms
xds: revision 7; 1 Envoy connected for endpoints
`peregrine restart` while 2 HTTP/1.1 and 2 HTTP/2 clients send requests through Envoy
  restarted 2 workers in 3.1s: workers {101, 102} -> {201, 202}
  1314 requests in 4.52s, 0 failed; by worker: {201: 650, 202: 664}
SIGKILL to the supervisor, then `peregrine run` again, under the same load
  the new supervisor adopted workers {201, 202} (1.02s after the kill)
  732 requests in 2.71s, 0 failed; by worker: {201: 366, 202: 366}
supervisor exited: exit status: 0
";

    #[test]
    fn a_demo_with_the_ebpf_sampler_and_no_failed_request_passes() {
        assert_eq!(
            judge(true, PASSING).unwrap(),
            [
                "sampler: ebpf, every 1000 ms",
                "1314 requests in 4.52s, 0 failed; by worker: {201: 650, 202: 664}",
                "732 requests in 2.71s, 0 failed; by worker: {201: 366, 202: 366}",
            ]
        );
    }

    #[test]
    fn the_procfs_sampler_a_failed_request_or_a_failed_exit_fails() {
        let procfs = PASSING.replace("sampler: ebpf", "sampler: procfs");
        let error = judge(true, &procfs).unwrap_err().to_string();
        assert!(
            error.contains("another sampler: \"sampler: procfs, every 1000 ms\""),
            "{error}"
        );
        assert!(error.contains("no `sampler: ebpf` line"), "{error}");

        let failed = PASSING.replace(
            "732 requests in 2.71s, 0 failed",
            "732 requests in 2.71s, 3 failed",
        );
        let error = judge(true, &failed).unwrap_err().to_string();
        assert_eq!(
            error,
            "3 requests failed: \"732 requests in 2.71s, 3 failed; by worker: {201: 366, 202: 366}\""
        );

        let traffic = format!("{PASSING}  failed   2: connection refused\n");
        assert!(
            judge(true, &traffic)
                .unwrap_err()
                .to_string()
                .contains("requests failed: \"failed   2")
        );

        assert_eq!(
            judge(false, PASSING).unwrap_err().to_string(),
            "the demo did not exit 0"
        );
    }

    #[test]
    fn a_demo_that_never_got_to_its_load_fails() {
        let error = judge(
            false,
            "error: failed to run custom build command for `peregrine-ebpf`\n",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            error,
            "the demo did not exit 0; no `sampler: ebpf` line (the eBPF sampler did not run); no \
             `0 failed` line (no load report)"
        );
    }

    /// What `cargo xtask demo` says as a user that is not root, in the fresh root.
    const STOPPED: &str = "\
error: missing packages:
  clang-19: no clang >= 14 in PATH (compiles the eBPF sampler)
  python3-venv: no `import ensurepip, venv` in python3 (`python3 -m venv`)
to install them, run `sudo apt-get install clang-19 libbpf-dev python3-venv`
";
    const LACKING: &[&str] = &["clang-19", "libbpf-dev", "python3-venv"];

    #[test]
    fn the_demo_as_a_user_stops_at_one_apt_get_line_naming_what_the_root_lacks() {
        assert_eq!(
            judge_as_user(false, STOPPED, LACKING, &[]).unwrap(),
            "to install them, run `sudo apt-get install clang-19 libbpf-dev python3-venv`"
        );
        // The root's packages are not named; the demo's are, in the list's order.
        assert_eq!(lacking(), ["clang-19", "libbpf-dev", "python3-venv"]);
    }

    #[test]
    fn the_demo_as_a_user_fails_the_check_when_it_goes_on_or_installs_or_names_otherwise() {
        assert_eq!(
            judge_as_user(true, STOPPED, LACKING, &[])
                .unwrap_err()
                .to_string(),
            "the demo exited 0 without its packages"
        );
        assert_eq!(
            judge_as_user(false, STOPPED, LACKING, &["clang-19"])
                .unwrap_err()
                .to_string(),
            "installed all the same: [\"clang-19\"]"
        );
        let error = judge_as_user(false, STOPPED, &["clang-19", "etcd-server"], &[])
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("the line does not name [\"etcd-server\"]: "),
            "{error}"
        );
        assert!(
            error.contains("the line names [\"libbpf-dev\", \"python3-venv\"], which the root has"),
            "{error}"
        );
        // The root's path (apt-get without sudo), no line at all, or the line twice.
        let as_root = STOPPED.replace("sudo apt-get", "apt-get");
        assert!(
            judge_as_user(false, &as_root, LACKING, &[])
                .unwrap_err()
                .to_string()
                .starts_with("the line does not say `sudo apt-get install`")
        );
        assert_eq!(
            judge_as_user(false, "error: could not compile `xtask`\n", LACKING, &[])
                .unwrap_err()
                .to_string(),
            "no line says `apt-get install`"
        );
        let twice = format!("{STOPPED}warning: run `sudo apt-get install clang-19`\n");
        assert!(
            judge_as_user(false, &twice, LACKING, &[])
                .unwrap_err()
                .to_string()
                .starts_with("2 lines say `apt-get install`, not one")
        );
    }

    #[test]
    fn a_test_run_passes_when_it_exits_0_and_shows_its_skip_report() {
        let output = "\
test result: ok. 12 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.2s
Tests skipped (1):
  fleet_routing: the comparison needs a free core
supervisor log line
";
        assert_eq!(
            judge_test(true, output).unwrap(),
            [
                "Tests skipped (1):",
                "fleet_routing: the comparison needs a free core"
            ]
        );
        assert_eq!(
            judge_test(true, "No test skipped.\n").unwrap(),
            ["No test skipped."]
        );
        assert!(judge_test(false, output).is_err());
        let ebpf = "Tests skipped (1):\n  sampler: the eBPF sampler cannot load here: no clang\n";
        assert_eq!(
            judge_test(true, ebpf).unwrap_err().to_string(),
            "tests skipped for the eBPF sampler: [\"sampler: the eBPF sampler cannot load here: no \
             clang\"]"
        );
        assert!(judge_test(true, "error: could not compile\n").is_err());
    }

    #[test]
    fn times_are_a_table() {
        let table = times(
            &[
                ("debootstrap".to_owned(), Duration::from_secs(245)),
                ("git clone of HEAD".to_owned(), Duration::from_millis(420)),
            ],
            Duration::from_secs(250),
        );
        assert_eq!(
            table,
            "fresh-machine check times:\n  \
             debootstrap        4m 05s\n  \
             git clone of HEAD  0.4s\n  \
             total              4m 10s"
        );
    }
}
