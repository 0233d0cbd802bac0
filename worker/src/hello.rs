//! The built-in hello application: answers every request with the worker's pid.

use std::{
    convert::Infallible,
    future::{Ready, ready},
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use tower::Service;

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

impl Service<Request<Bytes>> for Hello {
    type Response = Response<Bytes>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Bytes>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Bytes>) -> Self::Future {
        let mut res = Response::new(self.body.clone());
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        ready(Ok(res))
    }
}
