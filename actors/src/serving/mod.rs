//! Serving: trained models answering queries on a graph that keeps changing.
//!
//! - [`scheduler`]: the sans-I/O request scheduler (dynamic batching against a latency
//!   objective, load shedding, per-tenant fair shares and quotas);
//! - [`published`]: the last layer's rows and their model version as the engine last
//!   published them, read by the HTTP workers to answer existing-node predictions;
//! - [`crate::priority`]: background work (training beside serving) at a lower CPU priority than
//!   the threads that answer queries;
//! - [`routing`]: which part owns a queried node, and which part a new node joins;
//! - [`part`]: a serving partition as a sans-I/O machine: its rows of every layer, the
//!   per-layer steps of a pass (transform, halo sends, compute), restore after a panic;
//! - [`shell`]: the actix actor around it, the node that starts one per partition under
//!   actix's `Supervisor`, and the store a restarted partition is restored from;
//! - [`plan`]: which rows each partition computes and exchanges at each layer of a pass;
//! - [`engine`]: the router and coordinator: it owns the served graph and the ownership
//!   table, runs the scheduler's decisions, and drives the start-up inference, graph updates
//!   (only the rows they reach), recoveries and model swaps as passes over the partitions.
//!
//! The HTTP front end (`trellis serve`) lives in the facade; it only parses, validates sizes
//! and forwards [`engine::Command`]s.
pub mod engine;
pub mod handle;
pub mod part;
pub mod plan;
pub mod published;
pub mod routing;
pub mod scheduler;
pub mod shell;

use std::time::Duration;
use thiserror::Error;

/// Why a serving request did not get an answer.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum ServeError {
    /// The request is well-formed but not valid (HTTP 400).
    #[error("{0}")]
    BadRequest(String),
    /// It names a node the graph does not have (HTTP 404).
    #[error("node {node} does not exist (the graph has nodes 0..{nodes})")]
    UnknownNode { node: u32, nodes: usize },
    /// The service is over capacity (HTTP 503).
    #[error("over capacity: request shed, retry after {}s", retry_after.as_secs())]
    Overloaded { retry_after: Duration },
    /// The tenant is over its quota (HTTP 429).
    #[error("over this API key's quota, retry after {}s", retry_after.as_secs())]
    Quota { retry_after: Duration },
    /// A partition is being recovered (HTTP 503).
    #[error("a serving partition is being recovered ({detail}); retry after {}s", retry_after.as_secs())]
    Recovering {
        retry_after: Duration,
        detail: String,
    },
    /// The engine node lost contact with more than half of its serving cluster, which may
    /// serve with another engine node now (HTTP 503).
    #[error("this engine node is cut off from most of its serving cluster ({detail}); retry after {}s", retry_after.as_secs())]
    CutOff {
        retry_after: Duration,
        detail: String,
    },
    /// Its deadline passed before it could run (HTTP 503).
    #[error("the request's deadline passed before it could run")]
    Expired,
    /// It conflicts with work in progress (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// The service failed (HTTP 500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<trellis_runtime::RuntimeError> for ServeError {
    fn from(e: trellis_runtime::RuntimeError) -> Self {
        match e {
            trellis_runtime::RuntimeError::BadData(m)
            | trellis_runtime::RuntimeError::Config(m) => ServeError::BadRequest(m),
            other => ServeError::Internal(other.to_string()),
        }
    }
}

/// Rows a table of `rows` rows that grows with the served graph (a partition's, the
/// engine's features and published rows) keeps room for: a quarter more, so that new nodes
/// do not reallocate it (see [`trellis_runtime::inference::Rows::reserve_rows`]).
pub fn spare_rows(rows: usize) -> usize {
    rows / 4
}
