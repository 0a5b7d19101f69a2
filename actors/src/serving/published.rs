//! The read side of serving: the last layer's rows (logits) of every node and the model
//! version they come from, shared with the HTTP workers so that predictions of existing
//! nodes are answered where the request is read, without a trip through the engine thread
//! and without waiting behind a graph update or a model load.
//!
//! The engine owns the tables and computes every change on its own copy; it then publishes
//! only the rows that changed (an update's last-layer region) or, after a model swap or a
//! recovery, the whole table and the new version, each under one short write lock. A reader
//! holds the read lock for one whole answer, so an answer never mixes two versions or two
//! graph states; a write lasts as long as copying the changed rows (one new node on a
//! degree-20 graph: about 4,300 rows of 16 floats), which is the longest a reader can wait
//! (and, when new nodes outgrow the table's capacity, one reallocation of it).
use super::engine::{Answer, NodePrediction};
use super::ServeError;
use std::sync::RwLock;
use trellis_runtime::inference::{argmax, softmax_row, Rows};

/// What a reader sees: one model version's last-layer rows.
#[derive(Debug)]
struct Snapshot {
    version: String,
    logits: Rows,
}

/// The published last-layer rows (see the module's documentation).
#[derive(Debug)]
pub struct Published {
    current: RwLock<Snapshot>,
}

impl Published {
    /// The rows of `version`.
    pub fn new(version: String, logits: Rows) -> Self {
        Published {
            current: RwLock::new(Snapshot { version, logits }),
        }
    }

    /// Replaces every row and the version at once (a model swap, a rebuild); the table
    /// keeps room for new nodes ([`super::spare_rows`]).
    pub fn replace(&self, version: String, mut logits: Rows) {
        logits.reserve_rows(super::spare_rows(logits.len()));
        let old = {
            let mut s = self.current.write().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *s, Snapshot { version, logits })
        };
        drop(old); // freed outside the lock
    }

    /// Publishes the rows `ids` of `logits` (the engine's table, which has `logits.len()`
    /// rows now: new nodes extend the published table).
    pub fn update_rows(&self, ids: &[u32], logits: &Rows) {
        let w = logits.width;
        let mut s = self.current.write().unwrap_or_else(|e| e.into_inner());
        let n = logits.len();
        if s.logits.len() < n {
            s.logits.data.resize(n * w, 0.0);
        }
        for &i in ids {
            let i = i as usize;
            s.logits.data[i * w..(i + 1) * w].copy_from_slice(&logits.data[i * w..(i + 1) * w]);
        }
    }

    /// Publishes rows `ids` (`width` values each, in order, from `rows`); the table grows
    /// to `n` rows (new nodes).
    pub fn write_rows(&self, ids: &[u32], rows: &[f32], width: usize, n: usize) {
        let mut s = self.current.write().unwrap_or_else(|e| e.into_inner());
        if s.logits.width != width || rows.len() != ids.len() * width {
            tracing::error!(
                "published rows of width {width} ({} values for {} rows) for a table of width {}",
                rows.len(),
                ids.len(),
                s.logits.width
            );
            return;
        }
        if s.logits.len() < n {
            s.logits.data.resize(n * width, 0.0);
        }
        for (k, &i) in ids.iter().enumerate() {
            let i = i as usize;
            s.logits.data[i * width..(i + 1) * width]
                .copy_from_slice(&rows[k * width..(k + 1) * width]);
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
            .logits
            .len()
    }

    /// Class and probabilities of each of `nodes` (in that order, repeats allowed), all from
    /// one version; an unknown node fails the whole query.
    pub fn predict(&self, nodes: &[u32]) -> Result<Answer, ServeError> {
        let s = self.current.read().unwrap_or_else(|e| e.into_inner());
        let n = s.logits.len();
        if let Some(&v) = nodes.iter().find(|&&v| v as usize >= n) {
            return Err(ServeError::UnknownNode { node: v, nodes: n });
        }
        let predictions = nodes
            .iter()
            .map(|&v| {
                let row = s.logits.row(v);
                NodePrediction {
                    node: v,
                    class: argmax(row),
                    probabilities: softmax_row(row),
                    embedding: None,
                }
            })
            .collect();
        Ok(Answer {
            model_version: s.version.clone(),
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

    fn rows(n: usize, v: f32) -> Rows {
        Rows {
            width: 2,
            data: (0..n).flat_map(|i| [v * i as f32, 0.0]).collect(),
        }
    }

    #[test]
    fn answers_name_the_version_and_see_published_rows_only() {
        let p = Published::new("v1".into(), rows(3, 1.0));
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
        // The engine's table grew to 4 rows and changed rows 1 and 3: only they are copied.
        let mut engine = rows(4, 1.0);
        engine.data[2..4].copy_from_slice(&[0.0, 5.0]);
        engine.data[6..8].copy_from_slice(&[0.0, 7.0]);
        engine.data[4..6].copy_from_slice(&[9.0, 9.0]); // not published
        p.update_rows(&[1, 3], &engine);
        assert_eq!(p.nodes(), 4);
        let a = p.predict(&[1, 2, 3]).unwrap();
        assert_eq!(a.predictions[0].class, 1);
        assert_eq!(a.predictions[2].class, 1);
        let expect = softmax_row(&[2.0, 0.0]);
        assert_eq!(a.predictions[1].probabilities, expect);
        p.replace("v2".into(), rows(1, 0.0));
        assert_eq!(p.version(), "v2");
        assert_eq!(p.predict(&[0]).unwrap().model_version, "v2");
        assert!(p.predict(&[1]).is_err());
    }
}
