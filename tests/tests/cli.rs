//! The command line: configuration errors are one line per problem, naming the key and line, with exit
//! code 78 (each exit code is the documented one), and `run` starts nothing on a bad config or a sampler it cannot run; `--version` names
//! the commit and the sampler, commands read the installed config when given none, and the manual
//! pages come from the same definitions.

use std::{path::Path, process::Command};

use peregrine_e2e::{
    PeregrineToml, ServiceTable, TempDir, config::Sampler, peregrine_path, workspace_root,
};

/// Where the package installs the config, which commands read when given none.
const INSTALLED_CONFIG: &str = "/etc/peregrine/peregrine.toml";

/// `peregrine ARGS`: the exit code, stdout and stderr.
fn peregrine_args(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(peregrine_path())
        .args(args)
        .output()
        .expect("run peregrine");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn peregrine(args: &[&str], config: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peregrine.toml");
    std::fs::write(&path, config).unwrap();
    let output = Command::new(peregrine_path())
        .args(args)
        .arg(&path)
        .output()
        .expect("run peregrine");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_bad_value_is_one_line_naming_the_key() {
    let (code, _, stderr) = peregrine(
        &["check"],
        "[service.cluster]\ncount = 2\nurl = \"http://127.0.0.1:8080\"\n",
    );
    assert_eq!(code, 78, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("line 3: service.cluster.url: fixed port 8080 cannot serve 2 workers"),
        "{stderr}"
    );
}

#[test]
fn a_service_envoy_could_not_reach_is_refused_at_its_line() {
    // The xDS cluster's name, a route another service takes, and a name that is no bare key: each
    // at its line, and no terminal escape on stderr.
    let (code, _, stderr) = peregrine(
        &["check"],
        "[service.web]\nprefix = \"/\"\n\n[service.xds_cluster]\nprefix = \"/x\"\n\n\
         [service.www]\nprefix = \"/\"\n\n[service.\"\\u001b[2Jweb\"]\nprefix = \"/y\"\n",
    );
    assert_eq!(code, 78, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines[0].contains(": line 10: service.\"\\u001B[2Jweb\": names may use only"),
        "{stderr}"
    );
    assert!(
        lines[1].contains(
            ": line 4: service.xds_cluster: is, by default (supervisor.xds_cluster), \
                           the cluster in Envoy's bootstrap that reaches the supervisor's gRPC port"
        ),
        "{stderr}"
    );
    assert!(
        lines[2].contains(": line 8: service.www.prefix: \"/\" is the prefix of service web too"),
        "{stderr}"
    );
    assert!(!stderr.contains('\x1b'), "{stderr:?}");
}

#[test]
fn a_type_error_and_an_unknown_key_are_named() {
    let (code, _, stderr) = peregrine(&["check"], "[supervisor]\nbind = 18000\n");
    assert_eq!(code, 78);
    assert!(
        stderr.contains("line 2: supervisor.bind: expected a string, found integer `18000`"),
        "{stderr}"
    );
    let (code, _, stderr) = peregrine(&["run"], "[service.cluster]\ncuont = 2\n");
    assert_eq!(
        code, 78,
        "run refuses a bad config before starting anything"
    );
    assert!(
        stderr
            .contains("line 2: service.cluster.cuont: unknown key `cuont`: did you mean `count`?"),
        "{stderr}"
    );
}

#[test]
fn a_good_config_checks_and_bootstraps() {
    let mut config = PeregrineToml::default();
    config.service("cluster", ServiceTable::default().count(2));
    let config = config.toml();
    let (code, stdout, stderr) = peregrine(&["check"], &config);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ok (1 service, 2 workers)"), "{stdout}");
    let (code, yaml, stderr) = peregrine(&["envoy-bootstrap"], &config);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        yaml.contains("xds_cluster") && yaml.contains("cluster"),
        "{yaml}"
    );
}

#[test]
fn run_refuses_an_ebpf_sampler_that_cannot_load_before_starting_anything() {
    // No capabilities, even as root: the kernel refuses to load the programs.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peregrine.toml");
    let mut config = PeregrineToml::default();
    config.supervisor.sampler = Some(Sampler::Ebpf);
    config.service("cluster", ServiceTable::default());
    std::fs::write(&path, config.toml()).unwrap();
    let Ok(output) = Command::new("setpriv")
        .args(["--bounding-set=-all", "--inh-caps=-all", "--"])
        .arg(peregrine_path())
        .arg("run")
        .arg(&path)
        .output()
    else {
        peregrine_e2e::skip(
            &peregrine_e2e::current_test(),
            "setpriv (util-linux) is not installed",
        );
        return;
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "nothing else ran: {stderr}");
    assert!(
        stderr.starts_with("error: sampler = \"ebpf\": the eBPF sampler cannot load"),
        "{stderr}"
    );
    assert!(
        stderr.contains("CAP_BPF") || stderr.contains("not built"),
        "the error says what is missing: {stderr}"
    );
}

#[test]
fn json_logs_are_one_object_per_line_from_the_supervisor_and_its_workers() {
    let dir = peregrine_e2e::TempDir::new().unwrap();
    let port = peregrine_e2e::free_port();
    let mut config = PeregrineToml::local(peregrine_e2e::free_port());
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{port}")));
    let mut supervisor = peregrine_e2e::Supervisor::start_in_with_env(
        &peregrine_path(),
        dir.path(),
        &config.toml_in(dir.path()),
        &[("PEREGRINE_LOG_FORMAT", "json"), ("RUST_LOG", "info")],
    )
    .unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    peregrine_e2e::wait_until(
        std::time::Duration::from_secs(30),
        "the worker answering",
        || peregrine_e2e::http_get(addr, "/").ok(),
    );
    let stderr = dir.path().join("peregrine.stderr.log");
    // The worker logs its listener, the supervisor the registration.
    let lines = peregrine_e2e::wait_until(
        std::time::Duration::from_secs(10),
        "the registration in the log",
        || {
            let text = std::fs::read_to_string(&stderr).ok()?;
            text.contains("registered")
                .then(|| text.lines().map(str::to_owned).collect::<Vec<_>>())
        },
    );
    supervisor.stop().unwrap();
    let events: Vec<serde_json::Value> = lines
        .iter()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    assert!(events.len() >= 3, "{lines:?}");
    for event in &events {
        for key in ["timestamp", "level", "target", "message"] {
            assert!(event.get(key).is_some(), "no {key} in {event}");
        }
    }
    // Fields are top-level keys beside the message, e.g. the sampler's kind.
    assert!(
        events
            .iter()
            .any(|e| e["message"] == "Sampling workers" && e.get("sampler").is_some()),
        "{lines:?}"
    );
    assert!(
        events.iter().any(|e| e["target"]
            .as_str()
            .is_some_and(|t| t.starts_with("peregrine_worker"))),
        "a worker's own line: {lines:?}"
    );
}

/// Each row of docs/operating.md's exit codes that a command can reach here, reached: the table is
/// held to the binary's codes by the binary's own test, and the binary to the table here.
#[test]
fn each_kind_of_failure_exits_with_its_documented_code() {
    let dir = TempDir::new().unwrap();
    let config = dir.path().join("peregrine.toml");
    let socket = dir.path().join("peregrine.sock");
    std::fs::write(
        &config,
        format!(
            "[supervisor]\ncontrol = \"{}\"\n[service.web]\n",
            socket.display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let missing = dir.path().join("missing.toml").display().to_string();
    for (args, code, says) in [
        (vec!["check", "--no-such-flag"], 64, "unexpected argument"),
        (vec!["status", "--interval"], 64, "a value is required"),
        (vec!["check", &missing], 66, "cannot read"),
        (vec!["status", &missing], 66, "cannot read"),
        (vec!["status", &config], 69, "no supervisor is running"),
        (vec!["reload", &config], 69, "no supervisor is running"),
        (vec!["upgrade", &config], 69, "no supervisor is running"),
        (vec!["check", "--help"], 0, "Usage: peregrine check"),
    ] {
        let (got, stdout, stderr) = peregrine_args(&args);
        assert_eq!(got, code, "peregrine {args:?}: {stdout}{stderr}");
        assert!(
            format!("{stdout}{stderr}").contains(says),
            "peregrine {args:?}: {stdout}{stderr}"
        );
    }
    let (got, _, stderr) = peregrine(&["check"], "[service.web]\ncount = \"2\"\n");
    assert_eq!(got, 78, "{stderr}");
}

/// `check` reads every file the config names, `[envoy.tls]`'s too: each one that cannot be read is
/// an error line of its own at its key and line, and a key that is not its certificate's is named.
#[test]
fn check_reads_every_tls_file_and_names_each_one_at_its_line() {
    let dir = TempDir::new().unwrap();
    let (code, _, stderr) =
        peregrine_args(&["tls", "init", &dir.path().join("tls").display().to_string()]);
    assert_eq!(code, 0, "{stderr}");
    let config = |files: [&str; 9]| {
        format!(
            "[supervisor]\nbind = \"http://127.0.0.1:18000\"\n\
             [supervisor.tls]\ncert = \"tls/{}\"\nkey = \"tls/{}\"\nclient_ca = \"tls/{}\"\n\
             [envoy.tls]\ncert = \"tls/{}\"\nkey = \"tls/{}\"\nca = \"tls/{}\"\n\
             [cluster]\netcd = [\"https://127.0.0.1:2379\"]\n\
             [cluster.tls]\nca = \"tls/{}\"\ncert = \"tls/{}\"\nkey = \"tls/{}\"\n\
             [service.web]\n",
            files[0],
            files[1],
            files[2],
            files[3],
            files[4],
            files[5],
            files[6],
            files[7],
            files[8]
        )
    };
    let path = dir.path().join("peregrine.toml");
    std::fs::write(&path, config(["missing.pem"; 9])).unwrap();
    let check = || peregrine_args(&["check", &path.display().to_string()]);
    let (code, _, stderr) = check();
    assert_eq!(code, 78, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    let keys = [
        (4, "supervisor.tls.cert"),
        (5, "supervisor.tls.key"),
        (6, "supervisor.tls.client_ca"),
        (8, "envoy.tls.cert"),
        (9, "envoy.tls.key"),
        (10, "envoy.tls.ca"),
        (14, "cluster.tls.ca"),
        (15, "cluster.tls.cert"),
        (16, "cluster.tls.key"),
    ];
    assert_eq!(lines.len(), keys.len(), "{stderr}");
    for (line, (number, key)) in lines.iter().zip(keys) {
        assert!(
            line.starts_with("error: ")
                && line.contains(&format!(": line {number}: {key}: cannot read "))
                && line.contains("missing.pem"),
            "{line}"
        );
    }
    // Every file readable, Envoy's key not its certificate's.
    std::fs::write(
        &path,
        config([
            "server.pem",
            "server.key",
            "ca.pem",
            "envoy.pem",
            "server.key",
            "ca.pem",
            "etcd-ca.pem",
            "etcd-client.pem",
            "etcd-client.key",
        ]),
    )
    .unwrap();
    let (code, _, stderr) = check();
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.trim_end().lines().count() == 1
            && stderr.contains(": line 9: envoy.tls.key: ")
            && stderr.contains("not the key of"),
        "{stderr}"
    );
}

/// `check --unit` checks as the package's unit will run the supervisor: a file the config names
/// under a folder the unit hides (`ProtectHome=yes`) is an error there, and not without `--unit`.
#[test]
fn check_as_the_unit_refuses_what_the_unit_hides() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("peregrine.toml");
    std::fs::write(
        &path,
        "[cluster]\netcd = [\"https://127.0.0.1:2379\"]\nhost = \"a\"\n[cluster.tls]\n\
         ca = \"/root/etcd-ca.pem\"\n[service.web]\n",
    )
    .unwrap();
    let path = path.display().to_string();
    let (code, _, stderr) = peregrine_args(&["check", "--unit", &path]);
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains(
            ": line 5: cluster.tls.ca: /root/etcd-ca.pem is under /root, which the \
                         package's unit hides"
        ),
        "{stderr}"
    );
    let (_, _, stderr) = peregrine_args(&["check", &path]);
    assert!(!stderr.contains("hides"), "{stderr}");
}

/// `check` prints what `run` would warn of at its start (the same list), and a port another program
/// holds, where the start would stop; and still passes.
#[test]
fn check_prints_the_warnings_run_would_give() {
    // Held for the check, as by another program.
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let grpc = taken.local_addr().unwrap().port();
    let metrics = peregrine_e2e::free_port();
    let (code, stdout, stderr) = peregrine(
        &["check"],
        &format!(
            "[supervisor]\nbind = \"http://0.0.0.0:{grpc}\"\nmetrics = \"http://0.0.0.0:{metrics}\"\n\
             [service.web]\nurl = \"http://127.0.0.1:80\"\n"
        ),
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(": ok (1 service, 1 worker)"), "{stdout}");
    for warning in [
        format!("The gRPC port (0.0.0.0:{grpc}) is reachable from other hosts and has no TLS"),
        format!("supervisor.bind: 0.0.0.0:{grpc} is taken by another program"),
        format!("Prometheus metrics (0.0.0.0:{metrics}) are served beyond this host"),
        "service.web: These workers bind a privileged port (80) themselves".to_owned(),
    ] {
        assert!(
            stderr
                .lines()
                .any(|line| line.starts_with("warning: ") && line.contains(&warning)),
            "{warning}: {stderr}"
        );
    }
    assert!(
        !stderr.contains("supervisor.metrics"),
        "a free port: {stderr}"
    );
}

#[test]
fn an_unknown_log_format_is_a_usage_error() {
    let output = Command::new(peregrine_path())
        .args(["check", "/nonexistent.toml"])
        .env("PEREGRINE_LOG_FORMAT", "xml")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr).trim(),
        "peregrine: PEREGRINE_LOG_FORMAT must be \"text\" or \"json\", got \"xml\""
    );
}

#[test]
fn the_version_names_the_commit_and_whether_the_ebpf_sampler_is_built_in() {
    let (code, stdout, stderr) = peregrine_args(&["--version"]);
    assert_eq!(code, 0, "{stderr}");
    let line = stdout.trim();
    let inside = line
        .strip_prefix(&format!("peregrine {} (", env!("CARGO_PKG_VERSION")))
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not `peregrine VERSION (COMMIT, SAMPLER)`: {line:?}"));
    let (commit, sampler) = inside
        .split_once(", ")
        .unwrap_or_else(|| panic!("no commit and sampler: {line:?}"));
    // The sampler this build has, as the eBPF crate itself says (built by the same cargo).
    let expected = if peregrine_ebpf::object().is_ok() {
        "eBPF sampler built in"
    } else {
        "eBPF sampler not built in: procfs only"
    };
    assert_eq!(sampler, expected, "{line:?}");
    if std::env::var("PEREGRINE_REQUIRE_EBPF").is_ok_and(|v| v == "1") {
        assert_eq!(sampler, "eBPF sampler built in", "{line:?}");
    }
    // Built in this git tree: one of its commits (HEAD may have moved on since the build).
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(args)
            .output()
            .is_ok_and(|output| output.status.success())
    };
    if git(&["rev-parse", "--git-dir"]) {
        assert!(
            commit.len() >= 7 && commit.bytes().all(|b| b.is_ascii_hexdigit()),
            "not a short hash: {line:?}"
        );
        assert!(
            git(&["cat-file", "-e", &format!("{commit}^{{commit}}")]),
            "{commit} is no commit of this repository: {line:?}"
        );
    } else {
        assert!(
            !commit.is_empty() && !commit.contains(char::is_whitespace),
            "{line:?}"
        );
    }
}

#[test]
fn commands_read_the_installed_config_when_given_none_and_say_so() {
    for command in [
        "run",
        "check",
        "envoy-bootstrap",
        "status",
        "restart",
        "reload",
        "upgrade",
    ] {
        let (code, help, stderr) = peregrine_args(&[command, "--help"]);
        assert_eq!(code, 0, "{stderr}");
        assert!(
            help.contains(&format!("[default: {INSTALLED_CONFIG}]")),
            "`peregrine {command} --help` names no default config:\n{help}"
        );
    }
    // Check, and status with no flags at all, read the installed config: on a machine without one,
    // an error naming it, with the exit code of a missing input.
    for command in ["check", "status"] {
        let (code, stdout, stderr) = peregrine_args(&[command]);
        let said = format!("{stdout}{stderr}");
        assert!(
            said.contains(INSTALLED_CONFIG),
            "`peregrine {command}` names no config: {said}"
        );
        if !Path::new(INSTALLED_CONFIG).exists() {
            assert_eq!(code, 66, "{said}");
        }
    }
}

#[test]
fn the_manual_pages_are_written_from_the_command_line() {
    let dir = TempDir::new().unwrap();
    let out = dir.path().join("man1");
    let (code, stdout, stderr) = peregrine_args(&["man", &out.display().to_string()]);
    assert_eq!(code, 0, "{stderr}");
    let page = |name: &str| {
        std::fs::read_to_string(out.join(name))
            .unwrap_or_else(|e| panic!("no {name} ({e}); wrote:\n{stdout}"))
    };
    let main = page("peregrine.1");
    assert!(main.contains(".TH peregrine 1"), "{main}");
    for command in [
        "run",
        "check",
        "envoy-bootstrap",
        "status",
        "restart",
        "reload",
        "upgrade",
        "tls",
    ] {
        assert!(
            // Roff escapes each hyphen.
            main.contains(&format!("peregrine\\-{}(1)", command.replace('-', "\\-"))),
            "peregrine.1 lists no {command}:\n{main}"
        );
        let sub = page(&format!("peregrine-{command}.1"));
        assert!(sub.contains(".SH SYNOPSIS"), "{sub}");
    }
    assert!(page("peregrine-tls-init.1").contains("\\-\\-san"));
    // Hidden commands have no page; their own help says how they are run.
    for hidden in ["man", "exec-passed", "help"] {
        assert!(
            !out.join(format!("peregrine-{hidden}.1")).exists(),
            "{hidden}"
        );
    }
    assert!(
        page("peregrine-check.1").contains(INSTALLED_CONFIG),
        "the default config is in the page"
    );
    // The sections a manual page has and clap does not write.
    for section in ["EXIT STATUS", "SIGNALS", "ENVIRONMENT", "FILES", "SEE ALSO"] {
        assert!(
            main.contains(&format!(".SH \"{section}\""))
                || main.contains(&format!(".SH {section}")),
            "peregrine.1 has no {section}:\n{main}"
        );
    }
    for code in ["64", "66", "69", "75", "77", "78"] {
        assert!(
            main.contains(&format!("\\fB{code}\\fR")),
            "exit {code}:\n{main}"
        );
    }
    let status = page("peregrine-status.1");
    assert!(
        status.contains("EXIT STATUS") && status.contains("peregrine.toml(5)"),
        "{status}"
    );
    // peregrine.toml(5), from the configuration reference: every key of it.
    let toml = std::fs::read_to_string(out.join("peregrine.toml.5")).expect("peregrine.toml.5");
    assert!(toml.contains(".TH peregrine.toml 5"), "{toml}");
    let reference =
        std::fs::read_to_string(workspace_root().join("docs/configuration.md")).unwrap();
    for line in reference.lines().filter(|l| l.starts_with("| `")) {
        let key = line[3..].split('`').next().unwrap();
        assert!(
            toml.contains(&format!("\\fB{}\\fR", key.replace('-', "\\-"))),
            "peregrine.toml(5) lacks {key}"
        );
    }
}
