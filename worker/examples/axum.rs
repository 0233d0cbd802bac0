//! An axum `Router` served by a Peregrine worker, unchanged: the worker accepts any `tower::Service`
//! over `http` types.
//!
//! Run it under the supervisor by naming its binary as a service's command:
//!
//! ```toml
//! [service.api]
//! count = 2
//! command = ["target/debug/examples/axum"]
//! ```

use axum::{Json, Router, extract::Query, routing::get};
use peregrine_worker::Settings;
use serde_json::{Value, json};

/// The application: `/` greets, `/sum?a=1&b=2` adds, everything else is axum's 404.
fn app() -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { format!("Hello from axum in worker {}!\n", std::process::id()) }),
        )
        .route(
            "/sum",
            get(
                |Query(q): Query<std::collections::HashMap<String, i64>>| async move {
                    Json::<Value>(json!({ "sum": q.values().sum::<i64>() }))
                },
            ),
        )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let router = app();
    peregrine_worker::run(Settings::from_env()?, move || router.clone())?;
    Ok(())
}
