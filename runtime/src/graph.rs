//! Graphs: the global symmetrised adjacency ([`Graph`]) and the per-worker aggregation
//! structure ([`Block`]) that layers run over.
use crate::{Dataset, Result, RuntimeError};
use rayon::prelude::*;
use std::sync::OnceLock;
use trellis_gpu::Csr;

/// The global graph: row `i` lists the neighbours of node `i` in ascending id, symmetrised,
/// without self loops or duplicates.
#[derive(Debug, Clone)]
pub struct Graph {
    adj: Csr,
}

impl Graph {
    /// Symmetrises the data set's edge list, drops self loops and duplicate edges.
    pub fn from_dataset(ds: &Dataset) -> Result<Self> {
        Self::from_edges(ds.num_nodes, &ds.edge_src, &ds.edge_dst)
    }

    /// Builds the graph from directed edges `src[i] -> dst[i]` over `n` nodes.
    pub fn from_edges(n: usize, src: &[u32], dst: &[u32]) -> Result<Self> {
        if src.len() != dst.len() {
            return Err(RuntimeError::BadData("edge lists differ in length".into()));
        }
        if let Some(&v) = src.iter().chain(dst).find(|&&v| v as usize >= n) {
            return Err(RuntimeError::BadData(format!(
                "edge endpoint {v} out of range for {n} nodes"
            )));
        }
        // Counting sort of both directions by row, then sort + dedupe each row in parallel.
        let mut counts = vec![0usize; n + 1];
        for (&s, &d) in src.iter().zip(dst) {
            if s != d {
                counts[s as usize + 1] += 1;
                counts[d as usize + 1] += 1;
            }
        }
        for i in 0..n {
            counts[i + 1] += counts[i];
        }
        let mut fill = counts.clone();
        let mut raw = vec![0u32; counts[n]];
        for (&s, &d) in src.iter().zip(dst) {
            if s != d {
                raw[fill[d as usize]] = s;
                fill[d as usize] += 1;
                raw[fill[s as usize]] = d;
                fill[s as usize] += 1;
            }
        }
        drop(fill);
        let mut segs = split_segments(&mut raw, &counts);
        let lens: Vec<usize> = segs
            .par_iter_mut()
            .map(|seg| {
                seg.sort_unstable();
                let mut w = 0;
                for r in 0..seg.len() {
                    if r == 0 || seg[r] != seg[w - 1] {
                        seg[w] = seg[r];
                        w += 1;
                    }
                }
                w
            })
            .collect();
        drop(segs);
        let mut indptr = vec![0usize; n + 1];
        let mut indices = Vec::with_capacity(lens.iter().sum());
        for i in 0..n {
            indices.extend_from_slice(&raw[counts[i]..counts[i] + lens[i]]);
            indptr[i + 1] = indices.len();
        }
        Ok(Graph {
            adj: Csr::new(n, n, indptr, indices, None)?,
        })
    }

    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.adj.n_rows()
    }
    /// Number of directed entries (twice the undirected edge count).
    pub fn num_entries(&self) -> usize {
        self.adj.nnz()
    }
    /// Neighbours of node `i`, ascending.
    pub fn neighbors(&self, i: usize) -> &[u32] {
        self.adj.row(i)
    }
    /// Degree of node `i` (without self loop).
    pub fn degree(&self, i: usize) -> usize {
        self.adj.degree(i)
    }
    /// The adjacency matrix.
    pub fn adjacency(&self) -> &Csr {
        &self.adj
    }
}

/// How a layer aggregates neighbour rows; decides the block's entries and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregation {
    /// GCN: entries `N(i) + {i}`, weights `1 / sqrt((d_i + 1)(d_j + 1))` with global degrees.
    GcnNorm,
    /// GraphSAGE mean: entries `N(i)`, weights `1 / d_i` (isolated nodes aggregate to zero).
    Mean,
    /// GAT: entries `N(i) + {i}`, weights computed per step by attention.
    Attention,
}

/// The aggregation structure of one worker: its output (inner) rows and its input rows.
///
/// Input rows are the inner nodes (`gids[..n_out]`, the same order as output rows) followed by
/// halo nodes (`gids[n_out..]`). Each row's entries come in ascending global id, so sums run in
/// the same order whether the graph is split or not.
#[derive(Debug, Clone)]
pub struct Block {
    n_out: usize,
    gids: Vec<u32>,
    adj: Csr,
    /// Transposed matrix (unless `symmetric`) and the entry permutation, built on first use.
    adj_t: OnceLock<(Option<Csr>, Vec<u32>)>,
    /// `adj` split by column into the entries over inner and over halo input rows, and
    /// `adj_t` split by row the same way; built on first use (overlapped halo exchange).
    adj_split: OnceLock<(Csr, Csr)>,
    adj_t_split: OnceLock<(Csr, Csr)>,
    /// The matrix equals its transpose (a whole graph with symmetric weights): backward passes
    /// reuse it instead of holding a second copy.
    symmetric: bool,
    agg: Aggregation,
}

impl Block {
    /// The block of a single worker that owns the whole graph.
    pub fn full(graph: &Graph, agg: Aggregation) -> Result<Self> {
        let all: Vec<u32> = (0..graph.num_nodes() as u32).collect();
        Self::build(graph, &all, agg)
    }

    /// The block whose inner nodes are `inner` (distinct global ids, ascending); halo nodes are
    /// every neighbour outside `inner`, ascending.
    pub fn build(graph: &Graph, inner: &[u32], agg: Aggregation) -> Result<Self> {
        let n = graph.num_nodes();
        let mut local = vec![u32::MAX; n];
        for (l, &g) in inner.iter().enumerate() {
            if g as usize >= n || local[g as usize] != u32::MAX {
                return Err(RuntimeError::BadData(format!(
                    "inner node {g} out of range or repeated"
                )));
            }
            local[g as usize] = l as u32;
        }
        let mut halo: Vec<u32> = inner
            .iter()
            .flat_map(|&g| graph.neighbors(g as usize))
            .copied()
            .filter(|&j| local[j as usize] == u32::MAX)
            .collect();
        halo.par_sort_unstable();
        halo.dedup();
        for (k, &g) in halo.iter().enumerate() {
            local[g as usize] = (inner.len() + k) as u32;
        }
        let mut gids = inner.to_vec();
        gids.extend_from_slice(&halo);
        let mut indptr = vec![0usize; inner.len() + 1];
        for (r, &g) in inner.iter().enumerate() {
            indptr[r + 1] = indptr[r] + graph.degree(g as usize);
        }
        let mut indices = vec![0u32; indptr[inner.len()]];
        split_segments(&mut indices, &indptr)
            .into_par_iter()
            .enumerate()
            .for_each(|(r, seg)| {
                for (o, &j) in seg.iter_mut().zip(graph.neighbors(inner[r] as usize)) {
                    *o = local[j as usize];
                }
            });
        let degrees: Vec<u32> = gids
            .iter()
            .map(|&g| graph.degree(g as usize) as u32)
            .collect();
        Self::from_local(inner.len(), gids, &indptr, &indices, &degrees, agg)
    }

    /// Builds a block from a worker's local adjacency (what a partition file stores).
    ///
    /// `gids` are the global ids of the input rows, the first `n_out` being the inner nodes;
    /// row `r` of (`indptr`, `indices`) lists the local ids of inner node `r`'s neighbours (no
    /// self loop) in ascending global id; `degrees[k]` is the global degree of input row `k`.
    pub fn from_local(
        n_out: usize,
        gids: Vec<u32>,
        indptr: &[usize],
        indices: &[u32],
        degrees: &[u32],
        agg: Aggregation,
    ) -> Result<Self> {
        let n_in = gids.len();
        let bad = |m: String| Err(RuntimeError::BadData(m));
        if n_out > n_in
            || indptr.len() != n_out + 1
            || degrees.len() != n_in
            || indptr[n_out] != indices.len()
        {
            return bad(format!(
                "local adjacency does not fit {n_out} inner of {n_in} input rows"
            ));
        }
        if indices.iter().any(|&j| j as usize >= n_in) || indptr.windows(2).any(|w| w[0] > w[1]) {
            return bad("local adjacency has an index out of range".into());
        }
        let self_loop = agg != Aggregation::Mean;
        let mut out_ptr = vec![0usize; n_out + 1];
        for r in 0..n_out {
            out_ptr[r + 1] = out_ptr[r] + indptr[r + 1] - indptr[r] + self_loop as usize;
        }
        let nnz = out_ptr[n_out];
        let mut out_idx = vec![0u32; nnz];
        let mut values = vec![0f32; nnz];
        let isegs = split_segments(&mut out_idx, &out_ptr);
        let vsegs = split_segments(&mut values, &out_ptr);
        isegs
            .into_par_iter()
            .zip(vsegs)
            .enumerate()
            .for_each(|(r, (iseg, vseg))| {
                let g = gids[r];
                let di = degrees[r] as f32;
                let mut k = 0;
                let mut push = |j: u32| {
                    iseg[k] = j;
                    vseg[k] = match agg {
                        Aggregation::GcnNorm => {
                            1.0 / ((di + 1.0) * (degrees[j as usize] as f32 + 1.0)).sqrt()
                        }
                        Aggregation::Mean => 1.0 / di,
                        Aggregation::Attention => 1.0,
                    };
                    k += 1;
                };
                let mut self_done = !self_loop;
                for &j in &indices[indptr[r]..indptr[r + 1]] {
                    if !self_done && gids[j as usize] > g {
                        push(r as u32);
                        self_done = true;
                    }
                    push(j);
                }
                if !self_done {
                    push(r as u32);
                }
            });
        let adj = Csr::new(n_out, n_in, out_ptr, out_idx, Some(values))?;
        // Without halo rows the structure is the symmetrised graph; GCN and attention weights are
        // symmetric too (GCN's 1/sqrt(d_i d_j) commutes), the mean's 1/d_i is not.
        let symmetric = n_out == n_in && agg != Aggregation::Mean;
        Ok(Block {
            n_out,
            gids,
            adj,
            adj_t: OnceLock::new(),
            adj_split: OnceLock::new(),
            adj_t_split: OnceLock::new(),
            symmetric,
            agg,
        })
    }

    /// Number of output (inner) rows.
    pub fn n_out(&self) -> usize {
        self.n_out
    }
    /// Number of input rows (inner + halo).
    pub fn n_in(&self) -> usize {
        self.gids.len()
    }
    /// Global ids of the input rows (inner first, then halo).
    pub fn gids(&self) -> &[u32] {
        &self.gids
    }
    /// Global ids of the output rows.
    pub fn inner_gids(&self) -> &[u32] {
        &self.gids[..self.n_out]
    }
    /// Global ids of the halo rows.
    pub fn halo_gids(&self) -> &[u32] {
        &self.gids[self.n_out..]
    }
    /// `n_out x n_in` aggregation matrix (values per [`Aggregation`]).
    pub fn adj(&self) -> &Csr {
        &self.adj
    }
    /// Its transpose, for backward passes (the matrix itself when symmetric).
    pub fn adj_t(&self) -> &Csr {
        if self.symmetric {
            return &self.adj;
        }
        let (t, _) = self.transpose_parts();
        t.as_ref().unwrap_or(&self.adj)
    }

    /// [`Block::adj`] split by column: `(A_inner, A_halo)` with `A x = A_inner x[..n_out] +
    /// A_halo x[n_out..]` (halo columns renumbered from 0).
    pub fn adj_split(&self) -> Result<&(Csr, Csr)> {
        if let Some(parts) = self.adj_split.get() {
            return Ok(parts);
        }
        let parts = self.adj.split_columns(self.n_out)?;
        Ok(self.adj_split.get_or_init(|| parts))
    }

    /// [`Block::adj_t`] split by row: `(rows of the inner inputs, rows of the halo inputs)`;
    /// products over the two parts give the same bits, row for row, as over the whole.
    pub fn adj_t_split(&self) -> &(Csr, Csr) {
        self.adj_t_split.get_or_init(|| {
            let t = self.adj_t();
            (
                t.row_range(0, self.n_out),
                t.row_range(self.n_out, t.n_rows()),
            )
        })
    }

    /// For each entry of [`Block::adj_t`], the index of the same entry in [`Block::adj`].
    pub fn adj_t_perm(&self) -> &[u32] {
        &self.transpose_parts().1
    }

    fn transpose_parts(&self) -> &(Option<Csr>, Vec<u32>) {
        self.adj_t.get_or_init(|| {
            let t = self.adj.transpose();
            (if self.symmetric { None } else { Some(t.csr) }, t.perm)
        })
    }
    /// The aggregation this block was built for.
    pub fn aggregation(&self) -> Aggregation {
        self.agg
    }
}

/// Splits `data` into the consecutive segments `data[ptr[i]..ptr[i+1]]`.
fn split_segments<'a, T>(data: &'a mut [T], ptr: &[usize]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(ptr.len().saturating_sub(1));
    let mut rest = data;
    for w in ptr.windows(2) {
        let (s, r) = rest.split_at_mut(w[1] - w[0]);
        out.push(s);
        rest = r;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path4() -> Graph {
        // 0-1, 1-2, 2-3 given in one direction, plus a duplicate and a self loop.
        Graph::from_edges(4, &[0, 1, 2, 1, 3], &[1, 2, 3, 0, 3]).unwrap()
    }

    #[test]
    fn symmetrises_and_dedupes() {
        let g = path4();
        assert_eq!(g.neighbors(0), &[1]);
        assert_eq!(g.neighbors(1), &[0, 2]);
        assert_eq!(g.neighbors(3), &[2]);
        assert_eq!(g.num_entries(), 6);
    }

    #[test]
    fn gcn_block_has_self_loops_and_norm() {
        let g = path4();
        let b = Block::full(&g, Aggregation::GcnNorm).unwrap();
        assert_eq!(b.adj().row(1), &[0, 1, 2]);
        let v = b.adj().values().unwrap();
        // entry (1, 0): 1/sqrt(3 * 2)
        assert!((v[b.adj().indptr()[1]] - 1.0 / 6f32.sqrt()).abs() < 1e-7);
    }

    #[test]
    fn partial_block_orders_halo_and_maps_ids() {
        let g = path4();
        let b = Block::build(&g, &[2, 3], Aggregation::Mean).unwrap();
        assert_eq!(b.gids(), &[2, 3, 1]);
        assert_eq!(b.adj().row(0), &[2, 1]); // neighbours 1 (halo, local 2) and 3 (local 1)
        assert_eq!(b.adj().values().unwrap()[0], 0.5);
    }
}
