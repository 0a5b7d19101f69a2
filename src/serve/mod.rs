//! `trellis serve`'s HTTP front end (actix-web): reads and bounds request bodies, parses and
//! validates them ([`api`]), charges quotas, answers existing-node predictions from the
//! engine's published rows ([`trellis_actors::serving::published`]) and forwards everything
//! else to the serving engine ([`trellis_actors::serving::engine`]), waiting for the answer
//! within the request's deadline; `/healthz`, `/readyz` and Prometheus `/metrics` ([`metrics`]).
//!
//! Every API request is a `serve_request` span (`route`, `status`): a child of the caller's
//! span when the request carries a W3C `traceparent` header, and named back to the caller
//! in the answer's `traceparent` header when traced. Its context travels with the command
//! to the engine, whose batch and update spans, and the partition actors' step and lookup
//! spans under them, join the request's trace.
pub mod api;
pub mod beside;
pub mod forward;
pub mod loadgen;
pub mod metrics;

use actix_web::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use actix_web::http::StatusCode;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use api::{Limits, Rejection};
use futures_util::StreamExt;
use metrics::HttpMetrics;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tracing::Instrument;
use trellis_actors::priority::CpuSet;
use trellis_actors::serving::engine::{Answer, Command, EngineHandle};
use trellis_actors::serving::ServeError;
use trellis_actors::telemetry;
use trellis_runtime::model_file;
use trellis_transport::TraceContext;

/// Settings of the HTTP front end.
#[derive(Debug, Clone, Copy)]
pub struct HttpConfig {
    pub limits: Limits,
    /// Longest a query may wait for its answer.
    pub deadline: Duration,
    /// Longest a client may take to send a request's head, and then its body.
    pub client_timeout: Duration,
    /// Input widths of the data (a new model must fit them).
    pub features: usize,
    pub classes: usize,
    /// HTTP worker threads.
    pub workers: usize,
    /// The CPUs the HTTP workers run on (`None`: wherever the process may).
    pub cpus: Option<CpuSet>,
}

struct AppState {
    engine: EngineHandle,
    cfg: HttpConfig,
    metrics: Arc<HttpMetrics>,
}

/// The header that names the caller (its fair share and quota).
pub const API_KEY: &str = "x-api-key";

fn json_response(status: u16, body: String) -> HttpResponse {
    HttpResponse::build(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .insert_header((CONTENT_TYPE, "application/json"))
        .body(body)
}

pub(crate) fn error_response(
    status: u16,
    message: &str,
    retry_after: Option<Duration>,
) -> HttpResponse {
    let mut r = json_response(status, serde_json::json!({ "error": message }).to_string());
    if let Some(d) = retry_after {
        if let Ok(v) = HeaderValue::from_str(&d.as_secs().max(1).to_string()) {
            r.headers_mut().insert(RETRY_AFTER, v);
        }
    }
    r
}

fn serve_error(e: &ServeError) -> HttpResponse {
    let (status, retry) = match e {
        ServeError::BadRequest(_) => (400, None),
        ServeError::UnknownNode { .. } => (404, None),
        ServeError::Conflict(_) => (409, None),
        ServeError::Quota { retry_after } => (429, Some(*retry_after)),
        ServeError::Overloaded { retry_after } => (503, Some(*retry_after)),
        ServeError::Expired => (503, Some(Duration::from_secs(1))),
        ServeError::Recovering { retry_after, .. } | ServeError::CutOff { retry_after, .. } => {
            (503, Some(*retry_after))
        }
        ServeError::Internal(_) => (500, None),
    };
    error_response(status, &e.to_string(), retry)
}

fn rejection(r: &Rejection) -> HttpResponse {
    error_response(r.status, &r.message, None)
}

/// Reads a JSON request body within the body limits and parses it; a bad one is answered.
async fn json_body<T: serde::de::DeserializeOwned>(
    req: &HttpRequest,
    payload: web::Payload,
    state: &AppState,
) -> Result<T, HttpResponse> {
    let limits = &state.cfg.limits;
    let body = read_body(req, payload, limits.max_body, state.cfg.client_timeout)
        .await
        .map_err(|e| rejection(&e))?;
    api::parse(&body).map_err(|e| rejection(&e))
}

/// Reads a body of at most `limit` bytes within the client timeout.
pub(crate) async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
    timeout: Duration,
) -> Result<web::Bytes, Rejection> {
    let too_big = |n: String| Rejection {
        status: 413,
        message: format!("request body of {n} bytes is over the limit of {limit} bytes"),
    };
    if let Some(len) = req
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        if len > limit {
            return Err(too_big(len.to_string()));
        }
    }
    let read = async {
        let mut body = web::BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| Rejection::bad(format!("cannot read the body: {e}")))?;
            if body.len() + chunk.len() > limit {
                return Err(too_big(format!("more than {limit}")));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(Rejection {
            status: 408,
            message: format!(
                "the request body did not arrive within {} ms",
                timeout.as_millis()
            ),
        }),
    }
}

/// Sends a command to the engine and waits for its answer until `deadline` (if any).
async fn ask(
    state: &AppState,
    make: impl FnOnce(oneshot::Sender<Result<Answer, ServeError>>) -> Command,
    deadline: Option<Instant>,
) -> Result<Answer, ServeError> {
    let (tx, rx) = oneshot::channel();
    if !state.engine.send(make(tx)) {
        return Err(ServeError::Internal(
            "the serving engine has stopped".into(),
        ));
    }
    let answer = match deadline {
        Some(d) => match tokio::time::timeout_at(tokio::time::Instant::from_std(d), rx).await {
            Ok(a) => a,
            Err(_) => return Err(ServeError::Expired),
        },
        None => rx.await,
    };
    answer.unwrap_or_else(|_| {
        Err(ServeError::Internal(
            "the engine dropped the request".into(),
        ))
    })
}

/// The span of one API request on `route`: a child of the caller's span when the request
/// names one (`traceparent`), else the root of a new trace.
fn request_span(req: &HttpRequest, route: &'static str) -> tracing::Span {
    let span = tracing::info_span!(
        "serve_request",
        route,
        node = telemetry::node_attr(),
        status = tracing::field::Empty
    );
    let caller = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::from_traceparent);
    telemetry::set_parent(&span, caller);
    span
}

/// Records the answer (metrics, the span's status) and names the request's span in the
/// answer's `traceparent` header when it is traced.
fn finish(
    state: &AppState,
    route: &'static str,
    t0: Instant,
    span: &tracing::Span,
    mut r: HttpResponse,
) -> HttpResponse {
    let status = r.status().as_u16();
    state.metrics.record(route, status, t0.elapsed());
    span.record("status", i64::from(status));
    if let Some(tc) = telemetry::context_of(span) {
        if let Ok(v) = HeaderValue::from_str(&tc.to_string()) {
            r.headers_mut().insert(
                actix_web::http::header::HeaderName::from_static("traceparent"),
                v,
            );
        }
    }
    r
}

fn answer_json(a: Result<Answer, ServeError>) -> HttpResponse {
    match a {
        Ok(a) => json_response(200, serde_json::to_string(&a).unwrap_or_default()),
        Err(e) => serve_error(&e),
    }
}

async fn predict(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    let t0 = Instant::now();
    let span = request_span(&req, "/v1/predict");
    let trace = telemetry::context_of(&span);
    let r = async {
        let p: api::PredictRequest = json_body(&req, payload, &state).await?;
        let nodes = api::predict_nodes(&p, &state.cfg.limits).map_err(|e| rejection(&e))?;
        let tenant = req
            .headers()
            .get(API_KEY)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous")
            .to_string();
        state.engine.admit(&tenant).map_err(|e| serve_error(&e))?;
        if p.embeddings.is_none() {
            // Existing nodes' classes are published rows: answered here, in this worker.
            return Ok(answer_json(state.engine.predict_published(&nodes)));
        }
        let deadline = t0 + state.cfg.deadline;
        Ok::<_, HttpResponse>(answer_json(
            ask(
                &state,
                |reply| Command::Predict {
                    tenant,
                    nodes,
                    layer: p.embeddings,
                    deadline,
                    reply,
                    trace,
                },
                Some(deadline),
            )
            .await,
        ))
    }
    .instrument(span.clone())
    .await;
    finish(&state, "/v1/predict", t0, &span, r.unwrap_or_else(|e| e))
}

async fn nodes(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    update(
        req,
        payload,
        state,
        "/v1/nodes",
        |n: api::NodesRequest, state, at| {
            let nodes = api::new_nodes(n, &state.cfg.limits)?;
            Ok(move |reply| Command::AddNodes {
                nodes,
                deadline: at.deadline,
                reply,
                trace: at.trace,
            })
        },
    )
    .await
}

async fn edges(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    update(
        req,
        payload,
        state,
        "/v1/edges",
        |e: api::EdgesRequest, state, at| {
            let (add, remove) = api::edge_update(&e, &state.cfg.limits)?;
            Ok(move |reply| Command::Edges {
                add,
                remove,
                deadline: at.deadline,
                reply,
                trace: at.trace,
            })
        },
    )
    .await
}

/// When and under which span a graph update was asked for.
struct Asked {
    deadline: Instant,
    trace: Option<TraceContext>,
}

/// A graph update on `route`: its JSON body `B`, checked and made into the engine's command
/// by `command` (a bad body is its `Rejection`), sent to the engine with no deadline of the
/// HTTP worker's own (the engine answers an update it took), answered as JSON.
async fn update<B, C>(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
    route: &'static str,
    command: impl FnOnce(B, &AppState, Asked) -> Result<C, Rejection>,
) -> HttpResponse
where
    B: serde::de::DeserializeOwned,
    C: FnOnce(oneshot::Sender<Result<Answer, ServeError>>) -> Command,
{
    let t0 = Instant::now();
    let span = request_span(&req, route);
    let trace = telemetry::context_of(&span);
    let r = async {
        let body: B = json_body(&req, payload, &state).await?;
        let deadline = t0 + state.cfg.deadline;
        let make = command(body, &state, Asked { deadline, trace }).map_err(|e| rejection(&e))?;
        Ok::<_, HttpResponse>(answer_json(ask(&state, make, None).await))
    }
    .instrument(span.clone())
    .await;
    finish(&state, route, t0, &span, r.unwrap_or_else(|e| e))
}

async fn put_model(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> HttpResponse {
    let t0 = Instant::now();
    let span = request_span(&req, "/v1/model");
    let trace = telemetry::context_of(&span);
    let r = async {
        let body = read_body(
            &req,
            payload,
            state.cfg.limits.max_model_body,
            state.cfg.client_timeout * 10,
        )
        .await
        .map_err(|e| rejection(&e))?;
        let saved = model_file::from_bytes(&body, Path::new("PUT /v1/model body"))
            .and_then(|m| {
                m.check_fits(state.cfg.features, state.cfg.classes)
                    .map(|_| m)
            })
            .map_err(|e| error_response(400, &e.to_string(), None))?;
        Ok::<_, HttpResponse>(answer_json(
            ask(
                &state,
                |reply| Command::SwapModel {
                    model: Box::new(saved),
                    reply,
                    trace,
                },
                None,
            )
            .await,
        ))
    }
    .instrument(span.clone())
    .await;
    finish(&state, "/v1/model", t0, &span, r.unwrap_or_else(|e| e))
}

async fn healthz() -> HttpResponse {
    json_response(200, "{\"status\":\"ok\"}".into())
}

async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let stats = &state.engine.stats;
    let version = stats.version.lock().expect("stats lock").clone();
    let ready = stats.ready.load(std::sync::atomic::Ordering::SeqCst);
    let mut body = serde_json::json!({
        "ready": ready,
        "model_version": version,
        "recoveries": stats.recoveries.load(std::sync::atomic::Ordering::Relaxed),
        "rebuilds": stats.rebuilds.load(std::sync::atomic::Ordering::Relaxed),
        "faults_fired": state.engine.faults.fired_total(),
    });
    // On a cluster: the node serving each partition, and the nodes lost (not back).
    let placement = stats.placement.lock().expect("stats lock").clone();
    if !placement.is_empty() {
        body["placement"] = serde_json::json!(placement);
        body["lost_nodes"] = serde_json::json!(*stats.lost_nodes.lock().expect("stats lock"));
    }
    // Cut off from most of the cluster: not ready, whatever the tables are.
    let cut_off = stats.cut_off();
    if let Some(why) = &cut_off {
        body["ready"] = serde_json::json!(false);
        body["cut_off"] = serde_json::json!(why);
    }
    let ready = ready && cut_off.is_none();
    json_response(if ready { 200 } else { 503 }, body.to_string())
}

async fn metrics_text(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((CONTENT_TYPE, "text/plain; version=0.0.4"))
        .body(state.metrics.render(&state.engine.stats))
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    error_response(
        404,
        &format!(
            "no such endpoint: {} {} (see README: /v1/predict, /v1/nodes, /v1/edges, /v1/model, /healthz, /readyz, /metrics)",
            req.method(),
            req.path()
        ),
        None,
    )
}

/// Binds `listen`, then serves until the process is stopped; `on_bound` gets the bound
/// address once the server accepts connections.
pub fn run_http(
    engine: EngineHandle,
    cfg: HttpConfig,
    listen: SocketAddr,
    on_bound: impl FnOnce(SocketAddr),
) -> std::io::Result<()> {
    run_http_stoppable(engine, cfg, listen, |addr, _| on_bound(addr))
}

/// Checks that the HTTP workers can be pinned to `cpus`: a non-empty subset of the CPUs
/// the calling thread may run on.
pub fn check_http_cpus(cpus: &CpuSet) -> std::io::Result<()> {
    let allowed = CpuSet::of_this_thread()?;
    if cpus.is_empty() || !cpus.is_subset_of(&allowed) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "the HTTP workers' CPUs `{cpus}` are not a non-empty subset of the CPUs this process may run on ({allowed})"
            ),
        ));
    }
    Ok(())
}

/// Pins the calling HTTP worker thread to `cpus` (if any) the first time it builds its app.
pub(crate) fn pin_worker_once(cpus: Option<CpuSet>) {
    let Some(cpus) = cpus else {
        return;
    };
    thread_local!(static PINNED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if PINNED.with(|p| p.replace(true)) {
        return;
    }
    if let Err(e) = cpus.pin_this_thread() {
        eprintln!("warning: an HTTP worker could not be pinned to CPUs {cpus}: {e}");
    }
}

/// [`run_http`], handing `on_bound` the server's handle too: `handle.stop(true)` ends it
/// as SIGINT or SIGTERM would (requests in flight are answered first).
pub fn run_http_stoppable(
    engine: EngineHandle,
    cfg: HttpConfig,
    listen: SocketAddr,
    on_bound: impl FnOnce(SocketAddr, actix_web::dev::ServerHandle),
) -> std::io::Result<()> {
    cfg.cpus.as_ref().map(check_http_cpus).transpose()?;
    let metrics = Arc::new(HttpMetrics::default());
    let state = web::Data::new(AppState {
        engine,
        cfg,
        metrics,
    });
    actix_web::rt::System::new().block_on(async move {
        let server = HttpServer::new(move || {
            // actix-web builds the app on each worker's own thread as it starts.
            pin_worker_once(cfg.cpus);
            App::new()
                .app_data(state.clone())
                .route("/v1/predict", web::post().to(predict))
                .route("/v1/nodes", web::post().to(nodes))
                .route("/v1/edges", web::post().to(edges))
                .route("/v1/model", web::put().to(put_model))
                .route("/healthz", web::get().to(healthz))
                .route("/readyz", web::get().to(readyz))
                .route("/metrics", web::get().to(metrics_text))
                .default_service(web::to(not_found))
        })
        .workers(cfg.workers.max(1))
        .client_request_timeout(cfg.client_timeout)
        .client_disconnect_timeout(Duration::from_millis(500))
        .bind(listen)?;
        let addr = server.addrs()[0];
        let running = server.run();
        on_bound(addr, running.handle());
        running.await
    })
}
