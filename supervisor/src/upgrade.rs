//! `peregrine upgrade` (or SIGUSR2): the supervisor replaces its own program in place and keeps its
//! workers, as gunicorn's USR2 and nginx's binary upgrade do.
//!
//! systemd cannot tell `systemctl restart` from `systemctl stop` (both send SIGTERM), so SIGTERM
//! always drains and stops every worker; keeping them across a new binary is this path's job. The
//! supervisor remembers at start the program file it was started from ([`Image`]: the path, not
//! `/proc/self/exe`, which names the deleted old file once a package replaced it) and its
//! arguments. On `upgrade` it ([`carry_out`]):
//!
//! 1. checks the file now at that path ([`check`]): `PROGRAM --version` must succeed and `PROGRAM
//!    check CONFIG` must pass; otherwise it refuses with the reason and changes nothing;
//! 2. prepares the exec (every string built first, [`exec::Prepared`]), tells systemd
//!    `RELOADING=1`, and replies to the client;
//! 3. stops its orphan watcher (the new image starts its own), marks every descriptor
//!    close-on-exec, empties the signal mask, and `execve`s the program with its original
//!    arguments in the same process ([`exec`]): systemd's main pid does not change.
//!
//! The new image starts as any supervisor does: it takes the instance lock again, binds its sockets
//! again, and adopts the running workers ([`crate::adopt`]), which are still this process's
//! children (their exits are reaped through their pidfds); it sends `READY=1` once they registered
//! again. Meanwhile Envoy keeps its endpoints and the workers keep serving. The client
//! ([`client`]) waits until the supervisor answers with a new image and its workers registered.
//!
//! A stop (SIGTERM) wins over an upgrade: one that began during the checks or the reply cancels
//! the exec. One sent in the moment of the exec itself, between that last look and the new image's
//! signal handlers (installed first thing in [`crate::run::run`]), is lost, or ends the new image
//! before it drains: its workers then stop by themselves after `orphan_timeout_ms`. Blocking the
//! signals across the exec would not close that window in a process of many threads, where any
//! thread that does not block a signal takes it.
//!
//! Invariant: nothing is stopped or changed before the new program passed its checks, and a failed
//! exec leaves the old image running as it was (its orphan watcher started again).

mod check;
pub mod client;
mod exec;
mod image;

use std::{path::Path, time::Duration};

use peregrine_proto::v1;
use tokio::sync::oneshot;

pub use self::{check::CheckError, image::Image};
use crate::{
    children::Children, manager::Manager, registration::ControlAnswer, sampler::ErrorChain,
    service_manager,
};

/// How long the reply may take to reach the client before the exec goes ahead without it.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Checks the new program and, if it passes, execs it; returns only if the upgrade did not happen,
/// after replying (or logging, for a signal) why. `config` is the file the supervisor runs with.
pub(crate) async fn carry_out(
    manager: &mut Manager,
    image: &Image,
    config: &Path,
    reply: Option<oneshot::Sender<ControlAnswer>>,
) {
    let prepared = match prepare(image, config, &manager.children()).await {
        // A stop that came during the checks goes on: its workers are draining.
        Ok(_) if manager.is_stopping() => Err(v1::ControlReply {
            ok: false,
            summary: "the supervisor is stopping; no upgrade".into(),
            ..Default::default()
        }),
        other => other,
    };
    let (prepared, new_version) = match prepared {
        Ok(ready) => ready,
        Err(refusal) => {
            tracing::warn!(summary = %refusal.summary, failures = ?refusal.failures, "Upgrade refused");
            if let Some(reply) = reply {
                let _ = reply.send(ControlAnswer::from(refusal));
            }
            return;
        }
    };
    service_manager::reloading();
    let summary = format!(
        "upgrading in place: pid {} execs {} ({} -> {}), keeping its workers",
        std::process::id(),
        prepared.program_display(),
        image.version(),
        new_version
    );
    tracing::info!(%summary, "Upgrade checked");
    if let Some(reply) = reply {
        let (written, delivered) = oneshot::channel();
        let answer = ControlAnswer {
            reply: v1::ControlReply {
                ok: true,
                summary,
                ..Default::default()
            },
            written: Some(written),
        };
        if reply.send(answer).is_ok() {
            // Sent or dropped: either way the connection is done with it.
            let _ = tokio::time::timeout(REPLY_TIMEOUT, delivered).await;
        }
    }
    if manager.is_stopping() {
        tracing::warn!(
            "The supervisor began to stop during the upgrade: the new program is not executed"
        );
        return;
    }
    manager.release_for_exec();
    let error = exec::replace_image(&prepared);
    tracing::error!(%error, program = %prepared.program_display(), "The upgrade's exec failed: the old program keeps running");
    manager.resume_after_failed_exec();
    service_manager::reloaded(&format!("upgrade failed: {error}"));
}

/// The checked exec and the new program's version, or the refusal to send.
async fn prepare(
    image: &Image,
    config: &Path,
    children: &Children,
) -> Result<(exec::Prepared, String), v1::ControlReply> {
    let refusal = |summary: String, failures: Vec<String>| v1::ControlReply {
        ok: false,
        summary,
        failures,
        ..Default::default()
    };
    let Some(program) = image.program() else {
        return Err(refusal(
            "cannot upgrade in place: this supervisor does not know the file it was started from; \
             nothing changed (restart it instead)"
                .into(),
            Vec::new(),
        ));
    };
    tracing::info!(program = %program.display(), config = %config.display(), "Upgrade: checking the new program");
    let new_version = check::new_program(program, config, children).await.map_err(|error| {
        refusal(
            format!(
                "the upgrade was refused: {} failed its checks; nothing changed, the supervisor \
                 keeps running {}",
                program.display(),
                image.version()
            ),
            vec![ErrorChain(&error).to_string()],
        )
    })?;
    let prepared = exec::Prepared::new(program, image.args()).map_err(|error| {
        refusal(
            "cannot upgrade in place; nothing changed".into(),
            vec![ErrorChain(&error).to_string()],
        )
    })?;
    Ok((prepared, new_version))
}
