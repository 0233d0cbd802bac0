//! examples/gunicorn.md followed with the page's own app, config and edit: the app from its Python
//! block, `examples/gunicorn.toml` changed by the page's `sed` command, checked by `peregrine
//! check`, run by a supervisor as root with the app as `www-data`, and answered through Envoy.
//!
//! What the test cannot take from the page it stands in for, and says so: `/srv/api` and the
//! control socket's folder are folders of the test's, and the virtualenv's `gunicorn` is the tests'
//! pinned gunicorn (pip would need a network): a script at the page's path that runs it.
//!
//! Needs root (another user), Envoy and the pinned gunicorn: skips saying why when one is missing.

use std::{os::unix::fs::PermissionsExt, path::Path, process::Command, time::Duration};

use peregrine_e2e::{
    Account, Envoy, Stage, Supervisor, app_servers_or_skip, assert_unprivileged, current_test,
    envoy_or_skip, free_port, http_get, skip, try_wait_until, workspace_root,
};

/// The user the page's config runs the app as.
const USER: &str = "www-data";
/// The service of the page's config.
const SERVICE: &str = "api";

/// The page.
fn page() -> String {
    std::fs::read_to_string(workspace_root().join("examples/gunicorn.md"))
        .expect("examples/gunicorn.md")
}

/// The first block of `page` fenced as `lang`.
fn block<'a>(page: &'a str, lang: &str) -> &'a str {
    page.split(&format!("```{lang}\n"))
        .nth(1)
        .and_then(|rest| rest.split_once("```"))
        .map(|(block, _)| block)
        .unwrap_or_else(|| panic!("no ```{lang} block in the page"))
}

/// The one line of the page's shell blocks that holds `needle`, without its `sudo`.
fn command_line(page: &str, needle: &str) -> String {
    let lines: Vec<&str> = page
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .flat_map(str::lines)
        .filter(|line| line.contains(needle))
        .collect();
    assert_eq!(lines.len(), 1, "one command with {needle:?}: {lines:?}");
    lines[0].trim_start_matches("sudo ").to_owned()
}

fn mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn the_gunicorn_page_followed_serves_its_app_as_www_data_through_envoy() {
    let test = current_test();
    if !rustix::process::geteuid().is_root() {
        skip(&test, "not root: the app runs as www-data");
        return;
    }
    let Some(envoy) = envoy_or_skip(&test) else {
        return;
    };
    let Some(servers) = app_servers_or_skip(&test) else {
        return;
    };
    let page = page();
    let account = Account::lookup(USER);
    let stage = Stage::new(&account);

    // 1. The app, from the page, under the test's /srv: root's, readable by all.
    let srv = stage.open_temp_dir("srv-");
    let api = srv.path().join("api");
    std::fs::create_dir_all(api.join("venv/bin")).unwrap();
    for dir in [srv.path(), &api, &api.join("venv"), &api.join("venv/bin")] {
        mode(dir, 0o755);
    }
    let app = block(&page, "python");
    assert!(app.starts_with("# /srv/api/app.py\n"), "{app}");
    std::fs::write(api.join("app.py"), app).unwrap();
    mode(&api.join("app.py"), 0o644);
    // 2. gunicorn at the virtualenv's path the page's config is given: the pinned one.
    let gunicorn = stage.gunicorn(&servers.gunicorn);
    let script = api.join("venv/bin/gunicorn");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexec {} \"$@\"\n", gunicorn.join(" ")),
    )
    .unwrap();
    mode(&script, 0o755);

    // 3. The config: the example, edited by the page's command, its paths the test's.
    let etc = stage.open_temp_dir("etc-");
    mode(etc.path(), 0o755);
    let config = etc.path().join("peregrine.toml");
    std::fs::copy(workspace_root().join("examples/gunicorn.toml"), &config).unwrap();
    let edit = command_line(&page, "sed -i").replace(
        "/etc/peregrine/peregrine.toml",
        &config.display().to_string(),
    );
    let edited = Command::new("sh").args(["-c", &edit]).status().unwrap();
    assert!(edited.success(), "{edit}");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(
        text.contains("\"/srv/api/venv/bin/gunicorn\","),
        "the page's edit changed nothing: {edit}"
    );
    let (grpc, listen, admin) = (free_port(), free_port(), free_port());
    let text = text
        .replace("/srv/api", &api.display().to_string())
        .replace(
            "\"/run/peregrine/peregrine.sock\"",
            "\"{dir}/peregrine.sock\"",
        )
        + &format!(
            "\n# The test's ports.\n[envoy]\nlisten = \"127.0.0.1:{listen}\"\nadmin = \"127.0.0.1:{admin}\"\n"
        );
    let text = text.replacen(
        "[supervisor]\n",
        &format!("[supervisor]\nbind = \"http://127.0.0.1:{grpc}\"\nmetrics = \"\"\n"),
        1,
    );
    std::fs::write(
        &config,
        text.replace("{dir}", &etc.path().display().to_string()),
    )
    .unwrap();
    let check = Command::new(stage.program(&peregrine_e2e::peregrine_path()))
        .arg("check")
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && said.contains("ok (1 service, 4 workers)"),
        "{said}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(said.contains("one shared listener"), "{said}");

    // 4. Run it, and Envoy in front.
    let supervisor = Supervisor::start_open_to_workers(&stage, &[], &text);
    let bootstrap = supervisor.envoy_bootstrap().expect("envoy-bootstrap");
    let envoy = Envoy::start_in(&envoy, etc.path(), &bootstrap).expect("Envoy starts");
    let answer = try_wait_until(Duration::from_secs(60), "the app through Envoy", || {
        let (status, body) = http_get(([127, 0, 0, 1], listen), "/").ok()?;
        (status == 200 && body.starts_with("Hello from gunicorn ")).then_some(body)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", supervisor.all_logs()));
    let status = supervisor.status_json().expect("status");
    let rows: Vec<u32> = status["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["service"] == SERVICE && w["state"] == "ready")
        .filter_map(|w| w["pid"].as_u64().map(|p| p as u32))
        .collect();
    assert_eq!(rows.len(), 4, "{status}");
    for pid in rows {
        assert_unprivileged(pid, &account);
    }
    drop(envoy);
    eprintln!("answered: {}", answer.trim());
}
