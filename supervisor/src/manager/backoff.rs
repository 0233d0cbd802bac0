//! The restart backoff of one slot: a worker that crashes at start-up is restarted at most once per
//! delay, never in a tight loop.
//!
//! Invariant: the delay doubles after every exit, up to the policy's cap, and starts over only after a
//! worker has stayed up for `healthy_after`.

use std::time::Duration;

use crate::config::RestartPolicy;

/// The exponential backoff of one slot.
#[derive(Clone, Copy, Debug)]
pub(super) struct Backoff {
    policy: RestartPolicy,
    next: Duration,
}

impl Backoff {
    /// The policy it follows.
    pub(super) fn policy(&self) -> RestartPolicy {
        self.policy
    }

    /// A fresh backoff at the policy's initial delay.
    pub(super) fn new(policy: RestartPolicy) -> Self {
        Backoff {
            policy,
            next: policy.initial,
        }
    }

    /// The delay before restarting a worker that ran for `uptime`: the initial delay after a healthy
    /// run, else twice the previous delay, capped.
    pub(super) fn after_exit(&mut self, uptime: Duration) -> Duration {
        if uptime >= self.policy.healthy_after {
            self.next = self.policy.initial;
        }
        let delay = self.next;
        self.next = (self.next * 2).min(self.policy.max);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_resets_after_a_healthy_run() {
        let policy = RestartPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(500),
            healthy_after: Duration::from_secs(10),
        };
        let mut backoff = Backoff::new(policy);
        let quick = Duration::from_millis(5);
        let delays: Vec<u128> = (0..5)
            .map(|_| backoff.after_exit(quick).as_millis())
            .collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        assert_eq!(backoff.after_exit(Duration::from_secs(11)).as_millis(), 100);
        assert_eq!(backoff.after_exit(quick).as_millis(), 200);
    }
}
