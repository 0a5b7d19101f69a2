//! Layer-wise full-graph inference, and its incremental form for a changing graph.
//!
//! Inference runs one layer at a time over every node (as DGI's and PyG's layer-wise
//! inference do): layer `l`'s output row of each node is computed once, from the layer `l-1`
//! rows of its neighbours, never by expanding a neighbourhood per queried node. Each part of
//! a partitioning computes the rows of its own (inner) nodes over its [`Block`], its halo rows
//! read from the previous layer's table (the in-process halo exchange). Rows are computed by
//! the same kernels over the same entries in the same order whatever the partitioning, and
//! the layer input keeps the layout (sparse or dense) chosen for the whole feature matrix, so
//! one part and P parts give the same bits.
//!
//! [`NodeGraph`] is the mutable form of [`Graph`] (nodes and edges can be added, edges
//! removed); [`Inference::update`] recomputes, after such changes, only the rows they reach:
//! `D_0 = S ∪ N(S)` for the changed nodes `S` (new nodes, endpoints of changed edges: their
//! degrees, and so the normalisation of their rows and their neighbours', changed), then
//! `D_l = D_{l-1} ∪ N(D_{l-1})`, each part computing its own rows of `D_l`.
use crate::graph::Aggregation;
use crate::model::{LayerInput, Model, PreActivationInput, StepCtx};
use crate::train::normalize_rows;
use crate::{Block, Graph, Result, RuntimeError};
use std::borrow::Cow;
use trellis_gpu::{Stream, Tensor};

/// A symmetric graph without self loops or duplicate edges that can grow and change: row `i`
/// lists the neighbours of node `i` in ascending id.
#[derive(Debug, Clone, Default)]
pub struct NodeGraph {
    nbrs: Vec<Vec<u32>>,
    /// `nbrs[i].len()`, kept apart: blocks read the degrees of every halo node, and this
    /// table is a sixth of the size of the rows' headers (fewer cache misses).
    deg: Vec<u32>,
    entries: usize,
}

impl NodeGraph {
    /// The graph's adjacency, as rows that can change.
    pub fn from_graph(g: &Graph) -> Self {
        let nbrs = (0..g.num_nodes())
            .map(|i| g.neighbors(i).to_vec())
            .collect();
        let deg = (0..g.num_nodes())
            .map(|i| g.neighbors(i).len() as u32)
            .collect();
        NodeGraph {
            nbrs,
            deg,
            entries: g.num_entries(),
        }
    }

    /// A graph from its rows of neighbours, checked: each row ascending without
    /// duplicates, no self loops, no node out of range, every edge listed both ways.
    pub fn from_neighbors(nbrs: Vec<Vec<u32>>) -> Result<Self> {
        let n = nbrs.len();
        let bad = |m: String| Err(RuntimeError::BadData(m));
        for (v, row) in nbrs.iter().enumerate() {
            if row.windows(2).any(|w| w[0] >= w[1]) {
                return bad(format!(
                    "the neighbours of node {v} are not ascending without duplicates"
                ));
            }
            for &u in row {
                if u as usize >= n {
                    return bad(format!(
                        "node {v} has neighbour {u}, which does not exist ({n} nodes)"
                    ));
                }
                if u as usize == v {
                    return bad(format!("node {v} has a self loop"));
                }
                if nbrs[u as usize].binary_search(&(v as u32)).is_err() {
                    return bad(format!("edge {v}-{u} is listed by node {v} only"));
                }
            }
        }
        let deg = nbrs.iter().map(|r| r.len() as u32).collect();
        let entries = nbrs.iter().map(Vec::len).sum();
        Ok(NodeGraph { nbrs, deg, entries })
    }

    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.nbrs.len()
    }
    /// Number of undirected edges.
    pub fn num_edges(&self) -> usize {
        self.entries / 2
    }
    /// Neighbours of `i`, ascending.
    pub fn neighbors(&self, i: u32) -> &[u32] {
        &self.nbrs[i as usize]
    }
    /// Degree of `i` (no self loop).
    pub fn degree(&self, i: u32) -> usize {
        self.deg[i as usize] as usize
    }

    /// Adds an isolated node and returns its id.
    pub fn add_node(&mut self) -> u32 {
        self.nbrs.push(Vec::new());
        self.deg.push(0);
        (self.nbrs.len() - 1) as u32
    }

    fn check(&self, a: u32, b: u32) -> Result<()> {
        let n = self.num_nodes();
        if let Some(v) = [a, b].into_iter().find(|&v| v as usize >= n) {
            return Err(RuntimeError::BadData(format!(
                "node {v} does not exist ({n} nodes)"
            )));
        }
        if a == b {
            return Err(RuntimeError::BadData(format!(
                "edge {a}-{b} is a self loop (every layer already includes the node itself)"
            )));
        }
        Ok(())
    }

    /// Adds the undirected edge `a-b`; false if it was already there.
    pub fn add_edge(&mut self, a: u32, b: u32) -> Result<bool> {
        self.check(a, b)?;
        let row = &mut self.nbrs[a as usize];
        let Err(pos) = row.binary_search(&b) else {
            return Ok(false);
        };
        row.insert(pos, b);
        let row = &mut self.nbrs[b as usize];
        let pos = row.binary_search(&a).unwrap_err();
        row.insert(pos, a);
        self.deg[a as usize] += 1;
        self.deg[b as usize] += 1;
        self.entries += 2;
        Ok(true)
    }

    /// Removes the undirected edge `a-b`; false if there was none.
    pub fn remove_edge(&mut self, a: u32, b: u32) -> Result<bool> {
        self.check(a, b)?;
        let row = &mut self.nbrs[a as usize];
        let Ok(pos) = row.binary_search(&b) else {
            return Ok(false);
        };
        row.remove(pos);
        let row = &mut self.nbrs[b as usize];
        let pos = row.binary_search(&a).expect("rows are symmetric");
        row.remove(pos);
        self.deg[a as usize] -= 1;
        self.deg[b as usize] -= 1;
        self.entries -= 2;
        Ok(true)
    }

    /// The edges as `(src, dst)` lists, each undirected edge once (`src < dst`).
    pub fn edge_lists(&self) -> (Vec<u32>, Vec<u32>) {
        let mut src = Vec::with_capacity(self.num_edges());
        let mut dst = Vec::with_capacity(self.num_edges());
        for (i, row) in self.nbrs.iter().enumerate() {
            for &j in row.iter().filter(|&&j| j as usize > i) {
                src.push(i as u32);
                dst.push(j);
            }
        }
        (src, dst)
    }

    /// The block whose inner nodes are `inner` (ascending, distinct): halo nodes are their
    /// neighbours outside `inner`, ascending, weights from the current degrees (as
    /// [`Block::build`] over the same graph).
    pub fn block(&self, inner: &[u32], agg: Aggregation) -> Result<Block> {
        build_block(self, inner, agg, &mut LocalIds::default(), true)
    }

    /// Every node within one hop of `set` (ascending, `set` included).
    pub fn expand(&self, set: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = set
            .iter()
            .flat_map(|&v| std::iter::once(v).chain(self.neighbors(v).iter().copied()))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// What a block is built from: every node's neighbours (ascending) and degree. The whole
/// graph ([`NodeGraph`]) or one part's view of it ([`PartGraph`]: its own nodes' neighbours,
/// every node's degree).
pub trait Adjacency {
    /// Number of nodes.
    fn num_nodes(&self) -> usize;
    /// Neighbours of `i`, ascending (only asked for nodes whose rows are computed).
    fn neighbors(&self, i: u32) -> &[u32];
    /// Degree of `i` (no self loop).
    fn degree(&self, i: u32) -> usize;
}

impl Adjacency for NodeGraph {
    fn num_nodes(&self) -> usize {
        NodeGraph::num_nodes(self)
    }
    fn neighbors(&self, i: u32) -> &[u32] {
        NodeGraph::neighbors(self, i)
    }
    fn degree(&self, i: u32) -> usize {
        NodeGraph::degree(self, i)
    }
}

/// The block of the nodes `inner` of `graph` with a reusable global-to-local table; with `sorted_halo` false
/// the halo rows come in the order first met (a row's entries are in global-id order
/// either way, so every output row has the same bits).
pub(crate) fn build_block<G: Adjacency + ?Sized>(
    graph: &G,
    inner: &[u32],
    agg: Aggregation,
    map: &mut LocalIds,
    sorted_halo: bool,
) -> Result<Block> {
    let n = graph.num_nodes();
    if inner.windows(2).any(|w| w[0] >= w[1]) || inner.last().is_some_and(|&v| v as usize >= n) {
        return Err(RuntimeError::BadData(
            "inner nodes must be ascending, distinct and in range".into(),
        ));
    }
    map.reserve(n);
    for (l, &g) in inner.iter().enumerate() {
        map.insert(g, l as u32);
    }
    let entries: usize = inner.iter().map(|&g| graph.degree(g)).sum();
    let mut gids = Vec::with_capacity(inner.len() + entries.min(n));
    gids.extend_from_slice(inner);
    if sorted_halo {
        let mut halo: Vec<u32> = inner
            .iter()
            .flat_map(|&g| graph.neighbors(g).iter().copied())
            .filter(|&j| map.get(j).is_none())
            .collect();
        halo.sort_unstable();
        halo.dedup();
        for &g in &halo {
            map.insert(g, gids.len() as u32);
            gids.push(g);
        }
    }
    let mut indptr = Vec::with_capacity(inner.len() + 1);
    indptr.push(0usize);
    let mut indices = Vec::with_capacity(entries);
    for &g in inner {
        for &j in graph.neighbors(g) {
            let l = match map.get(j) {
                Some(l) => l,
                None => {
                    let l = gids.len() as u32;
                    map.insert(j, l);
                    gids.push(j);
                    l
                }
            };
            indices.push(l);
        }
        indptr.push(indices.len());
    }
    map.clear(&gids);
    let degrees: Vec<u32> = gids.iter().map(|&g| graph.degree(g) as u32).collect();
    Block::from_local(inner.len(), gids, &indptr, &indices, &degrees, agg)
}

/// Global-to-local ids of a block: a table with one entry per node of the graph, kept between
/// blocks (an incremental update builds blocks of a few thousand rows over graphs of
/// millions: allocating, clearing or hashing per block cost more than the kernels). Only the
/// entries a block set are cleared after it.
#[derive(Debug, Default)]
pub(crate) struct LocalIds {
    table: Vec<u32>,
}

impl LocalIds {
    /// Room for node ids below `n`.
    fn reserve(&mut self, n: usize) {
        if self.table.len() < n {
            self.table.resize(n, u32::MAX);
        }
    }
    fn insert(&mut self, g: u32, l: u32) {
        self.table[g as usize] = l;
    }
    fn get(&self, g: u32) -> Option<u32> {
        Some(self.table[g as usize]).filter(|&l| l != u32::MAX)
    }
    /// Forgets the ids `set` (every entry set since the last clear).
    fn clear(&mut self, set: &[u32]) {
        for &g in set {
            self.table[g as usize] = u32::MAX;
        }
    }
}

/// One part's view of a [`NodeGraph`]: the neighbours of its own (inner) nodes and every
/// node's degree (the weights of its blocks read the degrees of their halo nodes). Built from
/// the whole graph, then changed by the same additions and removals as the whole graph, so its
/// blocks equal the whole graph's blocks of the same nodes.
#[derive(Debug, Clone, Default)]
pub struct PartGraph {
    part: u32,
    /// The part's nodes, ascending global id (new nodes have the largest ids: they append).
    inner: Vec<u32>,
    /// Global id -> local row, `u32::MAX` for other parts' nodes.
    local: Vec<u32>,
    /// Neighbours of each inner node (ascending), by local row.
    nbrs: Vec<Vec<u32>>,
    /// Every node's degree.
    deg: Vec<u32>,
}

impl PartGraph {
    /// Part `part`'s view of `graph`, whose node `v` belongs to part `owner[v]`.
    pub fn from_graph(graph: &NodeGraph, owner: &[u32], part: u32) -> Result<Self> {
        let n = graph.num_nodes();
        if owner.len() != n {
            return Err(RuntimeError::BadData(format!(
                "{} owners for a graph of {n} nodes",
                owner.len()
            )));
        }
        let inner: Vec<u32> = (0..n as u32)
            .filter(|&v| owner[v as usize] == part)
            .collect();
        let mut local = vec![u32::MAX; n];
        for (l, &v) in inner.iter().enumerate() {
            local[v as usize] = l as u32;
        }
        Ok(PartGraph {
            part,
            nbrs: inner.iter().map(|&v| graph.neighbors(v).to_vec()).collect(),
            inner,
            local,
            deg: graph.deg.clone(),
        })
    }

    /// The part this view belongs to.
    pub fn part(&self) -> u32 {
        self.part
    }
    /// The part's nodes, ascending.
    pub fn inner(&self) -> &[u32] {
        &self.inner
    }
    /// Local row of node `v`, if it is one of the part's.
    pub fn local(&self, v: u32) -> Option<u32> {
        // Every node is the part's (one part; `inner` is then `0..n`): the table is the
        // identity, and its read (a cache miss per lookup on a large graph) is skipped.
        if self.inner.len() == self.deg.len() {
            return ((v as usize) < self.deg.len()).then_some(v);
        }
        self.local
            .get(v as usize)
            .copied()
            .filter(|&l| l != u32::MAX)
    }
    /// Local rows of the part's nodes `ids` (an error names the first that is not the part's).
    pub fn locals(&self, ids: &[u32]) -> Result<Vec<u32>> {
        ids.iter()
            .map(|&v| {
                self.local(v).ok_or_else(|| {
                    RuntimeError::BadData(format!("node {v} is not one of part {}'s", self.part))
                })
            })
            .collect()
    }

    /// Adds node `id` (the next id: `id == num_nodes()`), the part's own when `mine`.
    pub fn add_node(&mut self, id: u32, mine: bool) -> Result<()> {
        if id as usize != self.deg.len() {
            return Err(RuntimeError::BadData(format!(
                "new node {id} is not the next id ({})",
                self.deg.len()
            )));
        }
        self.deg.push(0);
        if mine {
            self.local.push(self.inner.len() as u32);
            self.inner.push(id);
            self.nbrs.push(Vec::new());
        } else {
            self.local.push(u32::MAX);
        }
        Ok(())
    }

    fn check(&self, a: u32, b: u32) -> Result<()> {
        let n = self.deg.len();
        if let Some(v) = [a, b].into_iter().find(|&v| v as usize >= n) {
            return Err(RuntimeError::BadData(format!(
                "node {v} does not exist ({n} nodes)"
            )));
        }
        if a == b {
            return Err(RuntimeError::BadData(format!(
                "edge {a}-{b} is a self loop"
            )));
        }
        Ok(())
    }

    /// Adds the edge `a-b` (which the whole graph did not have).
    pub fn add_edge(&mut self, a: u32, b: u32) -> Result<()> {
        self.check(a, b)?;
        for (x, y) in [(a, b), (b, a)] {
            if let Some(l) = self.local(x) {
                let row = &mut self.nbrs[l as usize];
                let pos = row.binary_search(&y).err().ok_or_else(|| {
                    RuntimeError::BadData(format!(
                        "part {}: edge {a}-{b} already exists",
                        self.part
                    ))
                })?;
                row.insert(pos, y);
            }
            self.deg[x as usize] += 1;
        }
        Ok(())
    }

    /// Removes the edge `a-b` (which the whole graph had).
    pub fn remove_edge(&mut self, a: u32, b: u32) -> Result<()> {
        self.check(a, b)?;
        for (x, y) in [(a, b), (b, a)] {
            if let Some(l) = self.local(x) {
                let row = &mut self.nbrs[l as usize];
                let pos = row.binary_search(&y).map_err(|_| {
                    RuntimeError::BadData(format!(
                        "part {}: edge {a}-{b} does not exist",
                        self.part
                    ))
                })?;
                row.remove(pos);
            }
            let d = &mut self.deg[x as usize];
            *d = d
                .checked_sub(1)
                .ok_or_else(|| RuntimeError::BadData(format!("node {x} has no edge to remove")))?;
        }
        Ok(())
    }
}

impl Adjacency for PartGraph {
    fn num_nodes(&self) -> usize {
        self.deg.len()
    }
    fn neighbors(&self, i: u32) -> &[u32] {
        match self.local(i) {
            Some(l) => &self.nbrs[l as usize],
            None => &[],
        }
    }
    fn degree(&self, i: u32) -> usize {
        self.deg[i as usize] as usize
    }
}

/// Where the input rows of a layer's computation are read from.
pub trait RowSource {
    /// Width of every row.
    fn width(&self) -> usize;
    /// The rows of the nodes `ids`, in that order, as one `ids.len() x width` buffer.
    fn gather_rows(&self, ids: &[u32]) -> Result<Vec<f32>>;
}

impl RowSource for Rows {
    fn width(&self) -> usize {
        self.width
    }
    fn gather_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if let Some(&v) = ids.iter().find(|&&v| v as usize >= self.len()) {
            return Err(RuntimeError::BadData(format!(
                "row {v} of a table of {} rows",
                self.len()
            )));
        }
        Ok(self.gather(ids))
    }
}

/// Rows received from other parts (a part's halo rows of one layer), by global id. The
/// global-to-row table has one entry per node and is meant to be reused between steps
/// ([`HaloRows::reuse`], [`HaloRows::into_slots`]): hashing the ids cost more than copying
/// the rows.
#[derive(Debug, Clone, Default)]
pub struct HaloRows {
    pub width: usize,
    /// Global id -> row, `u32::MAX` for none.
    slots: Vec<u32>,
    ids: Vec<u32>,
    data: Vec<f32>,
}

impl HaloRows {
    /// No rows yet, `width` wide.
    pub fn new(width: usize) -> Self {
        HaloRows {
            width,
            ..Default::default()
        }
    }
    /// No rows yet, with the table `slots` of an earlier step (every entry `u32::MAX`, as
    /// [`HaloRows::into_slots`] leaves it).
    pub fn reuse(width: usize, slots: Vec<u32>) -> Self {
        HaloRows {
            width,
            slots,
            ..Default::default()
        }
    }
    /// The table, cleared, for the next step.
    pub fn into_slots(mut self) -> Vec<u32> {
        for &v in &self.ids {
            self.slots[v as usize] = u32::MAX;
        }
        self.slots
    }
    /// Adds the rows of the nodes `ids` (one `width`-wide row each, in order).
    pub fn extend(&mut self, ids: &[u32], rows: &[f32]) -> Result<()> {
        if rows.len() != ids.len() * self.width {
            return Err(RuntimeError::BadData(format!(
                "{} values for {} rows of {}",
                rows.len(),
                ids.len(),
                self.width
            )));
        }
        let base = self.ids.len();
        if let Some(&top) = ids.iter().max() {
            if self.slots.len() <= top as usize {
                self.slots.resize(top as usize + 1, u32::MAX);
            }
        }
        for (k, &v) in ids.iter().enumerate() {
            self.slots[v as usize] = (base + k) as u32;
        }
        self.ids.extend_from_slice(ids);
        self.data.extend_from_slice(rows);
        Ok(())
    }
    /// Row of node `v`, if received.
    pub fn get(&self, v: u32) -> Option<&[f32]> {
        let k = *self.slots.get(v as usize)?;
        (k != u32::MAX).then(|| &self.data[k as usize * self.width..(k as usize + 1) * self.width])
    }
}

/// A part's input rows of one layer: its own rows (its local table, by local row) and the
/// halo rows it received.
pub struct PartInput<'a> {
    pub own: &'a Rows,
    pub graph: &'a PartGraph,
    pub halo: &'a HaloRows,
}

impl RowSource for PartInput<'_> {
    fn width(&self) -> usize {
        self.own.width
    }
    fn gather_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let w = self.own.width;
        if self.halo.width != w && !self.halo.ids.is_empty() {
            return Err(RuntimeError::BadData(format!(
                "halo rows of width {} for a table of width {w}",
                self.halo.width
            )));
        }
        let mut out = Vec::with_capacity(ids.len() * w);
        for (k, &v) in ids.iter().enumerate() {
            if let Some(&next) = ids.get(k + PREFETCH_AHEAD) {
                self.own.prefetch_row(self.graph.local(next).as_ref());
            }
            let row = match self.graph.local(v) {
                Some(l) if (l as usize) < self.own.len() => self.own.row(l),
                Some(l) => {
                    return Err(RuntimeError::BadData(format!(
                        "local row {l} (node {v}) of a table of {} rows",
                        self.own.len()
                    )))
                }
                None => self.halo.get(v).ok_or_else(|| {
                    RuntimeError::BadData(format!(
                        "part {}: no row of node {v} (neither its own nor received)",
                        self.graph.part
                    ))
                })?,
            };
            out.extend_from_slice(row);
        }
        Ok(out)
    }
}

/// How many rows ahead the loops over rows at random places prefetch (enough to hide a
/// memory access behind the copies of the rows between, few enough to stay in L1).
pub const PREFETCH_AHEAD: usize = 2;

/// A row-major table with one row per node.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub width: usize,
    pub data: Vec<f32>,
}

impl Rows {
    /// A table of `n` zero rows.
    pub fn zeros(n: usize, width: usize) -> Self {
        Rows {
            width,
            data: vec![0.0; n * width],
        }
    }
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.width).unwrap_or(0)
    }
    /// True without rows.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Row `i`.
    pub fn row(&self, i: u32) -> &[f32] {
        let w = self.width;
        &self.data[i as usize * w..(i as usize + 1) * w]
    }
    /// The rows `ids`, in that order, as one `ids.len() x width` buffer.
    pub fn gather(&self, ids: &[u32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(ids.len() * self.width);
        for (k, &i) in ids.iter().enumerate() {
            self.prefetch_row(ids.get(k + PREFETCH_AHEAD));
            out.extend_from_slice(self.row(i));
        }
        out
    }
    /// Starts loading row `i` (if any and in the table) into the cache.
    #[inline]
    pub fn prefetch_row(&self, i: Option<&u32>) {
        if let Some(&i) = i {
            let w = self.width;
            if let Some(row) = self.data.get(i as usize * w..(i as usize + 1) * w) {
                crate::host_memory::prefetch(row);
            }
        }
    }
    /// Writes `rows` (one per id) into rows `ids`.
    pub fn scatter(&mut self, ids: &[u32], rows: &[f32]) {
        let w = self.width;
        for (k, &i) in ids.iter().enumerate() {
            self.prefetch_row(ids.get(k + PREFETCH_AHEAD));
            self.data[i as usize * w..(i as usize + 1) * w]
                .copy_from_slice(&rows[k * w..(k + 1) * w]);
        }
    }
    /// Reserves room for `rows` more rows without touching it, so that growing by up to
    /// that many later copies nothing: a table of a graph that grows (a service taking new
    /// nodes) is hundreds of megabytes, and a reallocation copies it into fresh pages
    /// (seconds of page faults on the 1M-node graph's tables).
    pub fn reserve_rows(&mut self, rows: usize) {
        let capacity = self.data.capacity();
        self.data.reserve_exact(rows * self.width);
        self.moved_from(capacity);
    }
    /// Appends zero rows up to `n` rows.
    pub fn grow(&mut self, n: usize) {
        if n > self.len() {
            let capacity = self.data.capacity();
            self.data.resize(n * self.width, 0.0);
            self.moved_from(capacity);
        }
    }
    /// Asks for transparent huge pages under a large table (a hint: see
    /// [`crate::host_memory`]); tables that grow keep asking when their buffer moves.
    pub fn prefer_huge_pages(&self) {
        crate::host_memory::prefer_huge_pages(&self.data, self.data.capacity());
    }
    /// After the buffer may have moved (its capacity was `capacity`): asks again.
    fn moved_from(&self, capacity: usize) {
        if self.data.capacity() != capacity {
            self.prefer_huge_pages();
        }
    }
}

/// Every layer's output, one row per node (the last layer's rows are the logits).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerOutputs {
    pub layers: Vec<Rows>,
    /// For split layers (narrowing GCN layers after the first, [`Model::reads_transformed_only`]): their
    /// transformed input rows `Z = H W`, one per node. An update re-transforms only the rows
    /// whose input changed, and aggregates the changed region from this table instead of
    /// transforming every input row of its block again.
    pub transformed: Vec<Option<Rows>>,
}

impl LayerOutputs {
    /// The logits (last layer's rows).
    pub fn logits(&self) -> &Rows {
        self.layers.last().expect("a model has at least one layer")
    }
}

/// How many rows one incremental update recomputed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpdateStats {
    /// Rows recomputed per layer (`D_l`).
    pub rows_per_layer: Vec<usize>,
    /// Rows recomputed per part, summed over layers.
    pub rows_per_part: Vec<usize>,
    /// The last layer's recomputed rows (ascending): the only logits that can have changed.
    pub last_rows: Vec<u32>,
}

/// A model ready for layer-wise inference on one stream.
pub struct Inference {
    model: Model,
    stream: Stream,
    normalize: bool,
    /// Layer 0's input layout, fixed by the first full run's features.
    sparse_input: Option<bool>,
    /// The global-to-local table every block is built with.
    ids: LocalIds,
}

impl std::fmt::Debug for Inference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inference")
            .field("model", &self.model)
            .field("normalize", &self.normalize)
            .finish()
    }
}

/// Evaluation mode (dropout off).
const EVAL: StepCtx = StepCtx {
    epoch: 0,
    train: false,
};

impl Inference {
    /// `model` (built on the host) placed on `stream`; `normalize` row-normalises raw
    /// features as training did.
    pub fn new(mut model: Model, stream: Stream, normalize: bool) -> Result<Self> {
        model.place(&stream)?;
        Ok(Inference {
            model,
            stream,
            normalize,
            sparse_input: None,
            ids: LocalIds::default(),
        })
    }

    /// The stream its kernels run on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Raw features (`n x in_dim`) as the first layer takes them.
    pub fn prepare_features(&self, raw: Vec<f32>) -> Result<Rows> {
        prepare_features(raw, self.model.config().in_dim, self.normalize)
    }

    /// Width of layer `l`'s output.
    pub fn layer_width(&self, l: usize) -> usize {
        if l + 1 < self.model.num_layers() {
            self.model.layer_in_dim(l + 1)
        } else {
            self.model.config().out_dim
        }
    }

    /// Runs every layer over every node, part by part: `parts` lists each part's nodes
    /// (ascending); together they cover the graph once.
    pub fn run(
        &mut self,
        graph: &NodeGraph,
        features: &Rows,
        parts: &[Vec<u32>],
    ) -> Result<LayerOutputs> {
        let n = graph.num_nodes();
        if features.len() != n || features.width != self.model.config().in_dim {
            return Err(RuntimeError::BadData(format!(
                "{} feature rows of width {} for a graph of {n} nodes and a model taking {}",
                features.len(),
                features.width,
                self.model.config().in_dim
            )));
        }
        if parts.iter().map(Vec::len).sum::<usize>() != n {
            return Err(RuntimeError::BadData(format!(
                "the parts hold {} nodes, the graph {n}",
                parts.iter().map(Vec::len).sum::<usize>()
            )));
        }
        self.sparse_input = Some(LayerInput::would_be_sparse(&features.data));
        let layers_n = self.model.num_layers();
        let mut out = LayerOutputs {
            layers: Vec::with_capacity(layers_n),
            transformed: vec![None; layers_n],
        };
        for l in 0..layers_n {
            let mut rows = Rows::zeros(n, self.layer_width(l));
            if self.model.reads_transformed_only(l) {
                let mut z = Rows::zeros(n, self.layer_width(l));
                for inner in parts {
                    let zr = self.transform_rows(l, graph, inner, &out.layers[l - 1])?;
                    z.scatter(inner, &zr);
                }
                out.transformed[l] = Some(z);
            }
            for inner in parts {
                let source = match &out.transformed[l] {
                    Some(z) => z,
                    None if l == 0 => features,
                    None => &out.layers[l - 1],
                };
                let r = self.compute_rows(l, graph, inner, source)?;
                rows.scatter(inner, &r);
            }
            out.layers.push(rows);
        }
        Ok(out)
    }

    /// Layer `l`'s transformed rows `Z = H W` of the nodes `inner` from `input` (the
    /// previous layer's rows, the features for layer 0): a split layer's, or layer 0's when
    /// it takes increments ([`Model::takes_increments`]).
    pub fn transform_rows<G: Adjacency + ?Sized>(
        &mut self,
        l: usize,
        graph: &G,
        inner: &[u32],
        input: &dyn RowSource,
    ) -> Result<Vec<f32>> {
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        let rows = input.gather_rows(inner)?;
        self.transform_given_rows(l, graph, inner, rows)
    }

    /// [`Inference::transform_rows`] of input rows the caller holds already: `rows` are the
    /// input rows of `inner`, in that order.
    pub fn transform_given_rows<G: Adjacency + ?Sized>(
        &mut self,
        l: usize,
        graph: &G,
        inner: &[u32],
        rows: Vec<f32>,
    ) -> Result<Vec<f32>> {
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        let width = rows.len() / inner.len();
        // The transform reads only the inner rows: a block without edges.
        let degrees: Vec<u32> = inner.iter().map(|&g| graph.degree(g) as u32).collect();
        let indptr = vec![0usize; inner.len() + 1];
        let block = Block::from_local(
            inner.len(),
            inner.to_vec(),
            &indptr,
            &[],
            &degrees,
            self.model.config().kind.aggregation(),
        )?;
        let x = Tensor::from_vec(inner.len(), width, rows)?;
        let x = self.stream.place(x)?;
        let z = if l == 0 && !self.model.reads_transformed_only(0) {
            self.model.transform_first(&self.stream, &block, x)?
        } else {
            self.model
                .forward_transform(&self.stream, l, &block, x, EVAL)?
        };
        Ok(self.stream.download_owned(z)?)
    }

    /// The block of the nodes `inner` (ascending) over the current graph.
    fn block<G: Adjacency + ?Sized>(&mut self, graph: &G, inner: &[u32]) -> Result<Block> {
        let agg = self.model.config().kind.aggregation();
        build_block(graph, inner, agg, &mut self.ids, false)
    }

    /// Layer `l`'s output rows of the nodes `inner` (ascending). `source` holds the rows the
    /// layer reads: for a split layer ([`Model::reads_transformed_only`]) the transformed rows `Z` of
    /// [`Inference::transform_rows`], else layer `l-1`'s rows (the features for `l = 0`).
    pub fn compute_rows<G: Adjacency + ?Sized>(
        &mut self,
        l: usize,
        graph: &G,
        inner: &[u32],
        source: &dyn RowSource,
    ) -> Result<Vec<f32>> {
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        let (block, x) = self.block_input(graph, inner, source)?;
        if self.model.reads_transformed_only(l) {
            let zt = self.stream.place(x)?;
            let y = self
                .model
                .forward_aggregate(&self.stream, l, &block, &zt, EVAL)?;
            return Ok(self.stream.download_owned(y)?);
        }
        let x = self.layer_input(l, x)?;
        let out = self
            .model
            .forward_layer(&self.stream, l, &block, Cow::Owned(x), EVAL)?;
        Ok(self.stream.download_owned(out)?)
    }

    /// The block of the nodes `inner` and its input rows from `source`.
    fn block_input<G: Adjacency + ?Sized>(
        &mut self,
        graph: &G,
        inner: &[u32],
        source: &dyn RowSource,
    ) -> Result<(Block, Tensor)> {
        let block = self.block(graph, inner)?;
        let x = Tensor::from_vec(
            block.n_in(),
            source.width(),
            source.gather_rows(block.gids())?,
        )?;
        Ok((block, x))
    }

    /// Layer `l`'s input rows `x` placed on the stream (layer 0's in its input layout).
    fn layer_input(&self, l: usize, x: Tensor) -> Result<LayerInput> {
        Ok(if l == 0 {
            let sparse = self.sparse_input.unwrap_or(false);
            LayerInput::with_layout(&self.stream, x, sparse)?
        } else {
            LayerInput::Dense(self.stream.place(x)?)
        })
    }

    /// Layer `l`'s pre-activation rows of the nodes `inner` (ascending), for a layer that
    /// takes increments ([`Model::takes_increments`]); `source` as for
    /// [`Inference::compute_rows`], whose rows [`Inference::activate_rows`] of these are,
    /// bit for bit.
    pub fn compute_pre_activation_rows<G: Adjacency + ?Sized>(
        &mut self,
        l: usize,
        graph: &G,
        inner: &[u32],
        source: &dyn RowSource,
    ) -> Result<Vec<f32>> {
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        let (block, x) = self.block_input(graph, inner, source)?;
        let s = &self.stream;
        let p = if self.model.reads_transformed_only(l) {
            let z = s.place(x)?;
            self.model
                .forward_pre_activation(s, l, &block, PreActivationInput::Transformed(&z))?
        } else {
            let x = self.layer_input(l, x)?;
            self.model
                .forward_pre_activation(s, l, &block, PreActivationInput::Input(&x))?
        };
        Ok(s.download_owned(p)?)
    }

    /// Layer `l`'s activation of the rows `pre` (rows of the layer's width).
    pub fn activate_rows(&self, l: usize, pre: Vec<f32>) -> Result<Vec<f32>> {
        let width = self.layer_width(l);
        if width == 0 || !pre.len().is_multiple_of(width) {
            return Err(RuntimeError::BadData(format!(
                "{} values are not rows of layer {l}'s width {width}",
                pre.len()
            )));
        }
        let mut t = self
            .stream
            .place(Tensor::from_vec(pre.len() / width, width, pre)?)?;
        self.model.activate(&self.stream, l, &mut t)?;
        Ok(self.stream.download_owned(t)?)
    }

    /// Layer 0's input layout (sparse or dense), fixed by the whole feature matrix.
    pub fn sparse_input(&self) -> Option<bool> {
        self.sparse_input
    }

    /// Fixes layer 0's input layout (a part computing rows of a graph whose whole feature
    /// matrix decided it), so every part computes the bits the whole graph does.
    pub fn set_sparse_input(&mut self, sparse: bool) {
        self.sparse_input = Some(sparse);
    }

    /// After the graph or the features changed at the nodes `changed` (new nodes, endpoints
    /// of added or removed edges), recomputes the rows this reaches, each part its own:
    /// `owner[v]` is node `v`'s part (`< parts`). `outputs` grows to the graph's node count.
    pub fn update(
        &mut self,
        graph: &NodeGraph,
        features: &Rows,
        outputs: &mut LayerOutputs,
        changed: &[u32],
        owner: &[u32],
        parts: usize,
    ) -> Result<UpdateStats> {
        let n = graph.num_nodes();
        if features.len() != n || owner.len() != n {
            return Err(RuntimeError::BadData(format!(
                "{} feature rows and {} owners for {n} nodes",
                features.len(),
                owner.len()
            )));
        }
        let mut stats = UpdateStats {
            rows_per_layer: Vec::new(),
            rows_per_part: vec![0; parts],
            last_rows: Vec::new(),
        };
        let mut set: Vec<u32> = changed.to_vec();
        set.sort_unstable();
        set.dedup();
        for l in 0..self.model.num_layers() {
            // Rows whose input changed (the previous layer's changed rows) are re-transformed.
            if let Some(mut z) = outputs.transformed[l].take() {
                z.grow(n);
                for inner in split_by_owner(&set, owner, parts) {
                    let zr = self.transform_rows(l, graph, &inner, &outputs.layers[l - 1])?;
                    z.scatter(&inner, &zr);
                }
                outputs.transformed[l] = Some(z);
            }
            set = graph.expand(&set);
            stats.rows_per_layer.push(set.len());
            outputs.layers[l].grow(n);
            for (p, inner) in split_by_owner(&set, owner, parts).iter().enumerate() {
                let rows = {
                    let source = match &outputs.transformed[l] {
                        Some(z) => z,
                        None if l == 0 => features,
                        None => &outputs.layers[l - 1],
                    };
                    self.compute_rows(l, graph, inner, source)?
                };
                outputs.layers[l].scatter(inner, &rows);
                stats.rows_per_part[p] += inner.len();
            }
        }
        stats.last_rows = set;
        Ok(stats)
    }
}

/// Raw features (rows of `width`) as a model's first layer takes them: checked to be finite,
/// row-normalised when `normalize` (as training did).
pub fn prepare_features(mut raw: Vec<f32>, width: usize, normalize: bool) -> Result<Rows> {
    if width == 0 || !raw.len().is_multiple_of(width) {
        return Err(RuntimeError::BadData(format!(
            "{} feature values are not rows of {width}",
            raw.len()
        )));
    }
    if raw.iter().any(|x| !x.is_finite()) {
        return Err(RuntimeError::BadData(
            "features contain NaN or infinity".into(),
        ));
    }
    if normalize {
        normalize_rows(&mut raw, width);
    }
    Ok(Rows { width, data: raw })
}

/// The nodes of `set` (ascending) grouped by part, each group ascending.
fn split_by_owner(set: &[u32], owner: &[u32], parts: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); parts];
    for &v in set {
        out[owner[v as usize] as usize].push(v);
    }
    out
}

/// Each part's nodes (ascending) from a node-to-part assignment.
pub fn parts_of(owner: &[u32], parts: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); parts];
    for (v, &p) in owner.iter().enumerate() {
        out[p as usize].push(v as u32);
    }
    out
}

/// Row `v` of a GCN layer with no activation from its transformed rows `z` (`Z = H W`, every
/// node's) and bias: `b + Σ_u Z_u / sqrt((d_u + 1)(d_v + 1))` over `u ∈ N(v) ∪ {v}`, the
/// weights of the layer's block ([`crate::graph::Block`]), summed in ascending `u` as the
/// block's rows are. Serving reads the last layer this way
/// ([`crate::Model::last_layer_reads_transformed`]).
pub fn aggregate_gcn_row<G: Adjacency + ?Sized>(
    graph: &G,
    z: &Rows,
    bias: &[f32],
    v: u32,
    out: &mut [f32],
) {
    let w = z.width;
    out[..w].fill(0.0);
    let dv = graph.degree(v) as f32 + 1.0;
    let nbrs = graph.neighbors(v);
    // The node itself sits among its (ascending) neighbours.
    let at = nbrs.partition_point(|&u| u < v);
    let before = nbrs[..at].iter().copied();
    let after = nbrs[at..].iter().copied();
    for u in before.chain(std::iter::once(v)).chain(after) {
        let a = 1.0 / (dv * (graph.degree(u) as f32 + 1.0)).sqrt();
        out[..w]
            .iter_mut()
            .zip(z.row(u))
            .for_each(|(y, &x)| *y += a * x);
    }
    out[..w].iter_mut().zip(bias).for_each(|(y, &b)| *y += b);
}

/// Softmax of each row of `logits` (numerically stable).
pub fn softmax_row(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// Index of the largest value (the first on ties).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DataSource, ModelConfig, ModelKind};

    /// The 2-layer paper model, and a 4-layer residual one (an identity residual, a
    /// projected one, then a split GCN layer).
    fn configs(kind: ModelKind) -> [ModelConfig; 2] {
        let mut cfg = ModelConfig::paper_defaults(kind, 12, 4, 5);
        cfg.hidden = 8;
        cfg.heads = 2;
        let mut deep = cfg.clone();
        deep.layers = 4;
        deep.hidden_sizes = vec![8, 8, 6];
        deep.residual = true;
        [cfg, deep]
    }

    fn setup(cfg: ModelConfig) -> (Inference, NodeGraph, Rows, Vec<u32>) {
        let ds = DataSource::parse("synthetic:nodes=600,degree=6,features=12,classes=4,seed=3")
            .unwrap()
            .load()
            .unwrap();
        let g = NodeGraph::from_graph(&Graph::from_dataset(&ds).unwrap());
        let inf = Inference::new(Model::new(cfg).unwrap(), Stream::cpu(0).unwrap(), true).unwrap();
        let x = inf.prepare_features(ds.features.clone()).unwrap();
        let owner: Vec<u32> = (0..600u32).map(|v| (v * 7 % 3) % 3).collect();
        (inf, g, x, owner)
    }

    #[test]
    fn parts_give_the_same_bits_as_one() {
        for kind in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat] {
            for cfg in configs(kind) {
                let layers = cfg.layers;
                let (mut inf, g, x, owner) = setup(cfg);
                let one = inf.run(&g, &x, &[(0..600).collect::<Vec<u32>>()]).unwrap();
                let three = inf.run(&g, &x, &parts_of(&owner, 3)).unwrap();
                assert_eq!(one, three, "{kind} {layers} layers");
            }
        }
    }

    #[test]
    fn updates_touch_only_the_k_hop_region_and_match_a_full_run() {
        for cfg in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat]
            .into_iter()
            .flat_map(configs)
        {
            let (kind, layers) = (cfg.kind, cfg.layers);
            let (mut inf, mut g, x, mut owner) = setup(cfg);
            let mut out = inf.run(&g, &x, &parts_of(&owner, 3)).unwrap();
            let mut x = x;
            g.add_edge(1, 500).unwrap();
            let cut = g.neighbors(0)[0];
            g.remove_edge(0, cut).unwrap();
            let v = g.add_node();
            g.add_edge(v, 7).unwrap();
            x.data
                .extend(inf.prepare_features(vec![0.5; 12]).unwrap().data);
            owner.push(1);
            let changed = [1, 500, 0, cut, v, 7];
            let stats = inf.update(&g, &x, &mut out, &changed, &owner, 3).unwrap();
            assert!(
                stats.rows_per_layer.iter().take(2).all(|&r| r < 300),
                "{stats:?}"
            );
            let fresh = inf.run(&g, &x, &parts_of(&owner, 3)).unwrap();
            assert_eq!(out, fresh, "{kind} {layers} layers");
        }
    }

    #[test]
    fn pre_activation_rows_are_linear_in_scaled_transformed_rows_and_activate_to_the_layer() {
        let mut cfg = ModelConfig::paper_defaults(ModelKind::Gcn, 12, 4, 5);
        cfg.hidden = 8;
        let (mut inf, g, x, _) = setup(cfg);
        assert!(inf.model().takes_increments(0) && inf.model().keeps_pre_activation(0));
        assert!(inf.model().takes_increments(1) && !inf.model().keeps_pre_activation(1));
        let all: Vec<u32> = (0..600).collect();
        let out = inf.run(&g, &x, std::slice::from_ref(&all)).unwrap();
        let rows: Vec<u32> = vec![0, 5, 77, 599];
        for l in 0..2 {
            let source = match &out.transformed[l] {
                Some(z) => z,
                None if l == 0 => &x,
                None => &out.layers[l - 1],
            };
            let pre = inf
                .compute_pre_activation_rows(l, &g, &rows, source)
                .unwrap();
            let y = inf.activate_rows(l, pre.clone()).unwrap();
            assert_eq!(
                y,
                inf.compute_rows(l, &g, &rows, source).unwrap(),
                "layer {l}"
            );
            assert_eq!(y, out.layers[l].gather(&rows), "layer {l}");
            // p_v - b = Σ_u Z_u / sqrt((d_u + 1)(d_v + 1)), Z from `transform_rows`.
            let input = if l == 0 { &x } else { &out.layers[0] };
            let z = inf.transform_rows(l, &g, &all, input).unwrap();
            let w = inf.layer_width(l);
            let s = |v: u32| 1.0 / (g.degree(v) as f32 + 1.0).sqrt();
            for (k, &v) in rows.iter().enumerate() {
                let mut sum = vec![0f32; w];
                for u in std::iter::once(v).chain(g.neighbors(v).iter().copied()) {
                    for (c, acc) in sum.iter_mut().enumerate() {
                        *acc += z[u as usize * w + c] * s(u) * s(v);
                    }
                }
                let b = inf.model().params()[1 + 2 * l].value.host("test").unwrap();
                for c in 0..w {
                    let want = sum[c] + b[c];
                    let got = pre[k * w + c];
                    assert!(
                        (want - got).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{l} {v} {c}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_missing_nodes_and_self_loops() {
        let mut g = NodeGraph::default();
        g.add_node();
        g.add_node();
        assert!(g.add_edge(0, 2).unwrap_err().to_string().contains("node 2"));
        assert!(g.add_edge(1, 1).is_err());
        assert!(g.add_edge(0, 1).unwrap());
        assert!(!g.add_edge(1, 0).unwrap());
        assert_eq!(g.num_edges(), 1);
        assert!(g.remove_edge(0, 1).unwrap());
        assert!(!g.remove_edge(0, 1).unwrap());
    }
}
