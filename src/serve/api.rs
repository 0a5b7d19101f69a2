//! The JSON bodies of the serving API and their validation (sizes, ids, numbers), turning
//! every bad request into a message that says what is wrong.
use serde::Deserialize;
use trellis_actors::serving::engine::{Edge, NewNode};

/// `POST /v1/predict`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PredictRequest {
    pub nodes: Vec<u64>,
    /// Also return this layer's rows (0 = first layer).
    #[serde(default)]
    pub embeddings: Option<usize>,
}

/// One node of `POST /v1/nodes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewNodeBody {
    pub features: Vec<f64>,
    #[serde(default)]
    pub edges: Vec<u64>,
}

/// `POST /v1/nodes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesRequest {
    pub nodes: Vec<NewNodeBody>,
}

/// `POST /v1/edges`: pairs `[a, b]` to add and to remove.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgesRequest {
    #[serde(default)]
    pub add: Vec<[u64; 2]>,
    #[serde(default)]
    pub remove: Vec<[u64; 2]>,
}

/// Limits on what one request may ask for.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Nodes (or edges) one request may name.
    pub max_batch: usize,
    /// Bytes of a JSON body.
    pub max_body: usize,
    /// Bytes of a model body (`PUT /v1/model`).
    pub max_model_body: usize,
}

impl Limits {
    /// `trellis serve`'s defaults (`--max-batch`, `--max-body-bytes`, `--max-model-bytes`),
    /// also those of the services the demo, `bench serve` and `train --serve` start.
    pub const DEFAULT: Limits = Limits {
        max_batch: 10_000,
        max_body: 4 << 20,
        max_model_body: 1 << 30,
    };
}

/// A request that cannot be served as sent: HTTP status and message.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
}

impl Rejection {
    pub fn bad(message: impl Into<String>) -> Self {
        Rejection {
            status: 400,
            message: message.into(),
        }
    }
}

/// Parses a JSON body into `T`; a syntax or shape error says where and what.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Rejection> {
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "malformed JSON"
            }
            _ => "invalid request body",
        };
        Rejection::bad(format!("{what}: {e}"))
    })
}

fn too_many(what: &str, n: usize, limits: &Limits) -> Rejection {
    Rejection {
        status: 413,
        message: format!(
            "{n} {what} in one request is over the limit of {}",
            limits.max_batch
        ),
    }
}

/// A node id as the engine takes it.
pub fn node_id(v: u64, field: &str) -> Result<u32, Rejection> {
    u32::try_from(v).map_err(|_| Rejection {
        status: 404,
        message: format!("{field}: node {v} does not exist"),
    })
}

/// Checks a query's size and ids.
pub fn predict_nodes(r: &PredictRequest, limits: &Limits) -> Result<Vec<u32>, Rejection> {
    if r.nodes.is_empty() {
        return Err(Rejection::bad("`nodes` is empty: name at least one node"));
    }
    if r.nodes.len() > limits.max_batch {
        return Err(too_many("nodes", r.nodes.len(), limits));
    }
    r.nodes.iter().map(|&v| node_id(v, "nodes")).collect()
}

/// Checks new nodes: sizes, finite features (as `f32`), edge ids. Feature widths and edge
/// targets are checked by the engine, which knows the model and the graph.
pub fn new_nodes(r: NodesRequest, limits: &Limits) -> Result<Vec<NewNode>, Rejection> {
    if r.nodes.is_empty() {
        return Err(Rejection::bad("`nodes` is empty: add at least one node"));
    }
    if r.nodes.len() > limits.max_batch {
        return Err(too_many("nodes", r.nodes.len(), limits));
    }
    let edges: usize = r.nodes.iter().map(|n| n.edges.len()).sum();
    if edges > limits.max_batch {
        return Err(too_many("edges", edges, limits));
    }
    r.nodes
        .into_iter()
        .enumerate()
        .map(|(i, n)| {
            let features: Vec<f32> = n.features.iter().map(|&x| x as f32).collect();
            if let Some(k) = features.iter().position(|x| !x.is_finite()) {
                return Err(Rejection::bad(format!(
                    "nodes[{i}].features[{k}] = {:e} is not a finite 32-bit number",
                    n.features[k]
                )));
            }
            let edges = n
                .edges
                .iter()
                .map(|&v| node_id(v, &format!("nodes[{i}].edges")))
                .collect::<Result<_, _>>()?;
            Ok(NewNode { features, edges })
        })
        .collect()
}

/// Checks an edge update's size and ids.
pub fn edge_update(r: &EdgesRequest, limits: &Limits) -> Result<(Vec<Edge>, Vec<Edge>), Rejection> {
    let n = r.add.len() + r.remove.len();
    if n == 0 {
        return Err(Rejection::bad("neither `add` nor `remove` lists an edge"));
    }
    if n > limits.max_batch {
        return Err(too_many("edges", n, limits));
    }
    let conv = |list: &[[u64; 2]], field: &str| -> Result<Vec<Edge>, Rejection> {
        list.iter()
            .map(|[a, b]| {
                Ok(Edge {
                    a: node_id(*a, field)?,
                    b: node_id(*b, field)?,
                })
            })
            .collect()
    };
    Ok((conv(&r.add, "add")?, conv(&r.remove, "remove")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        max_batch: 3,
        max_body: 1000,
        max_model_body: 1000,
    };

    #[test]
    fn malformed_and_misshapen_bodies_say_what_is_wrong() {
        let e = parse::<PredictRequest>(b"{\"nodes\": [1,").unwrap_err();
        assert!(e.message.starts_with("malformed JSON"), "{e:?}");
        let e = parse::<PredictRequest>(b"{\"nodes\": \"x\"}").unwrap_err();
        assert!(e.message.starts_with("invalid request body"), "{e:?}");
        let e = parse::<PredictRequest>(b"{\"node\": [1]}").unwrap_err();
        assert!(e.message.contains("unknown field `node`"), "{e:?}");
    }

    #[test]
    fn sizes_ids_and_numbers_are_checked() {
        let r = PredictRequest {
            nodes: vec![1, 2, 3, 4],
            embeddings: None,
        };
        assert_eq!(predict_nodes(&r, &L).unwrap_err().status, 413);
        let r = PredictRequest {
            nodes: vec![1 << 40],
            embeddings: None,
        };
        assert_eq!(predict_nodes(&r, &L).unwrap_err().status, 404);
        let r = NodesRequest {
            nodes: vec![NewNodeBody {
                features: vec![1.0, 1e300],
                edges: vec![],
            }],
        };
        let e = new_nodes(r, &L).unwrap_err();
        assert!(e.message.contains("nodes[0].features[1]"), "{e:?}");
    }
}
