//! The built-in hello application: answers every request with the worker's pid.
//!
//! One knob for demos and benchmarks: `?cpu=MS` burns MS milliseconds of this thread's CPU time before
//! answering (at most [`MAX_CPU_MS`]), so a test can make one worker busier than another.

use std::{
    convert::Infallible,
    future::{Ready, ready},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::Full;
use tower::Service;

use crate::service::RequestBody;

/// The most CPU one request may ask to burn, in milliseconds.
pub const MAX_CPU_MS: u64 = 1000;

/// Answers `Hello from worker <pid>!` (text/plain) to any method and path.
#[derive(Clone, Debug)]
pub struct Hello {
    body: Bytes,
}

impl Hello {
    /// A hello app for this process.
    pub fn new() -> Self {
        Hello {
            body: Bytes::from(format!("Hello from worker {}!\n", std::process::id())),
        }
    }
}

impl Default for Hello {
    fn default() -> Self {
        Self::new()
    }
}

impl Service<Request<RequestBody>> for Hello {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        if let Some(ms) = cpu_ms(req.uri().query()) {
            burn_cpu(Duration::from_millis(ms));
        }
        let mut res = Response::new(Full::new(self.body.clone()));
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        ready(Ok(res))
    }
}

/// The `cpu=MS` query parameter, capped at [`MAX_CPU_MS`]. Public for the benchmarks' baselines,
/// which must do the same work per request.
pub fn cpu_ms(query: Option<&str>) -> Option<u64> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("cpu="))
        .and_then(|ms| ms.parse::<u64>().ok())
        .map(|ms| ms.min(MAX_CPU_MS))
}

/// Spins until this thread has used `amount` more CPU time.
pub fn burn_cpu(amount: Duration) {
    let cpu_time = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    };
    let until = cpu_time() + amount;
    while cpu_time() < until {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_cpu_knob() {
        assert_eq!(cpu_ms(None), None);
        assert_eq!(cpu_ms(Some("a=1")), None);
        assert_eq!(cpu_ms(Some("a=1&cpu=20")), Some(20));
        assert_eq!(cpu_ms(Some("cpu=99999")), Some(MAX_CPU_MS));
        assert_eq!(cpu_ms(Some("cpu=x")), None);
    }

    #[test]
    fn burns_the_cpu_time_asked_for() {
        let start = std::time::Instant::now();
        burn_cpu(Duration::from_millis(30));
        // CPU time never runs ahead of wall time.
        assert!(start.elapsed() >= Duration::from_millis(30));
    }
}
