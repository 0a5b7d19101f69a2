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
    /// Per partition: its rows updated incrementally instead of computed (the last layer of
    /// an incremental update, [`plan_incremental_update`]; empty otherwise).
    pub increment: Vec<Ids>,
    /// Per partition: `(to, rows)`, the changes of its transformed rows it sends partition
    /// `to` for that partition's incremental rows.
    pub increment_send: PeerLists,
    /// Per partition: `(from, rows)`, the changes it receives (the same lists).
    pub increment_recv: PeerLists,
    /// The last layer's rows are read from its transformed rows
    /// ([`Model::last_layer_reads_transformed`]): the partitions transform `transform` and
    /// answer those rows; nothing is computed or exchanged.
    ///
    /// [`Model::last_layer_reads_transformed`]: trellis_runtime::Model::last_layer_reads_transformed
    pub returns_transformed: bool,
}

impl LayerPlan {
    /// Rows computed or updated at this layer (the transformed ones, where those are the
    /// layer's answer), all partitions together.
    pub fn rows(&self) -> usize {
        let answered = if self.returns_transformed {
            &self.transform
        } else {
            &self.compute
        };
        answered
            .iter()
            .chain(&self.increment)
            .map(|c| c.len())
            .sum()
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
/// `owner[v]`'s); `split[l]` says whether layer `l` is split; with `read_last` the last
/// layer (split) only transforms ([`LayerPlan::returns_transformed`]).
pub fn plan_pass(
    graph: &NodeGraph,
    owner: &[u32],
    parts: usize,
    split: &[bool],
    read_last: bool,
    coverage: Coverage<'_>,
) -> Vec<LayerPlan> {
    plan_layers(graph, owner, parts, split, read_last, coverage, |_| true)
}

/// The layers of an update pass at `changed`, on partitions none of which restarted, with
/// the layers marked in `incremental` updated incrementally: layers whose pre-activation
/// rows are linear in their degree-scaled transformed rows ([`Model::takes_increments`]).
/// Of the rows the change reaches at such a layer, only those whose own degree or edges
/// changed (`changed`: new nodes and the ends of added or removed edges), and those updated
/// incrementally `max_increments` times since they were last computed, are computed again;
/// every other row `v` keeps its pre-activation row plus `Σ_u ΔY_u / sqrt(d_v + 1)` over its
/// neighbours `u` among the layer's re-transformed rows, where the change
/// `ΔY_u = Z'_u / sqrt(d'_u + 1) - Z_u / sqrt(d_u + 1)` (new and old transformed row and
/// degree) comes from `u`'s owner.
/// The re-transformed rows are those whose input row changed (`D_{l-1}`, a split layer's) or,
/// at layer 0, whose features never change, the changed nodes (`Z_u = X_u W`: a new node's
/// old row is zero, the others' only changed scale). An increment rounds differently from
/// the aggregation (a few units in the last place of the row); bounding the increments of a
/// row between two computations bounds how far it drifts from the computed value.
/// `increments[l][v]` counts them (grown to the model's layers and the graph's size here;
/// the caller resets it wherever every row is computed).
///
/// [`Model::takes_increments`]: trellis_runtime::Model::takes_increments
#[allow(clippy::too_many_arguments)] // one pure function of the pass's inputs
pub fn plan_incremental_update(
    graph: &NodeGraph,
    owner: &[u32],
    parts: usize,
    split: &[bool],
    read_last: bool,
    incremental: &[bool],
    changed: &[u32],
    increments: &mut Vec<Vec<u8>>,
    max_increments: u8,
) -> Vec<LayerPlan> {
    let full = vec![false; parts];
    let coverage = Coverage::Changed {
        nodes: changed,
        full: &full,
    };
    let is_incremental = |l: usize| incremental.get(l) == Some(&true);
    // The incremental layers' exchanges are planned by `make_incremental`.
    let mut plans = plan_layers(graph, owner, parts, split, read_last, coverage, |l| {
        !is_incremental(l)
    });
    increments.resize(plans.len(), Vec::new());
    let mut edited: Vec<u32> = changed
        .iter()
        .copied()
        .filter(|&v| (v as usize) < graph.num_nodes())
        .collect();
    edited.sort_unstable();
    edited.dedup();
    for (l, plan) in plans.iter_mut().enumerate() {
        if !is_incremental(l) || plan.returns_transformed {
            continue;
        }
        if l == 0 && !split[0] {
            plan.transform = by_owner(&edited, owner, parts);
        }
        make_incremental(
            plan,
            graph,
            owner,
            &edited,
            &mut increments[l],
            max_increments,
        );
    }
    plans
}

/// [`plan_pass`], with the exchange lists of the layers `lists` refuses left empty.
fn plan_layers(
    graph: &NodeGraph,
    owner: &[u32],
    parts: usize,
    split: &[bool],
    read_last: bool,
    coverage: Coverage<'_>,
    lists: impl Fn(usize) -> bool,
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
    let none = || -> Vec<Ids> { (0..parts).map(|_| Arc::new(Vec::new())).collect() };
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
        let transform = if is_split { pick(&set) } else { none() };
        if read_last && is_split && l + 1 == split.len() {
            plans.push(LayerPlan {
                layer: l,
                transform,
                compute: none(),
                send: vec![Vec::new(); parts],
                recv: vec![Vec::new(); parts],
                increment: none(),
                increment_send: vec![Vec::new(); parts],
                increment_recv: vec![Vec::new(); parts],
                returns_transformed: true,
            });
            break;
        }
        if let Some(s) = &set {
            set = Some(graph.expand(s));
        }
        let compute = pick(&set);
        let (send, recv) = match (&set, &full_lists) {
            (None, Some(lists)) => lists.clone(),
            _ if !lists(l) => (vec![Vec::new(); parts], vec![Vec::new(); parts]),
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
            increment: none(),
            increment_send: vec![Vec::new(); parts],
            increment_recv: vec![Vec::new(); parts],
            returns_transformed: false,
        });
    }
    plans
}

/// Turns `plan`, a layer of an update pass whose `transform` lists its re-transformed rows,
/// into an incremental one (see [`plan_incremental_update`]).
fn make_incremental(
    plan: &mut LayerPlan,
    graph: &NodeGraph,
    owner: &[u32],
    changed: &[u32],
    increments: &mut Vec<u8>,
    max_increments: u8,
) {
    let n = graph.num_nodes();
    let parts = plan.compute.len();
    increments.resize(n, 0);
    let mut edited = Bitset::new(n);
    for &v in changed {
        edited.set(v);
    }
    let mut transformed = Bitset::new(n);
    for &v in plan.transform.iter().flat_map(|t| t.iter()) {
        transformed.set(v);
    }
    let mut exact = Vec::with_capacity(parts);
    let mut increment = Vec::with_capacity(parts);
    for rows in &plan.compute {
        let (mut e, mut i) = (Vec::new(), Vec::new());
        for &v in rows.iter() {
            let count = &mut increments[v as usize];
            if edited.get(v) || *count >= max_increments {
                *count = 0;
                e.push(v);
            } else {
                *count += 1;
                i.push(v);
            }
        }
        exact.push(Arc::new(e));
        increment.push(Arc::new(i));
    }
    let (send, recv) = halo_lists(graph, owner, parts, &exact);
    // The changes an incremental row reads: of its neighbours, the re-transformed ones.
    let (increment_send, increment_recv) =
        peer_lists(graph, owner, parts, &increment, |u| transformed.get(u));
    plan.compute = exact;
    plan.send = send;
    plan.recv = recv;
    plan.increment = increment;
    plan.increment_send = increment_send;
    plan.increment_recv = increment_recv;
}

/// One bit per node.
struct Bitset(Vec<u64>);

impl Bitset {
    fn new(n: usize) -> Self {
        Bitset(vec![0; n.div_ceil(64)])
    }
    fn set(&mut self, v: u32) {
        self.0[v as usize / 64] |= 1 << (v % 64);
    }
    fn get(&self, v: u32) -> bool {
        self.0[v as usize / 64] & (1 << (v % 64)) != 0
    }
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
    peer_lists(graph, owner, parts, compute, |_| true)
}

/// For each partition `p`, the neighbours of its `rows` that other partitions own and `read`
/// admits, grouped by owner: (send lists by sender, receive lists by receiver).
fn peer_lists(
    graph: &NodeGraph,
    owner: &[u32],
    parts: usize,
    rows: &[Ids],
    read: impl Fn(u32) -> bool,
) -> (PeerLists, PeerLists) {
    let mut send: PeerLists = vec![Vec::new(); parts];
    let mut recv: PeerLists = vec![Vec::new(); parts];
    if parts < 2 {
        return (send, recv); // nothing is another partition's
    }
    for (p, rows) in rows.iter().enumerate() {
        let mut need: Vec<Vec<u32>> = vec![Vec::new(); parts];
        for &v in rows.iter() {
            for &j in graph.neighbors(v) {
                let q = owner[j as usize] as usize;
                if q != p && read(j) {
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
        let plans = plan_pass(&g, &owner, 2, &[false, true], false, Coverage::Full);
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
            false,
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
            false,
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
            false,
            Coverage::Changed {
                nodes: &[],
                full: &[false, false],
            },
        );
        assert!(plans.iter().all(|p| p.rows() == 0));
    }

    #[test]
    fn an_incremental_last_layer_computes_changed_rows_and_adds_into_the_others() {
        let (g, owner) = path();
        let changed = [3u32];
        let split = [false, true];
        let mut increments = Vec::new();
        let plans = plan_incremental_update(
            &g,
            &owner,
            2,
            &split,
            false,
            &[false, true],
            &changed,
            &mut increments,
            2,
        );
        let last = &plans[1];
        // D_0 = {2, 3, 4} is re-transformed; D_1 = {1, ..., 5}: node 3 (changed) is computed,
        // the others take the changes of their re-transformed neighbours.
        assert_eq!(*last.transform[0], vec![2]);
        assert_eq!(*last.transform[1], vec![3, 4]);
        assert_eq!(*last.compute[0], Vec::<u32>::new());
        assert_eq!(*last.compute[1], vec![3]);
        assert_eq!(*last.increment[0], vec![1, 2]);
        assert_eq!(*last.increment[1], vec![4, 5]);
        // Node 3's block reads node 2 (partition 0's); node 2's increment reads 3's change,
        // and node 4's reads nothing of partition 0 (2 is not its neighbour).
        assert_eq!(last.recv[1], vec![(0, Arc::new(vec![2]))]);
        assert_eq!(last.increment_recv[0], vec![(1, Arc::new(vec![3]))]);
        assert_eq!(last.increment_send[1], vec![(0, Arc::new(vec![3]))]);
        assert!(last.increment_recv[1].is_empty());
        assert_eq!(last.rows(), 5);
        // After two increments a row is computed again.
        plan_incremental_update(
            &g,
            &owner,
            2,
            &split,
            false,
            &[false, true],
            &changed,
            &mut increments,
            2,
        );
        let plans = plan_incremental_update(
            &g,
            &owner,
            2,
            &split,
            false,
            &[false, true],
            &changed,
            &mut increments,
            2,
        );
        assert_eq!(*plans[1].compute[0], vec![1, 2]);
        assert!(plans[1].increment[0].is_empty());
    }

    #[test]
    fn an_incremental_first_layer_transforms_the_changed_nodes_and_sends_their_changes() {
        let (g, owner) = path();
        let changed = [3u32];
        let mut increments = Vec::new();
        let plans = plan_incremental_update(
            &g,
            &owner,
            2,
            &[false, true],
            false,
            &[true, true],
            &changed,
            &mut increments,
            2,
        );
        let first = &plans[0];
        // Only node 3's degree changed: its row is computed (reading node 2, partition 0's
        // features), its neighbours 2 and 4 take its change.
        assert_eq!(*first.transform[1], vec![3]);
        assert!(first.transform[0].is_empty());
        assert_eq!(*first.compute[1], vec![3]);
        assert!(first.compute[0].is_empty());
        assert_eq!(*first.increment[0], vec![2]);
        assert_eq!(*first.increment[1], vec![4]);
        assert_eq!(first.recv[1], vec![(0, Arc::new(vec![2]))]);
        assert!(first.recv[0].is_empty());
        assert_eq!(first.increment_send[1], vec![(0, Arc::new(vec![3]))]);
        assert_eq!(first.increment_recv[0], vec![(1, Arc::new(vec![3]))]);
        assert!(
            first.increment_recv[1].is_empty(),
            "node 4 reads 3's change locally"
        );
        // The last layer re-transforms every row layer 0 changed.
        assert_eq!(*plans[1].transform[0], vec![2]);
        assert_eq!(*plans[1].transform[1], vec![3, 4]);
        assert_eq!(increments.len(), 2);
        assert_eq!(increments[0][2], 1);
        assert_eq!(increments[0][3], 0);
    }
}
