//! The previous release's workers under this version (docs/upgrading.md): the previous release's
//! `peregrine` (built from its commit by `cargo xtask test`) runs two workers behind the real Envoy.
//! This version adopts them when they were started under a version of the agreement it adopts;
//! otherwise every way to this version that would replace them without a drain is refused, with
//! what to do, and loses nothing: `check`, `peregrine upgrade`, the previous supervisor's own
//! upgrade (SIGUSR2, which runs this version's `check`); a start after the previous supervisor died
//! stops them with an error that says why, and serves with its own.

use std::{
    collections::BTreeSet,
    process::{Command, Output},
};

use peregrine_contract::settings::{ADOPTED, CONTRACT};
use peregrine_e2e::{
    PeregrineToml, Stack, Supervisor, TempDir, deploy::STEP, envoy_or_skip, gone, install_program,
    peregrine_path, previous_release_or_skip, wait_until,
};

/// This version's `peregrine ARGS...`, and what it printed.
fn peregrine(args: &[&std::ffi::OsStr]) -> (Output, String) {
    let out = Command::new(peregrine_path()).args(args).output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, said)
}

/// The version of the agreement worker `pid` was started under (`PEREGRINE_CONTRACT`), `None`
/// when its environment has none.
fn contract_of(pid: u32) -> Option<u32> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    environ
        .split(|b| *b == 0)
        .find_map(|pair| pair.strip_prefix(b"PEREGRINE_CONTRACT="))
        .map(|value| String::from_utf8_lossy(value).parse().unwrap())
}

/// The `--version` line the supervisor reports.
fn version(stack: &Stack) -> String {
    stack.supervisor.status_json().unwrap()["supervisor"]["version"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn the_previous_releases_workers_are_adopted_or_refused_with_a_drain() {
    let test = "the_previous_releases_workers_are_adopted_or_refused_with_a_drain";
    if envoy_or_skip(test).is_none() {
        return;
    }
    let Some(previous) = previous_release_or_skip(test) else {
        return;
    };
    let dir = TempDir::new().unwrap();
    let program = dir.path().join("peregrine");
    install_program(&previous, &program);
    let (grpc, listen, admin) = (
        peregrine_e2e::free_port(),
        peregrine_e2e::free_port(),
        peregrine_e2e::free_port(),
    );
    let config = PeregrineToml::one_service(grpc, listen, admin, 2);
    let supervisor = Supervisor::start_in(&program, dir.path(), &config.toml()).unwrap();
    let mut stack = Stack::around(supervisor, config, listen);
    let workers = stack.deployed().wait_for_workers(2, &BTreeSet::new());
    let old_version = version(&stack);
    // A supervisor that reports its image can upgrade in place (`peregrine upgrade`, SIGUSR2).
    let upgrades_in_place = !old_version.is_empty();
    let contracts: BTreeSet<Option<u32>> = workers.iter().map(|pid| contract_of(*pid)).collect();
    eprintln!("previous release {old_version}: workers {workers:?} under {contracts:?}");
    let config_path = stack.supervisor.config_path().to_owned();
    let adopted = contracts
        .iter()
        .all(|contract| contract.is_some_and(|c| ADOPTED.contains(&c)));

    if adopted {
        // An upgrade in place keeps them, under load, losing nothing.
        let load = stack.deployed().load();
        install_program(&peregrine_path(), &program);
        let (out, said) = peregrine(&["upgrade".as_ref(), config_path.as_os_str()]);
        assert!(
            out.status.success(),
            "{said}\n{}",
            stack.supervisor.all_logs()
        );
        assert!(said.contains("2 workers kept"), "{said}");
        assert_eq!(stack.supervisor.status_pids().unwrap(), workers);
        stack.deployed().finish(load, 50, &workers);
        return;
    }

    // This version's check, while the previous supervisor runs, refuses them: exit 69, what to do.
    let (out, said) = peregrine(&["check".as_ref(), config_path.as_os_str()]);
    assert_eq!(out.status.code(), Some(69), "{said}");
    for pid in &workers {
        assert!(said.contains(&format!("{pid} (")), "{said}");
    }
    assert!(
        said.contains("drain them with a restart instead of upgrading in place"),
        "{said}"
    );

    // `peregrine upgrade` of this version asks nothing of the supervisor: it cannot upgrade in
    // place, exit 69, on which the package's postinst restarts it (a restart drains).
    let load = stack.deployed().load();
    let (out, said) = peregrine(&["upgrade".as_ref(), config_path.as_os_str()]);
    assert_eq!(out.status.code(), Some(69), "{said}");
    assert!(said.contains("cannot upgrade in place"), "{said}");
    assert!(said.contains("systemctl restart peregrine"), "{said}");

    // The previous supervisor's own upgrade (SIGUSR2), to this version's program in its file's
    // place, where it has one (it reports its image): it runs this version's check, which refuses;
    // it runs on as it was.
    install_program(&peregrine_path(), &program);
    if upgrades_in_place {
        stack
            .supervisor
            .process()
            .signal(rustix::process::Signal::USR2)
            .unwrap();
        wait_until(
            STEP,
            "the previous supervisor to refuse the upgrade",
            || {
                let logs = stack.supervisor.logs();
                logs.contains("drain them with a restart instead of upgrading in place")
                    .then_some(())
            },
        );
    }
    assert!(
        stack.supervisor.process().try_wait().is_none(),
        "the supervisor exited"
    );
    assert_eq!(version(&stack), old_version, "still the previous release");
    assert_eq!(stack.supervisor.status_pids().unwrap(), workers);
    // Nothing was lost meanwhile.
    stack.deployed().finish(load, 50, &workers);

    // The previous supervisor dies; this version starts on its workers: they are stopped, with an
    // error that says why, and its own serve.
    stack.supervisor.kill_and_start_again().unwrap();
    wait_until(STEP, "the previous release's workers to be stopped", || {
        workers.iter().all(|pid| gone(*pid)).then_some(())
    });
    let logs = stack.supervisor.logs();
    assert!(
        logs.contains("run under version none (started by Peregrine 0.1.0) of the agreement")
            && logs.contains("a start stops them without a drain"),
        "{logs}"
    );
    let new = stack.deployed().wait_for_workers(2, &workers);
    for pid in &new {
        assert_eq!(contract_of(*pid), Some(CONTRACT));
    }
    assert_ne!(version(&stack), old_version);
}
