//! The kernel program against the kernel: CPU time against /proc, run-queue wait under a CPU hog,
//! idle and spinning processes, tracking churn, process trees (children's time added to their root's,
//! their entries gone when they exit or when the root is untracked) and sends counted as requests.
//! Helper processes are this binary re-executed (see [`helper`]). Needs root (CAP_BPF + CAP_PERFMON) and BTF; with
//! `PEREGRINE_REQUIRE_EBPF=1` (CI) a probe that cannot load fails the tests instead of skipping them.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{Mutex, mpsc},
    time::{Duration, Instant},
};

use peregrine_contract::{ErrorChain, counters::CounterRegion, procfs};
use peregrine_ebpf::{MAX_DESCENDANTS, Probe, SchedTotals, SendHook, Tracked};

/// The tests measure CPU time: one at a time, so they do not steal each other's cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn probe(lanes: u32) -> Option<Probe> {
    probe_with_budget(lanes, MAX_DESCENDANTS)
}

fn probe_with_budget(lanes: u32, max_descendants: u32) -> Option<Probe> {
    probe_with(lanes, max_descendants, &SendHook::ALL)
}

fn probe_with(lanes: u32, max_descendants: u32, send_hooks: &[SendHook]) -> Option<Probe> {
    match Probe::load_with(lanes, max_descendants, send_hooks) {
        Ok(probe) => Some(probe),
        Err(error) => {
            let text = ErrorChain(&error);
            if std::env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1") {
                panic!("PEREGRINE_REQUIRE_EBPF=1 but the probe cannot load: {text}");
            }
            peregrine_testenv::skip(
                &peregrine_testenv::current_test(),
                format_args!("the eBPF probe cannot load here: {text}"),
            );
            None
        }
    }
}

/// A child process killed (and reaped) on drop.
struct Proc(Child);

impl Proc {
    /// `sh` spinning in a loop (no syscalls, no sleeps), optionally pinned to `cpu`.
    fn spinner(cpu: Option<u32>) -> Proc {
        let mut cmd = match cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpu.to_string(), "sh"]);
                c
            }
            None => Command::new("sh"),
        };
        Proc(
            cmd.args(["-c", "while :; do :; done"])
                .spawn()
                .expect("spawn sh"),
        )
    }

    fn sleeper() -> Proc {
        Proc(
            Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("spawn sleep"),
        )
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// utime + stime of `pid` from /proc/PID/stat, in nanoseconds.
fn proc_stat_cpu_ns(pid: u32) -> u64 {
    let stat = procfs::stat(pid).expect("read /proc/PID/stat");
    stat.cpu_ticks() * 1_000_000_000 / procfs::clock_ticks_per_second()
}

/// How long a process may take to reach the state a test waits for.
const DEADLINE: Duration = Duration::from_secs(5);

/// Polls `done` every 5 ms until it holds; panics naming `what` after [`DEADLINE`].
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until `pid` has been on a CPU for 20 ms (its threads' `schedstat`): past its start-up (and
/// `taskset`'s exec), into its loop.
fn wait_spinning(pid: u32) {
    wait_until(&format!("process {pid} to spin"), || {
        procfs::process_schedstat(pid).is_ok_and(|s| s.on_cpu_ns >= 20_000_000)
    });
}

/// Waits until `pid` sleeps (state `S` in /proc/PID/stat), past its start-up.
fn wait_sleeping(pid: u32) {
    wait_until(&format!("process {pid} to sleep"), || {
        procfs::stat(pid).is_ok_and(|s| s.state == 'S')
    });
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn delta(a: SchedTotals, b: SchedTotals) -> SchedTotals {
    SchedTotals {
        on_cpu_ns: b.on_cpu_ns - a.on_cpu_ns,
        runq_wait_ns: b.runq_wait_ns - a.runq_wait_ns,
    }
}

#[test]
fn cpu_time_matches_proc_stat_within_two_percent() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(4) else { return };
    let spinner = Proc::spinner(None);
    probe.track(2, spinner.pid()).unwrap();
    // Both baselines are taken while it runs.
    wait_spinning(spinner.pid());
    let (ebpf0, proc0) = (
        probe.read(2, spinner.pid()),
        proc_stat_cpu_ns(spinner.pid()),
    );
    // The measured interval: 2 s of spinning, compared.
    std::thread::sleep(Duration::from_secs(2));
    let (ebpf1, proc1) = (
        probe.read(2, spinner.pid()),
        proc_stat_cpu_ns(spinner.pid()),
    );
    let ebpf = delta(ebpf0, ebpf1).on_cpu_ns;
    let proc = proc1 - proc0;
    let error = (ebpf as f64 - proc as f64).abs() / proc as f64;
    eprintln!(
        "on-CPU over 2 s: eBPF {:.1} ms, /proc utime+stime {:.1} ms ({:.2}% apart)",
        ms(ebpf),
        ms(proc),
        error * 100.0
    );
    assert!(proc > 500_000_000, "the spinner barely ran: {}", ms(proc));
    assert!(
        error <= 0.02,
        "eBPF and /proc differ by {:.2}%",
        error * 100.0
    );
}

#[test]
fn an_idle_process_reads_about_zero() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(1) else { return };
    let sleeper = Proc::sleeper();
    probe.track(0, sleeper.pid()).unwrap();
    wait_sleeping(sleeper.pid());
    let before = probe.read(0, sleeper.pid());
    // The measured interval: 1 s asleep should add nothing.
    std::thread::sleep(Duration::from_secs(1));
    let idle = delta(before, probe.read(0, sleeper.pid()));
    eprintln!("idle for 1 s: {idle:?}");
    assert!(idle.on_cpu_ns < 1_000_000, "an idle process used {idle:?}");
    assert!(
        idle.runq_wait_ns < 1_000_000,
        "an idle process waited {idle:?}"
    );
}

#[test]
fn a_spinning_process_shows_in_the_very_next_sample() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(1) else { return };
    let spinner = Proc::spinner(Some(0));
    probe.track(0, spinner.pid()).unwrap();
    wait_spinning(spinner.pid());
    // Samples 100 ms apart, as with the shortest sensible interval: each must show the time spent
    // since the last, though the spinner is never switched out voluntarily.
    let mut last = probe.read(0, spinner.pid());
    for _ in 0..5 {
        let start = Instant::now();
        // The measured interval between two samples.
        std::thread::sleep(Duration::from_millis(100));
        let now = probe.read(0, spinner.pid());
        let used = delta(last, now);
        let wall = start.elapsed().as_nanos() as u64;
        eprintln!("{:.1} ms on CPU in {:.1} ms", ms(used.on_cpu_ns), ms(wall));
        assert!(
            used.on_cpu_ns + used.runq_wait_ns >= wall / 2,
            "a spinning process showed only {used:?} in {:.1} ms",
            ms(wall)
        );
        last = now;
    }
}

#[test]
fn sharing_a_core_with_a_hog_shows_run_queue_wait() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(1) else { return };
    // The same spinner on CPU 0, first with the core to itself, then sharing it with a hog: what the
    // machine's other load adds to both phases cancels out in the difference.
    let spinner = Proc::spinner(Some(0));
    probe.track(0, spinner.pid()).unwrap();
    wait_spinning(spinner.pid());
    let phase = || {
        let before = probe.read(0, spinner.pid());
        // The measured interval: one phase.
        std::thread::sleep(Duration::from_secs(1));
        delta(before, probe.read(0, spinner.pid()))
    };
    let alone = phase();
    let hog = Proc::spinner(Some(0));
    wait_spinning(hog.0.id());
    let shared = phase();
    drop(hog);
    eprintln!("over 1 s on CPU 0: alone {alone:?}; sharing it with a hog {shared:?}");
    assert!(
        shared.runq_wait_ns > 250_000_000,
        "a process sharing its core with a hog waited only {:.1} ms",
        ms(shared.runq_wait_ns)
    );
    // With k other tasks on CPU 0 the hog adds 1/((k+1)(k+2)) s of wait: 500 ms on a quiet core,
    // still 83 ms with two strangers.
    assert!(
        shared.runq_wait_ns > alone.runq_wait_ns + 50_000_000,
        "the hog added no run-queue wait: alone {:.1} ms, shared {:.1} ms",
        ms(alone.runq_wait_ns),
        ms(shared.runq_wait_ns)
    );
}

#[test]
fn a_departed_workers_time_never_reaches_its_successor() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(1) else { return };
    // A worker that burns CPU in lane 0, read there until it has 200 ms.
    let departed = Proc::spinner(None);
    let gone = departed.pid();
    probe.track(0, gone).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let burned = loop {
        let burned = probe.read(0, gone).on_cpu_ns;
        if burned >= 200_000_000 {
            break burned;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the spinner never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    // It exits and leaves the lane; an idle successor takes the same lane.
    drop(departed);
    probe.untrack(gone).unwrap();
    let successor = Proc::sleeper();
    probe.track(0, successor.pid()).unwrap();
    // A CPU's cell is tagged with the process whose time it holds, and reset when the successor
    // first runs there: what the successor reads is its own, at most the CPU time the kernel gives
    // the whole process (its start included, which on a slow machine is tens of ms), never the
    // departed worker's 200 ms, which stay tagged with the departed pid.
    for _ in 0..2 {
        let read = probe.read(0, successor.pid()).on_cpu_ns;
        let own = procfs::process_schedstat(successor.pid())
            .unwrap()
            .on_cpu_ns;
        assert!(
            read <= own + 5_000_000 && read < burned / 2,
            "the successor reads {:.1} ms on CPU; it used {:.1} ms, the departed worker {:.1} ms",
            ms(read),
            ms(own),
            ms(burned)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_thousand_restarts_leave_no_entries_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lanes = 8;
    let Some(mut probe) = probe(lanes) else {
        return;
    };
    for i in 0..1000u32 {
        let lane = i % lanes;
        // A short-lived process in the lane, like a worker that exits and is replaced.
        let mut child = Command::new("true").spawn().expect("spawn true");
        probe.track(lane, child.id()).unwrap();
        child.wait().unwrap();
        probe.untrack(child.id()).unwrap();
    }
    assert_eq!(probe.tracked().unwrap(), Vec::<u32>::new());
    assert_eq!(probe.waiting_threads().unwrap(), 0);
    // Untracking a pid twice, or one never tracked, is fine.
    probe.untrack(1).unwrap();
}

#[test]
fn lanes_out_of_range_are_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(2) else { return };
    assert!(probe.track(2, std::process::id()).is_err());
    assert_eq!(probe.read(5, std::process::id()), SchedTotals::default());
}

/// Set (to a mode) when this binary runs as a helper process.
const HELPER: &str = "PEREGRINE_EBPF_TEST_HELPER";

/// Not a test: the helper processes' entry. This binary re-executed with [`HELPER`] set runs only
/// this, which runs the mode it names and exits; in a test run it does nothing.
///
/// Modes: `tree` (a process that runs and starts helpers on command), `burn:MS:DEPTH` (spins until
/// it has been on a CPU MS ms, prints it, then runs `burn:MS:DEPTH-1` if DEPTH > 0), `sleep` (waits
/// for its stdin to close), `nest` (starts a `sleep`, then sleeps), `thread_exec` (execs `execed`
/// from a second thread), `execed` (prints its pid, then sleeps), `serve:PORT` (a TCP server that
/// also holds a client connection to PORT).
#[test]
fn helper() {
    let Ok(mode) = std::env::var(HELPER) else {
        return;
    };
    let args: Vec<&str> = mode.split(':').collect();
    match args[..] {
        ["tree"] => tree(),
        ["burn", ms, depth] => burn(ms.parse().unwrap(), depth.parse().unwrap()),
        ["sleep"] => {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        }
        ["nest"] => {
            let child = helper_command("sleep")
                .stdin(Stdio::piped())
                .spawn()
                .unwrap();
            println!("started {}", child.id());
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            drop(Proc(child));
        }
        ["serve", sink] => serve(sink.parse().unwrap()),
        ["thread_exec"] => {
            // Exec from a thread other than the leader: the kernel kills the leader first.
            let thread = std::thread::spawn(|| {
                use std::os::unix::process::CommandExt;
                panic!("exec: {}", helper_command("execed").exec());
            });
            let _ = thread.join();
            panic!("the exec failed");
        }
        ["execed"] => {
            println!("execed {}", std::process::id());
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        }
        _ => panic!("unknown helper mode {mode}"),
    }
    std::process::exit(0);
}

/// This binary as the helper `mode`.
fn helper_command(mode: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args(["--exact", "helper", "--nocapture", "--test-threads=1", "-q"])
        .env(HELPER, mode);
    cmd
}

/// Helper `tree`: on `run MODE`, runs a helper and waits for it (then prints `reaped`); on `start
/// MODE`, starts one (prints `started PID`); when stdin closes, kills what it started and exits.
fn tree() {
    let mut started = Vec::new();
    println!("ready");
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        match line.split_once(' ') {
            Some(("run", mode)) => {
                let status = helper_command(mode).stdin(Stdio::null()).status().unwrap();
                assert!(status.success(), "{mode}: {status}");
                println!("reaped");
            }
            Some(("start", mode)) => {
                let child = helper_command(mode).stdin(Stdio::piped()).spawn().unwrap();
                println!("started {}", child.id());
                started.push(Proc(child));
            }
            _ => panic!("unknown command {line}"),
        }
    }
}

/// Helper `burn`: spins until this process has been on a CPU for `ms` (the kernel's own count, as
/// `schedstat` shows it), prints `burned PID NS`, then runs a child that does the same.
fn burn(ms: u64, depth: u32) {
    let pid = std::process::id();
    let on_cpu = || procfs::process_schedstat(pid).unwrap().on_cpu_ns;
    while on_cpu() < ms * 1_000_000 {
        for i in 0..100_000u64 {
            std::hint::black_box(i);
        }
    }
    println!("burned {pid} {}", on_cpu());
    if depth > 0 {
        let status = helper_command(&format!("burn:{ms}:{}", depth - 1))
            .stdin(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "burn: {status}");
    }
}

/// Helper `serve`: connects to `sink`, listens on an ephemeral port (prints `listening PORT`) and
/// answers one request per connection, then closes it: `ping` with one send, `ping2` with two, `out
/// K` with K sends of a line to `sink` and then one send of `done`.
fn serve(sink: u16) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut out = TcpStream::connect(("127.0.0.1", sink)).unwrap();
    println!("listening {}", listener.local_addr().unwrap().port());
    for conn in listener.incoming() {
        let mut conn = conn.unwrap();
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line).unwrap();
        match line.trim().split_once(' ') {
            None if line.trim() == "ping" => conn.write_all(b"pong\n").unwrap(),
            None if line.trim() == "ping2" => {
                conn.write_all(b"po").unwrap();
                conn.write_all(b"ng\n").unwrap();
            }
            Some(("out", k)) => {
                for _ in 0..k.parse::<u32>().unwrap() {
                    out.write_all(b"x\n").unwrap();
                }
                conn.write_all(b"done\n").unwrap();
            }
            _ => panic!("unknown request {line:?}"),
        }
    }
}

/// A helper process, its stdin, and its stdout's lines; killed (and reaped) on drop.
struct Helper {
    proc: Proc,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Helper {
    fn spawn(mode: &str) -> Helper {
        let mut child = helper_command(mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a helper");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Helper {
            proc: Proc(child),
            stdin,
            lines,
        }
    }

    fn pid(&self) -> u32 {
        self.proc.pid()
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// The next line of its own (the test harness prints some too), within [`DEADLINE`].
    fn line(&self) -> String {
        let own = [
            "ready",
            "reaped",
            "started ",
            "burned ",
            "listening ",
            "execed ",
        ];
        loop {
            let line = self
                .lines
                .recv_timeout(DEADLINE)
                .expect("a line from the helper");
            if own.iter().any(|p| line.starts_with(p)) {
                return line;
            }
        }
    }

    /// The rest of the next line, which must start with `prefix`.
    fn expect(&self, prefix: &str) -> String {
        let line = self.line();
        line.strip_prefix(prefix)
            .unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}"))
            .to_owned()
    }
}

#[test]
fn children_add_to_their_roots_totals_and_leave_the_map_with_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(2) else { return };
    let mut root = Helper::spawn("tree");
    root.expect("ready");
    probe.track(1, root.pid()).unwrap();
    let before = probe.read(1, root.pid());
    let root_before = procfs::process_schedstat(root.pid()).unwrap().on_cpu_ns;
    // A child that burns 200 ms of CPU, then its own child (the root's grandchild) another 200.
    root.send("run burn:200:1");
    let mut burned = Vec::new();
    loop {
        let line = root.line();
        if line == "reaped" {
            break;
        }
        let rest = line.strip_prefix("burned ").expect("burned PID NS");
        let (pid, ns) = rest.split_once(' ').unwrap();
        burned.push((pid.parse::<u32>().unwrap(), ns.parse::<u64>().unwrap()));
    }
    let after = probe.read(1, root.pid());
    let root_own = procfs::process_schedstat(root.pid()).unwrap().on_cpu_ns - root_before;
    let added = delta(before, after).on_cpu_ns;
    let children: u64 = burned.iter().map(|(_, ns)| ns).sum();
    eprintln!(
        "descendants burned {:.1} ms ({burned:?}), the root itself {:.1} ms; its totals rose {:.1} ms",
        ms(children),
        ms(root_own),
        ms(added)
    );
    assert_eq!(burned.len(), 2, "a child and a grandchild");
    // What a process runs after its exit tracepoint (up to a tick of it) is not counted.
    assert!(
        added + 2 * 20_000_000 >= children,
        "the root's totals rose {:.1} ms, its descendants burned {:.1} ms",
        ms(added),
        ms(children)
    );
    assert!(
        added <= children + root_own + 50_000_000,
        "the root's totals rose {:.1} ms, more than its tree used ({:.1} ms)",
        ms(added),
        ms(children + root_own)
    );
    // Both exited: their entries went with them; the root stays.
    assert_eq!(probe.descendants().unwrap(), Vec::new());
    assert_eq!(probe.tracked().unwrap(), vec![root.pid()]);

    // A live child and grandchild are in the map under the root, not among the roots, until the
    // root is untracked.
    root.send("start nest");
    let child: u32 = root.expect("started ").parse().unwrap();
    let grandchild: u32 = root.expect("started ").parse().unwrap();
    let entry = Tracked {
        lane: 1,
        root: root.pid(),
    };
    let mut found = probe.descendants().unwrap();
    found.sort_by_key(|(tgid, _)| *tgid);
    let mut expected = vec![(child, entry), (grandchild, entry)];
    expected.sort_by_key(|(tgid, _)| *tgid);
    assert_eq!(found, expected);
    assert_eq!(probe.tracked().unwrap(), vec![root.pid()]);
    // A child whose leader thread exits while the process lives on (it execs from another thread)
    // keeps its entry.
    root.send("start thread_exec");
    let mut lines = [root.line(), root.line()];
    lines.sort();
    let execer: u32 = lines[0].strip_prefix("execed ").unwrap().parse().unwrap();
    assert_eq!(lines[1], format!("started {execer}"));
    assert!(
        probe.descendants().unwrap().contains(&(execer, entry)),
        "the process that exec'ed from a thread lost its entry"
    );
    probe.untrack(root.pid()).unwrap();
    assert_eq!(probe.descendants().unwrap(), Vec::new());
    assert_eq!(probe.tracked().unwrap(), Vec::<u32>::new());
}

#[test]
fn processes_forked_before_the_root_is_tracked_join_it_when_it_is() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe(2) else { return };
    // A server that forks its workers at once, before the supervisor tracks it (once it is ready).
    let mut root = Helper::spawn("tree");
    root.expect("ready");
    root.send("start nest");
    let child: u32 = root.expect("started ").parse().unwrap();
    let grandchild: u32 = root.expect("started ").parse().unwrap();
    assert_eq!(
        probe.descendants().unwrap(),
        Vec::new(),
        "nothing tracked yet"
    );
    probe.track(0, root.pid()).unwrap();
    let entry = Tracked {
        lane: 0,
        root: root.pid(),
    };
    let mut found = probe.descendants().unwrap();
    found.sort_by_key(|(tgid, _)| *tgid);
    let mut expected = vec![(child, entry), (grandchild, entry)];
    expected.sort_by_key(|(tgid, _)| *tgid);
    assert_eq!(found, expected);
    assert_eq!(probe.descendant_entries(), 2, "counted in the budget");
    probe.untrack(root.pid()).unwrap();
    assert_eq!(probe.descendants().unwrap(), Vec::new());
    assert_eq!(probe.descendant_entries(), 0, "the places are back");
}

#[test]
fn descendants_past_their_budget_are_not_counted_and_places_are_given_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe_with_budget(1, 1) else {
        return;
    };
    let mut root = Helper::spawn("tree");
    root.expect("ready");
    probe.track(0, root.pid()).unwrap();
    let entry = Tracked {
        lane: 0,
        root: root.pid(),
    };
    // A child and a grandchild, with room for one: the grandchild is not counted.
    root.send("start nest");
    let child: u32 = root.expect("started ").parse().unwrap();
    let _grandchild: u32 = root.expect("started ").parse().unwrap();
    assert_eq!(probe.descendants().unwrap(), vec![(child, entry)]);
    assert_eq!(probe.descendant_entries(), 1);
    // Untracking the root gives the child's place back.
    probe.untrack(root.pid()).unwrap();
    assert_eq!(probe.descendants().unwrap(), Vec::new());
    assert_eq!(probe.descendant_entries(), 0);
    // And so does a child's exit: the next child is counted. (Another root: tracked again, this one
    // would take its live child back at once, as a root forked before it was tracked.)
    let mut other = Helper::spawn("tree");
    other.expect("ready");
    probe.track(0, other.pid()).unwrap();
    let entry = Tracked {
        lane: 0,
        root: other.pid(),
    };
    other.send("run burn:10:0");
    let burned = other.expect("burned ");
    other.expect("reaped");
    let burner: u32 = burned.split_once(' ').unwrap().0.parse().unwrap();
    assert_ne!(burner, 0);
    assert_eq!(probe.descendant_entries(), 0);
    other.send("start sleep");
    let sleeper: u32 = other.expect("started ").parse().unwrap();
    assert_eq!(probe.descendants().unwrap(), vec![(sleeper, entry)]);
    assert_eq!(probe.descendant_entries(), 1);
}

/// Sends `request` on a new connection to `port`; the answer, read until the server closes.
fn request(port: u16, request: &str) -> String {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    writeln!(conn, "{request}").unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn sends_on_the_listeners_accepted_connections_count_as_requests() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(probe) = probe(2) else { return };
    // Linux 6.3 and later have the tracepoint, which is tried first.
    let release = rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned();
    let version: Vec<u32> = release
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    if version.as_slice() >= [6, 3].as_slice() {
        assert_eq!(
            probe.send_hook().ok(),
            Some(SendHook::SockSendLength),
            "{release}"
        );
    }
    sends_count_as_requests(probe);
}

/// The count where the kernel has no `sock_send_length` (Linux 6.1): at `tcp_sendmsg`'s return,
/// the same, send for send.
#[test]
fn sends_count_the_same_at_tcp_sendmsgs_return_as_kernels_before_6_3_do() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(probe) = probe_with(2, MAX_DESCENDANTS, &[SendHook::TcpSendmsg]) else {
        return;
    };
    match probe.send_hook() {
        Ok(hook) => assert_eq!(hook, SendHook::TcpSendmsg),
        // Refused before the verifier saw it (no log): a kernel that allows no fexit program at
        // all, as some hypervisors' kernels do. A program the verifier rejects fails here.
        Err(why) if refused_outright(&why) => {
            peregrine_testenv::skip(
                &peregrine_testenv::current_test(),
                format_args!(
                    "this kernel refuses fexit programs: {}",
                    ErrorChain(why.as_ref())
                ),
            );
            return;
        }
        Err(why) => panic!("{}", ErrorChain(why.as_ref())),
    }
    sends_count_as_requests(probe);
}

/// Whether `why` is the kernel refusing to load the program with EPERM, with an empty verifier log.
fn refused_outright(why: &peregrine_ebpf::SendsError) -> bool {
    let text = ErrorChain(why).to_string();
    text.contains("Operation not permitted") && text.contains("Verifier output: :")
}

/// Asked for no hook, the probe loads and counts no sends.
#[test]
fn a_probe_without_a_send_hook_counts_no_sends() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut probe) = probe_with(1, MAX_DESCENDANTS, &[]) else {
        return;
    };
    assert!(!probe.counts_sends());
    let me = std::process::id();
    probe.track(0, me).unwrap();
    assert!(probe.count_sends(0, 8080).is_err());
    assert_eq!(probe.counted_port(0).unwrap(), None);
}

/// Lane 0 counts its listener's sends, lane 1 (the same server) is given no port, through `probe`'s
/// send hook.
fn sends_count_as_requests(mut probe: Probe) {
    let sink = TcpListener::bind("127.0.0.1:0").unwrap();
    let sink_port = sink.local_addr().unwrap().port();
    // Lane 0 counts its listener's sends; lane 1, the same server, is not given a port.
    let counted = Helper::spawn(&format!("serve:{sink_port}"));
    let counted_port: u16 = counted.expect("listening ").parse().unwrap();
    let (mut counted_out, _) = sink.accept().unwrap();
    counted_out.set_read_timeout(Some(DEADLINE)).unwrap();
    let plain = Helper::spawn(&format!("serve:{sink_port}"));
    let plain_port: u16 = plain.expect("listening ").parse().unwrap();
    probe.track(0, counted.pid()).unwrap();
    probe.count_sends(0, counted_port).unwrap();
    probe.track(1, plain.pid()).unwrap();
    assert_eq!(probe.counted_port(0).unwrap(), Some(counted_port));
    assert_eq!(probe.counted_port(1).unwrap(), None);
    let region = CounterRegion::map(probe.counters(), 2).unwrap();
    let count = |lane: usize| region.lane(lane).load(std::sync::atomic::Ordering::Relaxed);
    let (start0, start1) = (count(0), count(1));

    // One send per answer: exactly one count per request.
    const N: u64 = 50;
    for _ in 0..N {
        assert_eq!(request(counted_port, "ping"), "pong\n");
    }
    assert_eq!(count(0) - start0, N);
    // Twenty sends on its own connection to another port count nothing; the answer counts one.
    assert_eq!(request(counted_port, "out 20"), "done\n");
    let mut lines = BufReader::new(&mut counted_out);
    for _ in 0..20 {
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        assert_eq!(line, "x\n");
    }
    assert_eq!(count(0) - start0, N + 1);
    // An answer written in two sends counts two.
    assert_eq!(request(counted_port, "ping2"), "pong\n");
    assert_eq!(count(0) - start0, N + 3);
    // A lane without a port counts nothing.
    for _ in 0..10 {
        assert_eq!(request(plain_port, "ping"), "pong\n");
    }
    assert_eq!(count(1), start1);
    // Once stopped, nothing more.
    probe.stop_counting(0).unwrap();
    assert_eq!(request(counted_port, "ping"), "pong\n");
    assert_eq!(count(0) - start0, N + 3);
    // Untracking the root stops its lane's counting too.
    probe.count_sends(1, plain_port).unwrap();
    assert_eq!(request(plain_port, "ping"), "pong\n");
    assert_eq!(count(1) - start1, 1);
    probe.untrack(plain.pid()).unwrap();
    assert_eq!(probe.counted_port(1).unwrap(), None);
}
