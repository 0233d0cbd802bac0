//! `peregrine status` against the real supervisor: a worker's requests over HTTP/1.1 and h2c are
//! counted exactly, its CPU is sampled, and a killed worker's replacement starts from zero with one
//! restart on its slot. Without a supervisor, status says so in one line.

use std::{net::SocketAddr, process::Command, time::Duration};

use peregrine_e2e::{
    PeregrineToml, ServiceTable, Supervisor, config::Sampler, ebpf_or_skip, free_port, http_get,
    peregrine_path, python_clients_or_skip, try_wait_until, worker_pid, workspace_root,
};
use serde_json::Value;

/// Requests `tests/clients/h2_client.py` hands to the application: 50 concurrent streams, then one after
/// the malformed stream (which h2 resets before the application could see it).
const H2_CLIENT_REQUESTS: u64 = 51;

/// The row of `web`'s worker 0 in a `status --json` answer; none before the slot's first worker
/// started.
fn web_row(status: &Value) -> Option<Value> {
    status["workers"]
        .as_array()
        .and_then(|rows| {
            rows.iter()
                .find(|row| row["service"] == "web" && row["index"] == 0)
        })
        .cloned()
}

/// `status --json` until `ready` accepts `web`'s row; returns that row.
#[track_caller]
fn wait_for_row(supervisor: &Supervisor, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    let found = try_wait_until(Duration::from_secs(30), what, || {
        last = web_row(&supervisor.status_json().ok()?)?;
        ready(&last).then(|| last.clone())
    });
    found.unwrap_or_else(|error| panic!("{error}; last row: {last}"))
}

#[test]
fn status_counts_every_request_and_follows_a_restart_with_procfs() {
    counts_every_request_and_follows_a_restart(Sampler::Procfs);
}

#[test]
fn status_counts_every_request_and_follows_a_restart_with_ebpf() {
    if ebpf_or_skip("status_counts_every_request_and_follows_a_restart_with_ebpf") {
        counts_every_request_and_follows_a_restart(Sampler::Ebpf);
    }
}

/// Requests over HTTP/1.1 and h2c counted exactly in `status`, CPU sampled, and a killed worker's
/// replacement counted from zero, with `sampler` (its counters: a memfd for procfs, the BPF map for eBPF).
fn counts_every_request_and_follows_a_restart(sampler: Sampler) {
    let port = free_port();
    let mut config = PeregrineToml::local(free_port()).with_envoy(free_port(), free_port());
    config.supervisor.sampler = Some(sampler);
    config.supervisor.sample_interval_ms = Some(100);
    config.service("web", ServiceTable::at(format!("http://127.0.0.1:{port}")));
    let supervisor = Supervisor::start(&config.toml());
    let addr = SocketAddr::from(([127, 0, 0, 1], port));

    // Registered means listening: wait through status, not with requests that would be counted.
    let first = wait_for_row(&supervisor, "the worker registered", |row| {
        row["pid"].is_u64()
    });
    let pid = first["pid"].as_u64().unwrap();
    assert_eq!(first["restarts"], 0, "{first}");

    const HTTP1_REQUESTS: u64 = 7;
    for i in 0..HTTP1_REQUESTS {
        let (status, body) =
            http_get(addr, "/").unwrap_or_else(|e| panic!("request {i} failed: {e:#}"));
        assert_eq!(
            (status, worker_pid(&body)),
            (200, Some(pid as u32)),
            "{body}"
        );
    }
    let h2_requests =
        match python_clients_or_skip("status_counts_every_request_and_follows_a_restart (h2 part)")
        {
            Some(python) => {
                let output = Command::new(python)
                    .arg(workspace_root().join("tests/clients/h2_client.py"))
                    .arg(addr.ip().to_string())
                    .arg(addr.port().to_string())
                    .output()
                    .expect("python runs");
                assert!(
                    output.status.success(),
                    "h2_client.py failed:\n{}\n{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
                H2_CLIENT_REQUESTS
            }
            None => 0,
        };
    let expected = HTTP1_REQUESTS + h2_requests;

    let row = wait_for_row(
        &supervisor,
        &format!("requests_total {expected} and CPU sampled"),
        |row| {
            row["requests_total"] == expected
                && row["cpu_cores"].is_f64()
                && row["runq_wait_cores"].is_f64()
                && row["requests_per_second"].is_f64()
        },
    );
    assert_eq!(row["pid"], pid, "{row}");
    assert_eq!(row["restarts"], 0, "{row}");
    assert!(
        row["cpu_seconds_total"].as_f64().unwrap() > 0.0,
        "serving took CPU: {row}"
    );
    assert!(
        row["runq_wait_seconds_total"].as_f64().unwrap() >= 0.0,
        "{row}"
    );
    // Counted exactly: the count stays put while nothing is sent.
    let sampled_at = row["sampled_at_unix_ms"].as_u64().unwrap();
    let later = wait_for_row(&supervisor, "a later sample", |row| {
        row["sampled_at_unix_ms"].as_u64() > Some(sampled_at)
    });
    assert_eq!(later["requests_total"], expected, "{later}");
    // The whole answer is what `status --schema` says it is.
    let schema = schema();
    let answer = supervisor.status_json().unwrap();
    let mismatches = conforms(&answer, &schema, &schema, "$");
    assert!(mismatches.is_empty(), "{mismatches:#?}\n{answer:#}");

    let table = supervisor.status_table().unwrap();
    let mut lines = table.lines();
    assert_eq!(
        lines.next(),
        Some(format!("sampler: {}, every 100 ms", sampler.as_str()).as_str()),
        "{table}"
    );
    assert!(
        lines
            .next()
            .unwrap()
            .ends_with("no Envoy connected for endpoints"),
        "{table}"
    );
    assert_eq!(
        lines.next(),
        Some(
            "service web: concurrency many (the built-in worker), a listener per worker, orca over \
             the workers"
        ),
        "{table}"
    );
    assert!(
        lines.next().unwrap().starts_with("SERVICE  WORKER"),
        "{table}"
    );
    let web = lines.next().unwrap_or_default();
    let cells: Vec<&str> = web.split_whitespace().collect();
    assert_eq!(cells[..3], ["web", "0", &pid.to_string()], "{table}");
    assert_eq!(cells.last(), Some(&"0"), "no restarts: {table}");

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .expect("kill the worker");
    let replacement = wait_for_row(&supervisor, "the replacement sampled", |row| {
        row["pid"].is_u64() && row["pid"] != pid && row["requests_total"].is_u64()
    });
    assert_eq!(replacement["restarts"], 1, "{replacement}");
    assert_eq!(
        replacement["requests_total"], 0,
        "a new worker counts from zero: {replacement}"
    );
}

/// `peregrine status --schema`: the JSON Schema of `--json`'s object.
fn schema() -> Value {
    let output = Command::new(peregrine_path())
        .args(["status", "--schema"])
        .output()
        .expect("peregrine status --schema");
    assert!(output.status.success(), "{output:?}");
    serde_json::from_slice(&output.stdout).expect("a JSON schema")
}

/// Where `value` (at `path`) departs from `schema`: a type it is not, a required property it
/// lacks, a property the schema does not know (every object of the answer is described whole).
/// The keywords `schemars` writes: `$ref` into `$defs`, `type` (one or a list), `anyOf`, `properties`
/// with `required`, `additionalProperties` (a map's values), `items`, `minimum`.
fn conforms(value: &Value, schema: &Value, root: &Value, path: &str) -> Vec<String> {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.trim_start_matches("#/$defs/");
        return conforms(value, &root["$defs"][name], root, path);
    }
    if let Some(branches) = schema["anyOf"].as_array() {
        return if branches
            .iter()
            .any(|branch| conforms(value, branch, root, path).is_empty())
        {
            Vec::new()
        } else {
            vec![format!("{path}: {value} is none of {schema}")]
        };
    }
    let kind = match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let allowed: Vec<&str> = match &schema["type"] {
        Value::String(one) => vec![one.as_str()],
        Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let fits = |allowed: &str| allowed == kind || (allowed == "number" && kind == "integer");
    if !allowed.is_empty() && !allowed.iter().any(|a| fits(a)) {
        return vec![format!("{path}: {kind} where the schema says {allowed:?}")];
    }
    if let (Some(minimum), Some(number)) = (schema["minimum"].as_f64(), value.as_f64())
        && number < minimum
    {
        return vec![format!("{path}: {number} below {minimum}")];
    }
    let mut found = Vec::new();
    match value {
        Value::Object(object) => {
            if let Some(properties) = schema["properties"].as_object() {
                for required in schema["required"].as_array().into_iter().flatten() {
                    let name = required.as_str().unwrap_or_default();
                    if !object.contains_key(name) {
                        found.push(format!("{path}: no {name}"));
                    }
                }
                for (name, field) in object {
                    match properties.get(name) {
                        Some(property) => {
                            found.extend(conforms(field, property, root, &format!("{path}.{name}")))
                        }
                        None => found.push(format!("{path}.{name}: not in the schema")),
                    }
                }
            } else if schema["additionalProperties"].is_object() {
                for (name, field) in object {
                    found.extend(conforms(
                        field,
                        &schema["additionalProperties"],
                        root,
                        &format!("{path}.{name}"),
                    ));
                }
            }
        }
        Value::Array(items) if schema["items"].is_object() => {
            for (index, item) in items.iter().enumerate() {
                found.extend(conforms(
                    item,
                    &schema["items"],
                    root,
                    &format!("{path}[{index}]"),
                ));
            }
        }
        _ => {}
    }
    found
}

#[test]
fn the_schema_catches_what_it_should() {
    let schema = schema();
    assert_eq!(schema["title"], "StatusView", "{schema}");
    let empty = serde_json::json!({
        "sampler": null, "sample_interval_ms": null, "workers": [], "revision": 0,
        "xds_streams": [], "fleet": null, "supervisor": null, "services": {}, "listeners": {}
    });
    assert_eq!(
        conforms(&empty, &schema, &schema, "$"),
        Vec::<String>::new()
    );
    let mut wrong = empty.clone();
    wrong["revision"] = Value::from("two");
    wrong["extra"] = Value::from(1);
    wrong["listeners"] = serde_json::json!({"web": {"queued": 1}});
    let found = conforms(&wrong, &schema, &schema, "$");
    assert_eq!(found.len(), 3, "{found:#?}");
}

#[test]
fn status_without_a_supervisor_says_so_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("peregrine.sock");
    let config = dir.path().join("peregrine.toml");
    let mut text = PeregrineToml::default();
    text.supervisor.control = Some(socket.display().to_string());
    text.service("web", ServiceTable::default());
    std::fs::write(&config, text.toml()).unwrap();
    let by_config = ["status".as_ref(), config.as_os_str()];
    let by_socket = ["status".as_ref(), "--socket".as_ref(), socket.as_os_str()];
    // No socket file, then a stale one nobody listens on.
    for stale in [false, true] {
        if stale {
            drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        }
        for args in [&by_config[..], &by_socket[..]] {
            let output = Command::new(peregrine_path())
                .args(args)
                .output()
                .expect("run peregrine");
            let stderr = String::from_utf8_lossy(&output.stderr);
            // EX_UNAVAILABLE.
            assert_eq!(output.status.code(), Some(69), "{stderr}");
            assert_eq!(stderr.lines().count(), 1, "{stderr}");
            assert!(
                stderr.starts_with(&format!(
                    "error: no supervisor is running on {}",
                    socket.display()
                )),
                "{stderr}"
            );
            assert!(output.stdout.is_empty());
        }
    }
}

/// `status` and `reload` need only the control socket's path from the config: beside a
/// half-edited file they reach the running supervisor (which refuses to reload the half-edited
/// file, naming its line). A user who may not open the socket is told whose it is and how to run
/// the command as that user.
#[test]
fn status_and_reload_read_only_the_socket_and_say_who_may_ask() {
    let mut config = PeregrineToml::local(free_port());
    config.service("web", ServiceTable::default());
    let supervisor = Supervisor::start(&config.toml());
    wait_for_row(&supervisor, "the worker registered", |row| {
        row["pid"].is_u64()
    });

    let text = std::fs::read_to_string(supervisor.config_path()).unwrap();
    let half_edited = format!("{text}\n[service.next]\ncount = \n");
    let broken_line = half_edited.lines().count();
    std::fs::write(supervisor.config_path(), &half_edited).unwrap();
    let status = supervisor
        .status_json()
        .expect("status beside a half-edited config");
    assert!(web_row(&status).is_some(), "{status}");
    let reload = supervisor
        .control("reload", &[])
        .expect_err("an invalid config");
    let reload = format!("{reload:#}");
    assert!(
        reload.contains(&format!("line {broken_line}")),
        "the supervisor names the line: {reload}"
    );
    std::fs::write(supervisor.config_path(), &text).unwrap();

    if !rustix::process::geteuid().is_root() {
        peregrine_e2e::skip(
            "status_and_reload_read_only_the_socket_and_say_who_may_ask (as another user)",
            "not root: no other user to run status as",
        );
        return;
    }
    // The directory is searchable by all, the socket owner-only: `nobody` may see whose it is.
    let socket = supervisor.dir().join("peregrine.sock");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(supervisor.dir(), std::fs::Permissions::from_mode(0o711)).unwrap();
    // Wherever the checkout is, a copy of the binary nobody may run.
    let stage = peregrine_e2e::Stage::new(&peregrine_e2e::Account::lookup("nobody"));
    let output = {
        use std::os::unix::process::CommandExt;
        Command::new(stage.program(&peregrine_path()))
            .args(["status".as_ref(), "--socket".as_ref(), socket.as_os_str()])
            .uid(65534)
            .gid(65534)
            .output()
            .expect("run peregrine as nobody")
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    // EX_NOPERM.
    assert_eq!(output.status.code(), Some(77), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "error: this user may not ask the supervisor on {}: only its own user, root, may (run \
             the command with sudo)",
            socket.display()
        )
    );
}

/// A tmux session that is killed when dropped, even when the test fails.
struct Tmux(String);

impl Tmux {
    fn capture(&self) -> String {
        Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.0])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    fn alive(&self) -> bool {
        Command::new("tmux")
            .args(["has-session", "-t", &self.0])
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .output();
    }
}

#[test]
fn status_watch_redraws_the_table_in_place_until_ctrl_c() {
    if !peregrine_e2e::tool_or_skip(
        "status --watch",
        "tmux",
        "-V",
        "PEREGRINE_REQUIRE_TMUX",
        "apt install tmux",
    ) {
        return;
    }
    let (supervisor, _) = peregrine_e2e::one_worker();
    let socket = supervisor.dir().join("peregrine.sock");
    let session = Tmux(format!("peregrine-watch-{}", std::process::id()));
    let started = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &session.0,
            "-x",
            "160",
            "-y",
            "30",
        ])
        .arg(format!(
            "{} status --watch --interval 0.2 --socket {}",
            peregrine_path().display(),
            socket.display()
        ))
        .status()
        .unwrap();
    assert!(started.success());
    let pid_in = |screen: &str| -> Option<u32> {
        let row = screen.lines().find(|l| l.starts_with("web "))?;
        row.split_whitespace().nth(2)?.parse().ok()
    };
    let first = try_wait_until(Duration::from_secs(10), "the watched table", || {
        let screen = session.capture();
        (screen.contains("every 0.2s: peregrine status") && pid_in(&screen).is_some())
            .then_some(screen)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", session.capture()));
    let pid = pid_in(&first).unwrap();
    // A killed worker's replacement shows up in place: a new pid, one restart, one header on screen.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let after = try_wait_until(Duration::from_secs(20), "the replacement on screen", || {
        let screen = session.capture();
        pid_in(&screen).is_some_and(|p| p != pid).then_some(screen)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", session.capture()));
    assert_eq!(
        after.matches("every 0.2s: peregrine status").count(),
        1,
        "redrawn in place, not appended:\n{after}"
    );
    let row = after.lines().find(|l| l.starts_with("web ")).unwrap();
    assert_eq!(
        row.split_whitespace().last(),
        Some("1"),
        "one restart: {row}"
    );
    // Ctrl-C ends it.
    Command::new("tmux")
        .args(["send-keys", "-t", &session.0, "C-c"])
        .status()
        .unwrap();
    try_wait_until(Duration::from_secs(5), "the watch to end on Ctrl-C", || {
        (!session.alive()).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", session.capture()));
}
