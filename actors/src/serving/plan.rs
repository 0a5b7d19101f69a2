//! Planning a serving pass (the start-up inference, a graph update, a recovery, a new
//! model's tables): which rows each partition computes at each layer, which of its rows are
//! transformed first (split layers), and which rows each partition sends each other one
//! before that layer (the halo rows their blocks read). Pure functions of the served graph,
//! the ownership table and the model's layer kinds; the engine turns each layer's plan into
//! one [`super::part::PassStep`] per partition.
use std::sync::Arc;
use trellis_runtime::inference::NodeGraph;

/// Rows of global node ids, ascending, shared between the messages that carry them.
pub type Ids = Arc<Vec<u32>>;

/// One layer of a pass.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub layer: usize,
    /// Per partition: its rows whose transformed rows `Z = H W` are computed first (split
    /// layers only; empty otherwise).
    pub transform: Vec<Ids>,
    /// Per partition: the rows it computes.
    pub compute: Vec<Ids>,
    /// Per partition: `(to, rows)`, the rows of its own it sends partition `to` (ascending
    /// `to`); layer `l-1`'s rows (the features for `l = 0`), or the `Z` rows of a split layer.
    pub send: PeerLists,
    /// Per partition: `(from, rows)`, the rows it receives (the same lists as `send`).
    pub recv: PeerLists,
}

impl LayerPlan {
    /// Rows computed at this layer, all partitions together.
    pub fn rows(&self) -> usize {
        self.compute.iter().map(|c| c.len()).sum()
    }
}

/// Per partition, `(peer, rows)` lists: the send lists or the receive lists of a layer.
pub type PeerLists = Vec<Vec<(u32, Ids)>>;

/// What a pass recomputes.
#[derive(Debug, Clone, Copy)]
pub enum Coverage<'a> {
    /// Every row of every layer.
    Full,
    /// The rows a change at these nodes reaches (`D_0 = S ∪ N(S)`, `D_l = D_{l-1} ∪
    /// N(D_{l-1})`), plus every row of the partitions marked in `full` (restarted ones).
    Changed { nodes: &'a [u32], full: &'a [bool] },
}

/// The layers of a pass over `graph` on `parts` partitions (node `v` is partition
/// `owner[v]`'s); `split[l]` says whether layer `l` is split.
pub fn plan_pass(
    graph: &NodeGraph,
    owner: &[u32],
    parts: usize,
    split: &[bool],
    coverage: Coverage<'_>,
) -> Vec<LayerPlan> {
    let mut plans = Vec::with_capacity(split.len());
    let (mut set, full) = match coverage {
        Coverage::Full => (None, vec![true; parts]),
        Coverage::Changed { nodes, full } => {
            let mut s = nodes.to_vec();
            s.sort_unstable();
            s.dedup();
            (
                Some(s),
                (0..parts).map(|p| full.get(p) == Some(&true)).collect(),
            )
        }
    };
    // Every partition's rows, only when some partition computes all of its own (an update
    // touches a few thousand rows of graphs of millions).
    let everything = if full.iter().any(|&f| f) {
        by_owner(
            &(0..graph.num_nodes() as u32).collect::<Vec<_>>(),
            owner,
            parts,
        )
    } else {
        Vec::new()
    };
    // Full passes exchange the same lists at every layer: computed once.
    let mut full_lists: Option<(PeerLists, PeerLists)> = None;
    for (l, &is_split) in split.iter().enumerate() {
        let pick = |rows: &Option<Vec<u32>>| -> Vec<Ids> {
            let grouped = rows.as_ref().map(|r| by_owner(r, owner, parts));
            (0..parts)
                .map(|p| match (&grouped, full[p]) {
                    (_, true) | (None, _) => everything[p].clone(),
                    (Some(g), false) => g[p].clone(),
                })
                .collect()
        };
        let transform = if is_split {
            pick(&set)
        } else {
            (0..parts).map(|_| Arc::new(Vec::new())).collect()
        };
        if let Some(s) = &set {
            set = Some(graph.expand(s));
        }
        let compute = pick(&set);
        let (send, recv) = match (&set, &full_lists) {
            (None, Some(lists)) => lists.clone(),
            _ => {
                let lists = halo_lists(graph, owner, parts, &compute);
                if set.is_none() {
                    full_lists = Some(lists.clone());
                }
                lists
            }
        };
        plans.push(LayerPlan {
            layer: l,
            transform,
            compute,
            send,
            recv,
        });
    }
    plans
}

/// The nodes of `set` (ascending) grouped by partition.
fn by_owner(set: &[u32], owner: &[u32], parts: usize) -> Vec<Ids> {
    let mut out = vec![Vec::new(); parts];
    for &v in set {
        out[owner[v as usize] as usize].push(v);
    }
    out.into_iter().map(Arc::new).collect()
}

/// For each partition `p`, the rows of other partitions its `compute` rows' blocks read,
/// grouped by owner: returns (send lists by sender, receive lists by receiver).
fn halo_lists(
    graph: &NodeGraph,
    owner: &[u32],
    parts: usize,
    compute: &[Ids],
) -> (PeerLists, PeerLists) {
    let mut send: PeerLists = vec![Vec::new(); parts];
    let mut recv: PeerLists = vec![Vec::new(); parts];
    for (p, rows) in compute.iter().enumerate() {
        let mut need: Vec<Vec<u32>> = vec![Vec::new(); parts];
        for &v in rows.iter() {
            for &j in graph.neighbors(v) {
                let q = owner[j as usize] as usize;
                if q != p {
                    need[q].push(j);
                }
            }
        }
        for (q, mut list) in need.into_iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            list.sort_unstable();
            list.dedup();
            let list = Arc::new(list);
            send[q].push((p as u32, list.clone()));
            recv[p].push((q as u32, list));
        }
    }
    for s in &mut send {
        s.sort_by_key(|(to, _)| *to);
    }
    (send, recv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path 0-1-2-3-4-5 split into parts {0,1,2} and {3,4,5}.
    fn path() -> (NodeGraph, Vec<u32>) {
        let mut g = NodeGraph::default();
        for _ in 0..6 {
            g.add_node();
        }
        for v in 0..5 {
            g.add_edge(v, v + 1).unwrap();
        }
        (g, vec![0, 0, 0, 1, 1, 1])
    }

    #[test]
    fn a_full_pass_computes_every_row_and_exchanges_the_cut() {
        let (g, owner) = path();
        let plans = plan_pass(&g, &owner, 2, &[false, true], Coverage::Full);
        assert_eq!(plans.len(), 2);
        for p in &plans {
            assert_eq!(*p.compute[0], vec![0, 1, 2]);
            assert_eq!(*p.compute[1], vec![3, 4, 5]);
            assert_eq!(p.send[0], vec![(1, Arc::new(vec![2]))]);
            assert_eq!(p.recv[1], vec![(0, Arc::new(vec![2]))]);
            assert_eq!(p.recv[0], vec![(1, Arc::new(vec![3]))]);
        }
        assert!(plans[0].transform.iter().all(|t| t.is_empty()));
        assert_eq!(*plans[1].transform[1], vec![3, 4, 5], "split layer");
    }

    #[test]
    fn a_change_reaches_one_more_hop_per_layer_and_restarted_parts_compute_all() {
        let (g, owner) = path();
        let changed = [0u32];
        let plans = plan_pass(
            &g,
            &owner,
            2,
            &[false, true, false],
            Coverage::Changed {
                nodes: &changed,
                full: &[false, false],
            },
        );
        assert_eq!(*plans[0].compute[0], vec![0, 1]);
        assert!(plans[0].compute[1].is_empty());
        assert!(
            plans[0].send.iter().all(|s| s.is_empty()),
            "no cut edge read"
        );
        // Layer 1 is split: it re-transforms D_0 and aggregates D_1.
        assert_eq!(*plans[1].transform[0], vec![0, 1]);
        assert_eq!(*plans[1].compute[0], vec![0, 1, 2]);
        assert_eq!(plans[1].recv[0], vec![(1, Arc::new(vec![3]))]);
        assert_eq!(*plans[2].compute[1], vec![3]);
        assert_eq!(plans[2].rows(), 4);
        // Partition 1 restarted: it computes every row, and partition 0 sends what it reads.
        let plans = plan_pass(
            &g,
            &owner,
            2,
            &[false, false],
            Coverage::Changed {
                nodes: &changed,
                full: &[false, true],
            },
        );
        assert_eq!(*plans[0].compute[1], vec![3, 4, 5]);
        assert_eq!(*plans[0].compute[0], vec![0, 1]);
        assert_eq!(plans[0].send[0], vec![(1, Arc::new(vec![2]))]);
        // Nothing changed and nothing restarted: nothing to do.
        let plans = plan_pass(
            &g,
            &owner,
            2,
            &[false, false],
            Coverage::Changed {
                nodes: &[],
                full: &[false, false],
            },
        );
        assert!(plans.iter().all(|p| p.rows() == 0));
    }
}
