//! Node-to-part assignment: METIS k-way with multi-constraint balance, or seeded random.
use super::PartitionMethod;
use crate::{Dataset, Graph, Result, RuntimeError};
use rayon::prelude::*;
use std::sync::Mutex;
use trellis_gpu::Philox4x32;

/// METIS (through GKlib) keeps its random state in process-wide statics, so concurrent calls
/// would perturb each other; holding this lock keeps every call deterministic.
static METIS_LOCK: Mutex<()> = Mutex::new(());

/// Philox counter word that separates partition draws from other streams keyed by the seed.
const RANDOM_STREAM: u32 = 0x7061_7274; // "part"

/// The part (`< parts`) of every node of `graph`.
///
/// METIS balances three constraints per part, as DistDGL's `balance_ntypes` and
/// `balance_edges` do: node count, degree sum (edges) and training nodes (a constraint whose
/// total is zero is dropped). Both methods are deterministic in (`graph`, `ds`, `parts`, `seed`).
pub fn assign(
    graph: &Graph,
    ds: &Dataset,
    parts: usize,
    method: PartitionMethod,
    seed: u64,
) -> Result<Vec<u32>> {
    let n = graph.num_nodes();
    if ds.num_nodes != n || ds.train_mask.len() != n {
        return Err(RuntimeError::BadData(format!(
            "graph has {n} nodes, data set {}",
            ds.num_nodes
        )));
    }
    if parts == 0 || parts > u32::MAX as usize {
        return Err(RuntimeError::Config(format!(
            "cannot split a graph into {parts} parts"
        )));
    }
    if parts > n {
        return Err(RuntimeError::Config(format!(
            "cannot split {n} nodes into {parts} parts"
        )));
    }
    if parts == 1 {
        return Ok(vec![0; n]);
    }
    match method {
        PartitionMethod::Random => Ok(random(n, parts, seed)),
        PartitionMethod::Metis => metis(graph, ds, parts, seed),
    }
}

fn random(n: usize, parts: usize, seed: u64) -> Vec<u32> {
    let rng = Philox4x32::new(seed);
    (0..n)
        .into_par_iter()
        .map(|i| {
            let r = rng.block([i as u32, (i >> 32) as u32, 0, RANDOM_STREAM])[0];
            ((r as u64 * parts as u64) >> 32) as u32
        })
        .collect()
}

fn metis(graph: &Graph, ds: &Dataset, parts: usize, seed: u64) -> Result<Vec<u32>> {
    type Idx = metis::Idx;
    let n = graph.num_nodes();
    let adj = graph.adjacency();
    if adj.nnz() > Idx::MAX as usize || n >= Idx::MAX as usize {
        return Err(RuntimeError::Config(format!(
            "graph with {n} nodes and {} adjacency entries exceeds METIS's 32-bit indices",
            adj.nnz()
        )));
    }
    let xadj: Vec<Idx> = adj.indptr().par_iter().map(|&x| x as Idx).collect();
    let adjncy: Vec<Idx> = adj.indices().par_iter().map(|&x| x as Idx).collect();
    let use_edges = adj.nnz() > 0;
    let use_train = ds.train_mask.iter().any(|&t| t);
    let ncon = 1 + use_edges as usize + use_train as usize;
    let mut vwgt: Vec<Idx> = Vec::with_capacity(n * ncon);
    for i in 0..n {
        vwgt.push(1);
        if use_edges {
            vwgt.push(graph.degree(i) as Idx);
        }
        if use_train {
            vwgt.push(ds.train_mask[i] as Idx);
        }
    }
    let mut part: Vec<Idx> = vec![0; n];
    let metis_err = |e: metis::Error| {
        RuntimeError::BadData(format!("METIS could not partition the graph: {e}"))
    };
    {
        let _guard = METIS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let spin = crate::progress::spinner("metis");
        spin.enable_steady_tick(std::time::Duration::from_millis(200));
        metis::Graph::new(ncon as Idx, parts as Idx, &xadj, &adjncy)
            .map_err(|e| metis_err(e.into()))?
            .set_vwgt(&vwgt)
            .set_option(metis::option::Seed((seed % Idx::MAX as u64) as Idx))
            .part_kway(&mut part)
            .map_err(metis_err)?;
        spin.finish_and_clear();
    }
    if let Some(&bad) = part.iter().find(|&&q| q < 0 || q as usize >= parts) {
        return Err(RuntimeError::BadData(format!(
            "METIS returned part {bad} for {parts} parts"
        )));
    }
    Ok(part.into_iter().map(|q| q as u32).collect())
}
