//! The Vagrant VM's definition is valid: `vagrant validate --ignore-provider` on `vagrant/Vagrantfile`
//! (CI has no VM provider; the provider blocks are checked by `vagrant up`). CI installs Debian's
//! `vagrant` and sets `PEREGRINE_REQUIRE_VAGRANT=1`, so there a missing `vagrant` fails.

use std::process::Command;

#[test]
fn the_vagrantfile_validates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../vagrant");
    let output = match Command::new("vagrant")
        .args(["validate", "--ignore-provider"])
        .current_dir(&dir)
        .env("VAGRANT_CHECKPOINT_DISABLE", "1")
        .output()
    {
        Ok(output) => output,
        Err(error) => {
            if std::env::var("PEREGRINE_REQUIRE_VAGRANT").is_ok_and(|v| v == "1") {
                panic!("PEREGRINE_REQUIRE_VAGRANT=1 but vagrant cannot run: {error}");
            }
            peregrine_e2e::skip(
                &peregrine_e2e::current_test(),
                format!("vagrant is not installed ({error})"),
            );
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("validated successfully"),
        "vagrant validate failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
}
