//! The read side of serving: the last layer's rows of every node and the model version they
//! come from, shared with the HTTP workers so that predictions of existing nodes are
//! answered where the request is read, without a trip through the engine thread and
//! without waiting behind a graph update or a model load.
//!
//! The rows are either the logits themselves ([`LastRows::Logits`]) or, when the model's
//! last layer is a split GCN layer with no activation
//! ([`Model::last_layer_reads_transformed`]), its transformed rows `Z` and bias
//! ([`LastRows::Transformed`]): a reader then aggregates the logits of the nodes it asks
//! for from `Z` and its own copy of the graph (about 20 rows each), and a graph update
//! publishes only the `Z` rows that changed (a few hundred per new node) instead of every
//! logit row they reach (about 4,300 per new node on a degree-20 graph).
//!
//! The engine owns the tables and computes every change on its own copy; it then publishes
//! the rows that changed with the graph changes they were computed for (an update) or,
//! after a model swap or a recovery, the whole table and the new version, each under one
//! short write lock. A reader holds the read lock for one whole answer, so an answer never
//! mixes two versions or two graph states.
//!
//! [`Model::last_layer_reads_transformed`]: trellis_runtime::Model::last_layer_reads_transformed
use super::engine::{Answer, NodePrediction};
use super::part::{ComputedRows, DeltaOp};
use super::ServeError;
use std::sync::RwLock;
use trellis_runtime::inference::{aggregate_gcn_row, argmax, softmax_row, NodeGraph, Rows};

/// The last layer's rows as published.
#[derive(Debug, Clone, PartialEq)]
pub enum LastRows {
    /// Every node's logits.
    Logits(Rows),
    /// Every node's transformed rows `Z` of the last layer and its bias: a node's logits are
    /// [`aggregate_gcn_row`] of them.
    Transformed { z: Rows, bias: Vec<f32> },
}

impl LastRows {
    fn table(&self) -> &Rows {
        match self {
            LastRows::Logits(r) | LastRows::Transformed { z: r, .. } => r,
        }
    }
    fn table_mut(&mut self) -> &mut Rows {
        match self {
            LastRows::Logits(r) | LastRows::Transformed { z: r, .. } => r,
        }
    }
}

/// What a reader sees: one model version's last-layer rows, and with transformed rows the
/// graph they are aggregated over.
#[derive(Debug)]
struct Snapshot {
    version: String,
    rows: LastRows,
    /// The served graph as of these rows (kept with [`LastRows::Transformed`] only).
    graph: Option<NodeGraph>,
}

impl Snapshot {
    /// The logits of node `v` (which exists) into `out`.
    fn logits(&self, v: u32, out: &mut Vec<f32>) {
        match (&self.rows, &self.graph) {
            (LastRows::Transformed { z, bias }, Some(g)) => {
                out.resize(z.width, 0.0);
                aggregate_gcn_row(g, z, bias, v, out);
            }
            (rows, _) => {
                out.clear();
                out.extend_from_slice(rows.table().row(v));
            }
        }
    }

    /// Applies graph changes to the kept graph (none kept: nothing to do). They were
    /// checked by the engine's graph, which took them first.
    fn apply(&mut self, edits: &[DeltaOp]) {
        let Some(g) = &mut self.graph else {
            return;
        };
        for e in edits {
            let r = match *e {
                DeltaOp::AddNode { id, .. } => {
                    let got = g.add_node();
                    if got == id {
                        Ok(true)
                    } else {
                        Err(format!("new node {id} became {got}"))
                    }
                }
                DeltaOp::AddEdge { a, b } => g.add_edge(a, b).map_err(|e| e.to_string()),
                DeltaOp::RemoveEdge { a, b } => g.remove_edge(a, b).map_err(|e| e.to_string()),
            };
            if let Err(e) = r {
                tracing::error!("published graph: a change the served graph took failed: {e}");
            }
        }
    }
}

/// The published last-layer rows (see the module's documentation).
#[derive(Debug)]
pub struct Published {
    current: RwLock<Snapshot>,
}

impl Published {
    /// The rows of `version`; with [`LastRows::Transformed`], `graph` is the served graph
    /// they were computed on (else it is not kept).
    pub fn new(version: String, rows: LastRows, graph: &NodeGraph) -> Self {
        let graph = matches!(rows, LastRows::Transformed { .. }).then(|| graph.clone());
        Published {
            current: RwLock::new(Snapshot {
                version,
                rows,
                graph,
            }),
        }
    }

    /// Replaces every row and the version at once (a model swap, a rebuild), computed on the
    /// graph after `edits` (the graph changes made since the last publish); the table keeps
    /// room for new nodes ([`super::spare_rows`]).
    pub fn replace(&self, version: String, mut rows: LastRows, edits: &[DeltaOp]) {
        let t = rows.table_mut();
        t.reserve_rows(super::spare_rows(t.len()));
        let old = {
            let mut s = self.current.write().unwrap_or_else(|e| e.into_inner());
            s.apply(edits);
            s.version = version;
            std::mem::replace(&mut s.rows, rows)
        };
        drop(old); // freed outside the lock
    }

    /// Publishes every partition's returned rows `parts`, computed on the graph after
    /// `edits` (the graph changes made since the last publish), under one write lock; the
    /// table grows to `n` rows (new nodes).
    pub fn write_rows(&self, edits: &[DeltaOp], parts: &[ComputedRows], n: usize) {
        let mut s = self.current.write().unwrap_or_else(|e| e.into_inner());
        s.apply(edits);
        let table = s.rows.table_mut();
        let width = table.width;
        if table.len() < n {
            table.data.resize(n * width, 0.0);
        }
        for r in parts {
            if r.width != width || r.data.len() != r.ids.len() * width {
                tracing::error!(
                    "published rows of width {} ({} values for {} rows) for a table of width \
                     {width}",
                    r.width,
                    r.data.len(),
                    r.ids.len()
                );
                continue;
            }
            table.scatter(&r.ids, &r.data);
        }
    }

    /// The version being served.
    pub fn version(&self) -> String {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .version
            .clone()
    }

    /// Number of nodes that can be queried.
    pub fn nodes(&self) -> usize {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .rows
            .table()
            .len()
    }

    /// The logits of each of `nodes` (in that order, repeats allowed) and their version,
    /// all from one version; an unknown node fails the whole query.
    pub fn logits(&self, nodes: &[u32]) -> Result<(String, Vec<Vec<f32>>), ServeError> {
        let s = self.current.read().unwrap_or_else(|e| e.into_inner());
        let n = s.rows.table().len();
        if let Some(&v) = nodes.iter().find(|&&v| v as usize >= n) {
            return Err(ServeError::UnknownNode { node: v, nodes: n });
        }
        let rows = nodes
            .iter()
            .map(|&v| {
                let mut row = Vec::new();
                s.logits(v, &mut row);
                row
            })
            .collect();
        Ok((s.version.clone(), rows))
    }

    /// Class and probabilities of each of `nodes` (in that order, repeats allowed), all from
    /// one version; an unknown node fails the whole query.
    pub fn predict(&self, nodes: &[u32]) -> Result<Answer, ServeError> {
        let (version, rows) = self.logits(nodes)?;
        let predictions = nodes
            .iter()
            .zip(rows)
            .map(|(&v, row)| NodePrediction {
                node: v,
                class: argmax(&row),
                probabilities: softmax_row(&row),
                embedding: None,
            })
            .collect();
        Ok(Answer {
            model_version: version,
            predictions,
            recomputed_rows: Vec::new(),
            edges_added: None,
            edges_removed: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn rows(n: usize, v: f32) -> Rows {
        Rows {
            width: 2,
            data: (0..n).flat_map(|i| [v * i as f32, 0.0]).collect(),
        }
    }

    fn path(n: usize) -> NodeGraph {
        let mut g = NodeGraph::default();
        for _ in 0..n {
            g.add_node();
        }
        for v in 1..n as u32 {
            g.add_edge(v - 1, v).unwrap();
        }
        g
    }

    #[test]
    fn answers_name_the_version_and_see_published_rows_only() {
        let p = Published::new("v1".into(), LastRows::Logits(rows(3, 1.0)), &path(3));
        let a = p.predict(&[2, 0, 2]).unwrap();
        assert_eq!(a.model_version, "v1");
        assert_eq!(
            a.predictions.iter().map(|x| x.node).collect::<Vec<_>>(),
            [2, 0, 2]
        );
        assert_eq!(a.predictions[0].class, 0); // logits [2, 0]
        assert_eq!(
            p.predict(&[3]).unwrap_err(),
            ServeError::UnknownNode { node: 3, nodes: 3 }
        );
        // The table grows to 4 rows with rows 1 and 3 written.
        let written = ComputedRows {
            ids: Arc::new(vec![1, 3]),
            width: 2,
            data: vec![0.0, 5.0, 0.0, 7.0],
        };
        p.write_rows(&[], &[written], 4);
        assert_eq!(p.nodes(), 4);
        let a = p.predict(&[1, 2, 3]).unwrap();
        assert_eq!(a.predictions[0].class, 1);
        assert_eq!(a.predictions[2].class, 1);
        assert_eq!(a.predictions[1].probabilities, softmax_row(&[2.0, 0.0]));
        p.replace("v2".into(), LastRows::Logits(rows(1, 0.0)), &[]);
        assert_eq!(p.version(), "v2");
        assert_eq!(p.predict(&[0]).unwrap().model_version, "v2");
        assert!(p.predict(&[1]).is_err());
    }

    /// Logits aggregated from transformed rows equal the GCN formula on the graph as the
    /// published changes left it, not on the graph the engine has moved on to.
    #[test]
    fn transformed_rows_are_aggregated_over_the_published_graph() {
        let z = Rows {
            width: 2,
            data: vec![1.0, 0.0, 0.0, 2.0, 4.0, 1.0],
        };
        let bias = vec![0.5, -0.5];
        let g = path(3);
        let p = Published::new(
            "v1".into(),
            LastRows::Transformed {
                z,
                bias: bias.clone(),
            },
            &g,
        );
        // Node 0: degree 1, neighbour 1 of degree 2.
        let (_, got) = p.logits(&[0]).unwrap();
        let want0 = [
            1.0 / 2.0 + 0.0 / 6f32.sqrt() + 0.5,
            0.0 / 2.0 + 2.0 / 6f32.sqrt() - 0.5,
        ];
        assert!(got[0].iter().zip(want0).all(|(a, b)| (a - b).abs() < 1e-6));
        // A new node 3 linked to 0: its row and the degree of 0 change with the graph.
        let edits = [
            DeltaOp::AddNode {
                id: 3,
                owner: 0,
                features: vec![],
            },
            DeltaOp::AddEdge { a: 3, b: 0 },
        ];
        let written = ComputedRows {
            ids: Arc::new(vec![3]),
            width: 2,
            data: vec![2.0, 2.0],
        };
        p.write_rows(&edits, &[written], 4);
        let (_, got) = p.logits(&[0, 3]).unwrap();
        let (d0, d1, d3) = (3.0f32, 3.0f32, 2.0f32);
        let want0 = [
            1.0 / d0 + 0.0 / (d0 * d1).sqrt() + 2.0 / (d0 * d3).sqrt() + 0.5,
            0.0 / d0 + 2.0 / (d0 * d1).sqrt() + 2.0 / (d0 * d3).sqrt() - 0.5,
        ];
        let want3 = [
            1.0 / (d3 * d0).sqrt() + 2.0 / d3 + 0.5,
            0.0 / (d3 * d0).sqrt() + 2.0 / d3 - 0.5,
        ];
        assert!(got[0].iter().zip(want0).all(|(a, b)| (a - b).abs() < 1e-6));
        assert!(got[1].iter().zip(want3).all(|(a, b)| (a - b).abs() < 1e-6));
        let a = p.predict(&[3]).unwrap();
        assert_eq!(a.predictions[0].probabilities, softmax_row(&got[1]));
    }
}
