//! Builds one part's [`PartitionData`] from the global graph and a node-to-part assignment.
use super::format::{PartitionData, SendList, FORMAT_VERSION};
use crate::{Dataset, Graph};
use rayon::prelude::*;

const UNSET: u32 = u32::MAX;
const HALO_PENDING: u32 = u32::MAX - 1;

/// Inner nodes of every part, each list ascending.
pub(crate) fn members(assignment: &[u32], parts: usize) -> Vec<Vec<u32>> {
    let mut counts = vec![0usize; parts];
    for &q in assignment {
        counts[q as usize] += 1;
    }
    let mut lists: Vec<Vec<u32>> = counts.iter().map(|&c| Vec::with_capacity(c)).collect();
    for (i, &q) in assignment.iter().enumerate() {
        lists[q as usize].push(i as u32);
    }
    lists
}

/// Reusable global-to-local map: `num_nodes` entries, all [`UNSET`] between parts.
pub(crate) struct Scratch {
    local: Vec<u32>,
}

impl Scratch {
    pub(crate) fn new(num_nodes: usize) -> Self {
        Scratch {
            local: vec![UNSET; num_nodes],
        }
    }
}

/// Everything a part file holds except the identity fields, for part `p` with inner nodes
/// `inner` (ascending).
pub(crate) struct PartSpec<'a> {
    pub ds: &'a Dataset,
    pub graph: &'a Graph,
    pub assignment: &'a [u32],
    pub parts: usize,
    pub data_digest: &'a str,
}

impl PartSpec<'_> {
    pub(crate) fn build(&self, p: usize, inner: &[u32], scratch: &mut Scratch) -> PartitionData {
        let (graph, ds) = (self.graph, self.ds);
        let local = &mut scratch.local;
        for (k, &g) in inner.iter().enumerate() {
            local[g as usize] = k as u32;
        }
        let mut halo = Vec::new();
        for &g in inner {
            for &j in graph.neighbors(g as usize) {
                if local[j as usize] == UNSET {
                    local[j as usize] = HALO_PENDING;
                    halo.push(j);
                }
            }
        }
        halo.par_sort_unstable();
        for (k, &h) in halo.iter().enumerate() {
            local[h as usize] = (inner.len() + k) as u32;
        }

        let mut indptr = Vec::with_capacity(inner.len() + 1);
        indptr.push(0u64);
        let mut indices = Vec::with_capacity(inner.iter().map(|&g| graph.degree(g as usize)).sum());
        let mut send: Vec<Vec<u32>> = vec![Vec::new(); self.parts];
        let mut stamp = vec![UNSET; self.parts];
        for (k, &g) in inner.iter().enumerate() {
            for &j in graph.neighbors(g as usize) {
                indices.push(local[j as usize]);
                let q = self.assignment[j as usize] as usize;
                if q != p && stamp[q] != k as u32 {
                    stamp[q] = k as u32;
                    send[q].push(k as u32);
                }
            }
            indptr.push(indices.len() as u64);
        }
        for &g in inner.iter().chain(&halo) {
            local[g as usize] = UNSET;
        }

        let gids: Vec<u32> = inner.iter().chain(&halo).copied().collect();
        let f = ds.num_features;
        let mut features = vec![0f32; gids.len() * f];
        if f > 0 {
            features
                .par_chunks_mut(f)
                .zip(gids.par_iter())
                .for_each(|(row, &g)| {
                    row.copy_from_slice(&ds.features[g as usize * f..(g as usize + 1) * f]);
                });
        }
        let pick = |v: &[bool]| inner.iter().map(|&g| v[g as usize]).collect::<Vec<bool>>();
        PartitionData {
            format_version: FORMAT_VERSION,
            part: p as u32,
            num_parts: self.parts as u32,
            num_features: f as u32,
            num_classes: ds.num_classes as u32,
            num_global_nodes: graph.num_nodes() as u64,
            data_digest: self.data_digest.to_string(),
            halo_owner: halo.iter().map(|&h| self.assignment[h as usize]).collect(),
            degrees: gids
                .iter()
                .map(|&g| graph.degree(g as usize) as u32)
                .collect(),
            labels: inner.iter().map(|&g| ds.labels[g as usize]).collect(),
            train_mask: pick(&ds.train_mask),
            val_mask: pick(&ds.val_mask),
            test_mask: pick(&ds.test_mask),
            send: send
                .into_iter()
                .enumerate()
                .filter(|(_, rows)| !rows.is_empty())
                .map(|(q, rows)| SendList {
                    to_part: q as u32,
                    rows,
                })
                .collect(),
            inner: inner.to_vec(),
            halo,
            indptr,
            indices,
            features,
        }
    }
}
