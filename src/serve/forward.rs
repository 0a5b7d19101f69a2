//! HTTP on the other nodes of a serving cluster (`trellis serve --cluster FILE --id N
//! --listen ADDR`): every request is forwarded over QUIC to the engine node and answered
//! with exactly what the engine node's front end answered (status, body, Retry-After), so
//! any node takes queries. On the engine node, [`engine_forwarder`] answers the forwarded
//! requests through its own front end.
use super::api::Rejection;
use super::{error_response, read_body, API_KEY};
use actix_web::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use actix_web::http::StatusCode;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use trellis_actors::cluster::serving::proto::{HttpAnswerWire, HttpRequestWire};
use trellis_actors::cluster::serving::{HttpForward, HttpUplink};
use trellis_actors::priority::CpuSet;

/// Settings of a forwarding front end.
#[derive(Debug, Clone, Copy)]
pub struct ForwardConfig {
    /// Largest request body (that of `PUT /v1/model`).
    pub max_body: usize,
    /// Longest a client may take to send its request.
    pub client_timeout: Duration,
    /// Longest a forwarded request waits for the engine node's answer.
    pub answer_timeout: Duration,
    /// HTTP worker threads.
    pub workers: usize,
    /// The CPUs the HTTP workers pin themselves to (`--http-cpus`), if any.
    pub cpus: Option<CpuSet>,
}

struct ForwardState {
    uplink: Arc<HttpUplink>,
    cfg: ForwardConfig,
}

fn header(req: &HttpRequest, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn forward(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<ForwardState>,
) -> HttpResponse {
    let cfg = state.cfg;
    let body = match read_body(&req, payload, cfg.max_body, cfg.client_timeout).await {
        Ok(b) => b,
        Err(Rejection { status, message }) => return error_response(status, &message, None),
    };
    let wire = HttpRequestWire {
        method: req.method().to_string(),
        path: req
            .uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_else(|| req.path().to_string()),
        api_key: header(&req, API_KEY),
        content_type: header(&req, CONTENT_TYPE.as_str()),
        body: body.to_vec(),
    };
    match state.uplink.forward(wire, cfg.answer_timeout).await {
        Ok(a) => {
            let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY);
            let mut r = HttpResponse::build(status).body(a.body);
            for (name, value) in [(CONTENT_TYPE, a.content_type), (RETRY_AFTER, a.retry_after)] {
                if let Some(v) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
                    r.headers_mut().insert(name, v);
                }
            }
            r
        }
        Err(why) => error_response(503, &why, Some(Duration::from_secs(1))),
    }
}

/// Binds `listen` and forwards every request to the engine node until the process ends;
/// `on_bound` gets the bound address once it accepts connections.
pub fn run_forwarding_http(
    uplink: Arc<HttpUplink>,
    cfg: ForwardConfig,
    listen: SocketAddr,
    on_bound: impl FnOnce(SocketAddr),
) -> std::io::Result<()> {
    cfg.cpus.as_ref().map(super::check_http_cpus).transpose()?;
    let state = web::Data::new(ForwardState { uplink, cfg });
    actix_web::rt::System::new().block_on(async move {
        let server = HttpServer::new(move || {
            // actix-web builds the app on each worker's own thread as it starts.
            super::pin_worker_once(cfg.cpus);
            App::new()
                .app_data(state.clone())
                .default_service(web::to(forward))
        })
        .workers(cfg.workers.max(1))
        .client_request_timeout(cfg.client_timeout)
        .client_disconnect_timeout(Duration::from_millis(500))
        .bind(listen)?;
        let addr = server.addrs()[0];
        let running = server.run();
        on_bound(addr);
        running.await
    })
}

/// [`run_forwarding_http`] on a thread of its own, for node `id`; it prints `listening on
/// http://ADDR` once bound (after `on_bound`). The process exits with an error naming the
/// node when the front end cannot start.
pub fn spawn_forwarding_http(
    id: u32,
    uplink: Arc<HttpUplink>,
    cfg: ForwardConfig,
    listen: SocketAddr,
    on_bound: impl FnOnce(SocketAddr) + Send + 'static,
) {
    let spawned = std::thread::Builder::new()
        .name("trellis-forward-http".into())
        .spawn(move || {
            let r = run_forwarding_http(uplink, cfg, listen, |addr| {
                on_bound(addr);
                println!("listening on http://{addr}");
                let _ = std::io::Write::flush(&mut std::io::stdout());
            });
            if let Err(e) = r {
                eprintln!("error: node {id} cannot serve HTTP on {listen}: {e}");
                std::process::exit(1);
            }
        });
    if let Err(e) = spawned {
        eprintln!("error: node {id} cannot start its HTTP front end: {e}");
        std::process::exit(1);
    }
}

/// Where this process reaches its own front end bound at `bound` (an unspecified address
/// is reached on loopback).
fn reachable(bound: SocketAddr) -> SocketAddr {
    let ip = match bound.ip() {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, bound.port())
}

fn failed(status: u16, message: String) -> HttpAnswerWire {
    HttpAnswerWire {
        status,
        retry_after: None,
        content_type: Some("application/json".into()),
        body: serde_json::json!({ "error": message })
            .to_string()
            .into_bytes(),
    }
}

/// How the engine node answers requests other nodes forward: through its own front end,
/// bound at `bound`, so they get the same answers as requests sent to it directly.
pub fn engine_forwarder(bound: SocketAddr, timeout: Duration) -> reqwest::Result<HttpForward> {
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .no_proxy()
        .build()?;
    let base = format!("http://{}", reachable(bound));
    Ok(Arc::new(move |req: HttpRequestWire| {
        let client = client.clone();
        let url = format!("{base}{}", req.path);
        Box::pin(async move {
            let Ok(method) = reqwest::Method::from_bytes(req.method.as_bytes()) else {
                return failed(400, format!("unknown HTTP method {}", req.method));
            };
            let mut r = client.request(method, &url).body(req.body);
            if let Some(k) = req.api_key {
                r = r.header(API_KEY, k);
            }
            if let Some(t) = req.content_type {
                r = r.header(CONTENT_TYPE.as_str(), t);
            }
            match r.send().await {
                Ok(resp) => {
                    let text = |name: &str| {
                        resp.headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string)
                    };
                    let (retry_after, content_type) =
                        (text(RETRY_AFTER.as_str()), text(CONTENT_TYPE.as_str()));
                    let status = resp.status().as_u16();
                    match resp.bytes().await {
                        Ok(body) => HttpAnswerWire {
                            status,
                            retry_after,
                            content_type,
                            body: body.to_vec(),
                        },
                        Err(e) => failed(502, format!("the engine node's answer: {e}")),
                    }
                }
                Err(e) => failed(502, format!("the engine node's front end: {e}")),
            }
        })
    }))
}
