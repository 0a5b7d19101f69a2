//! What the serving tests share: starting the real binary and waiting for its `listening on`
//! line, and one HTTP client call that returns status, body and the headers the tests read.
#![allow(dead_code)]
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A started `trellis` process with its stdout read line by line.
pub struct Started {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
}

/// `p` as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `trellis ARGS` to the end; fails the test unless it succeeds; its stdout.
pub fn trellis(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "trellis {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Appends `version` to the versions answered so far when it is new, failing the test if an
/// older one comes back (versions only move forward).
pub fn note_version(versions: &mut Vec<String>, version: String) {
    if versions.last() != Some(&version) {
        assert!(
            !versions.contains(&version),
            "version {version} came back after a newer one: {versions:?}"
        );
        versions.push(version);
    }
}

/// Runs `trellis ARGS` (with `env`), stdout piped into [`Started::lines`], stderr inherited.
pub fn start(args: &[&str], env: &[(&str, &str)]) -> Started {
    start_prepared(args, |c| {
        c.envs(env.iter().copied());
    })
}

/// [`start`], with the command prepared by `prepare` first (e.g. to run in a network
/// namespace).
pub fn start_prepared(args: &[&str], prepare: impl FnOnce(&mut Command)) -> Started {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellis"));
    prepare(&mut cmd);
    let mut child = cmd
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("trellis starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    Started { child, lines: rx }
}

/// Waits (bounded) for the `listening on http://...` line and returns its URL, checked to be
/// on 127.0.0.1 with the ephemeral port resolved.
pub fn listening_url(lines: &mpsc::Receiver<String>, within: Duration) -> String {
    let url = loop {
        let line = lines
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no `listening on` line within {within:?}: {e}"));
        if let Some(u) = line.strip_prefix("listening on ") {
            break u.to_string();
        }
    };
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    assert!(!url.ends_with(":0"), "port 0 was resolved: {url}");
    url
}

/// An HTTP client that returns 4xx/5xx answers instead of failing, bounded in time.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// An HTTP answer: status, body (as JSON when it parses), `Retry-After` and `traceparent`.
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub text: String,
    pub retry_after: Option<String>,
    pub traceparent: Option<String>,
}

/// `method url` with `body` (JSON content type unless GET) and `headers`.
pub fn request(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Reply {
    let mut resp = if method == "GET" {
        let mut r = agent.get(url);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.call()
    } else {
        let mut r = match method {
            "PUT" => agent.put(url),
            _ => agent.post(url),
        };
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.header("content-type", "application/json").send(body)
    }
    .expect("the request completes");
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (retry_after, traceparent) = (header("retry-after"), header("traceparent"));
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .with_config()
        .limit(1 << 30)
        .read_to_string()
        .unwrap();
    Reply {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        text,
        retry_after,
        traceparent,
    }
}

/// The first CPU of a `/proc/.../status` file's `Cpus_allowed_list` (`0-1` -> `0`).
pub fn first_allowed_cpu(status: &str) -> String {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in /proc status")
        .trim();
    list.split([',', '-']).next().unwrap().to_string()
}

/// The `Cpus_allowed_list` of each `actix-rt|system` thread of process `pid` (the HTTP
/// workers and actix's system thread), once `want` of them are on `cpu` or after 10 s:
/// the workers build their app, and pin themselves, as they start.
pub fn http_thread_cpus(pid: u32, cpu: &str, want: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut cpus = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let dir = task.unwrap().path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            if comm.trim() != "actix-rt|system" {
                continue;
            }
            let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
            if let Some(list) = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            {
                cpus.push(list.trim().to_string());
            }
        }
        if cpus.iter().filter(|c| *c == cpu).count() >= want || Instant::now() > deadline {
            return cpus;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Writes a graph (`features` of `width` per node; edges `src[i] -> dst[i]`) as a PyG-style
/// folder `dir/name`, with labels of four classes (as the tests' models predict) and
/// one-node masks.
pub fn write_dataset(
    dir: &Path,
    name: &str,
    features: &[f32],
    width: usize,
    src: &[i64],
    dst: &[i64],
) -> std::path::PathBuf {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let n = features.len() / width;
    let x = ndarray::Array2::from_shape_vec((n, width), features.to_vec()).unwrap();
    let mut e = src.to_vec();
    e.extend_from_slice(dst);
    let ei = ndarray::Array2::from_shape_vec((2, src.len()), e).unwrap();
    ndarray_npy::write_npy(out.join("x.npy"), &x).unwrap();
    ndarray_npy::write_npy(out.join("edge_index.npy"), &ei).unwrap();
    let mut y = ndarray::Array1::<i64>::zeros(n);
    y[0] = 3;
    ndarray_npy::write_npy(out.join("y.npy"), &y).unwrap();
    for m in ["train_mask", "val_mask", "test_mask"] {
        let mut mask = ndarray::Array1::from_elem(n, false);
        mask[0] = true;
        ndarray_npy::write_npy(out.join(format!("{m}.npy")), &mask).unwrap();
    }
    out
}
