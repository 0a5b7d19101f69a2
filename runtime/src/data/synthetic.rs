//! The built-in synthetic data set: a seeded stochastic block model with class-correlated features.
use super::Dataset;
use crate::{Result, RuntimeError};
use rayon::prelude::*;
use trellis_gpu::Philox4x32;

/// Parameters of the synthetic generator.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub nodes: usize,
    pub degree: usize,
    pub features: usize,
    pub classes: usize,
    pub seed: u64,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        SyntheticSpec {
            nodes: 10_000,
            degree: 10,
            features: 64,
            classes: 8,
            seed: 0,
        }
    }
}

impl SyntheticSpec {
    /// Parses `nodes=N,degree=D,features=F,classes=C,seed=S` (any subset, any order).
    pub fn parse(s: &str) -> Result<Self> {
        let mut spec = SyntheticSpec::default();
        for kv in s.split(',').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                RuntimeError::Config(format!("synthetic spec: `{kv}` is not key=value"))
            })?;
            let n: u64 = v.parse().map_err(|_| {
                RuntimeError::Config(format!("synthetic spec: `{v}` is not a number for {k}"))
            })?;
            match k {
                "nodes" => spec.nodes = n as usize,
                "degree" => spec.degree = n as usize,
                "features" => spec.features = n as usize,
                "classes" => spec.classes = n as usize,
                "seed" => spec.seed = n,
                _ => {
                    return Err(RuntimeError::Config(format!(
                        "synthetic spec: unknown key `{k}`"
                    )))
                }
            }
        }
        if spec.nodes == 0 || spec.classes == 0 || spec.features == 0 {
            return Err(RuntimeError::Config(
                "synthetic spec: nodes, features and classes must be > 0".into(),
            ));
        }
        Ok(spec)
    }

    /// The spec as `synthetic:...` text.
    pub fn to_spec_string(&self) -> String {
        format!(
            "synthetic:nodes={},degree={},features={},classes={},seed={}",
            self.nodes, self.degree, self.features, self.classes, self.seed
        )
    }
}

/// Counter tags: the first counter word names what a draw is for.
const TAG_NODE: u32 = 1;
const TAG_CENTROID: u32 = 2;
const TAG_FEATURE: u32 = 3;
const TAG_EDGE: u32 = 4;
/// Probability that an out-edge stays inside the node's block (class).
const P_SAME: f32 = 0.8;
/// Probability that a node's observed label is redrawn uniformly (label noise), so that no
/// model reaches 100%: the best possible accuracy is about `1 - RELABEL * (C - 1) / C`.
const RELABEL: f32 = 0.1;
/// Fraction of the features a class prefers (at least one).
const PREFERRED_FRACTION: f32 = 0.1;
/// Distance between two class centroids in units of the per-feature noise, whatever F. On the
/// default spec a features-only nearest-mean classifier reaches about 79% and the trainer's
/// 2-layer GCN about 91% (the label-noise ceiling); with 16 classes, 60% and 76-90%.
const SIGNAL: f32 = 4.0;
/// Fractions of nodes in the train and validation sets; the rest is the test set.
const TRAIN_FRACTION: f32 = 0.1;
const VAL_FRACTION: f32 = 0.1;
/// Nodes per parallel work item.
const CHUNK: usize = 4096;

/// `u` mapped uniformly onto `0..n` (Lemire's multiply-shift; `n <= 2^32`).
#[inline]
fn below(u: u32, n: usize) -> usize {
    ((u as u64 * n as u64) >> 32) as usize
}

/// The per-node draws: latent class, observed label, split and whether the node takes one
/// extra out-edge (odd degrees).
#[derive(Clone, Copy)]
struct Node {
    class: u32,
    label: u32,
    split: u8,
    extra_edge: bool,
}

#[inline]
fn node(g: &Philox4x32, i: u32, classes: usize) -> Node {
    let b = g.block([TAG_NODE, i, 0, 0]);
    let class = below(b[0], classes) as u32;
    let label = if Philox4x32::to_unit(b[2]) < RELABEL {
        below(b[3], classes) as u32
    } else {
        class
    };
    let u = Philox4x32::to_unit(b[1]);
    let split = if u < TRAIN_FRACTION {
        0
    } else if u < TRAIN_FRACTION + VAL_FRACTION {
        1
    } else {
        2
    };
    Node {
        class,
        label,
        split,
        extra_edge: b[1] & 1 == 1,
    }
}

/// Generates the data set described by `spec`.
///
/// A stochastic block model whose blocks are the classes: node `i`'s latent class is drawn
/// uniformly from a counter-based hash of `(seed, i)`; its observed label equals the latent
/// class except with probability 0.1, where it is redrawn uniformly (label noise). Each node
/// draws `degree / 2` out-edges (one more for half the nodes when `degree` is odd), so the
/// average degree after symmetrisation is about `degree`; each edge goes with probability 0.8
/// to a uniformly chosen node of the same latent class, else to a uniformly chosen node. There
/// are no self loops; duplicate edges may occur and are kept.
///
/// Features: each class's centroid is `a` on the `m = max(1, round(0.1 F))` features it prefers
/// and 0 elsewhere; the preferred sets are runs of a seeded permutation of the features starting
/// at `class * F / C`, so they are spread evenly (disjoint when `C * m <= F`). Feature `j` of
/// node `i` is `max(0, centroid[class][j] + z)`, where `z` is approximately standard normal (the
/// sum of four uniforms, centred and scaled: Irwin-Hall). `a = 4 / sqrt(2 m)`, so two centroids
/// are 4 noise standard deviations apart whatever F: one node's features identify its class
/// only moderately, its neighbourhood's much better. Values are non-negative and about half are
/// zero, like bag-of-words features, so row normalisation is well defined.
///
/// Masks: 10% train, 10% validation, 80% test.
///
/// Every draw is a Philox4x32 block keyed by the seed with the counter `(tag, node, index, 0)`,
/// so the result depends only on the spec, never on the thread count.
pub fn generate(spec: &SyntheticSpec) -> Result<Dataset> {
    let n = spec.nodes;
    let f = spec.features;
    let c = spec.classes;
    if n == 0 || f == 0 || c == 0 {
        return Err(RuntimeError::Config(
            "synthetic spec: nodes, features and classes must be > 0".into(),
        ));
    }
    if n > u32::MAX as usize {
        return Err(RuntimeError::Config(format!(
            "synthetic spec: {n} nodes exceed the limit of {}",
            u32::MAX
        )));
    }
    if c as u64 > super::npy::MAX_CLASSES {
        return Err(RuntimeError::Config(format!(
            "synthetic spec: {c} classes exceed the limit of {}",
            super::npy::MAX_CLASSES
        )));
    }
    if f > u32::MAX as usize {
        return Err(RuntimeError::Config(format!(
            "synthetic spec: {f} features exceed the limit of {}",
            u32::MAX
        )));
    }
    let too_large = || {
        RuntimeError::Config(format!(
            "synthetic spec: {} is too large to hold in memory",
            spec.to_spec_string()
        ))
    };
    let num_values = n.checked_mul(f).ok_or_else(too_large)?;
    let base_out = if n > 1 { spec.degree / 2 } else { 0 };
    let max_edges = n
        .checked_mul(base_out.checked_add(1).ok_or_else(too_large)?)
        .ok_or_else(too_large)?;
    // Refuse specs that cannot fit in physical memory rather than abort on allocation.
    let per_node = std::mem::size_of::<Node>() + 4 + 4 + 3;
    let bytes = num_values
        .checked_mul(4)
        .and_then(|b| b.checked_add(n.checked_mul(per_node)?))
        .and_then(|b| b.checked_add(max_edges.checked_mul(8)?))
        .and_then(|b| b.checked_add(c.checked_mul(f)?.checked_mul(4)?))
        .ok_or_else(too_large)?;
    if bytes as u64 > physical_memory() {
        return Err(too_large());
    }
    let g = Philox4x32::new(spec.seed);
    let odd = n > 1 && spec.degree % 2 == 1;
    let out_degree = |nd: &Node| base_out + usize::from(odd && nd.extra_edge);

    let nodes: Vec<Node> = (0..n as u32)
        .into_par_iter()
        .map(|i| node(&g, i, c))
        .collect();

    // Nodes grouped by latent class (counting sort), for same-class neighbours.
    let mut class_start = vec![0usize; c + 1];
    for nd in &nodes {
        class_start[nd.class as usize + 1] += 1;
    }
    for k in 0..c {
        class_start[k + 1] += class_start[k];
    }
    let mut fill = class_start.clone();
    let mut by_class = vec![0u32; n];
    for (i, nd) in nodes.iter().enumerate() {
        let k = nd.class as usize;
        by_class[fill[k]] = i as u32;
        fill[k] += 1;
    }
    drop(fill);

    // Features.
    let m = ((PREFERRED_FRACTION * f as f32).round() as usize).clamp(1, f);
    let amp = SIGNAL / (2.0 * m as f32).sqrt();
    // A seeded permutation of the features; class k prefers m consecutive entries of it
    // starting at k * F / C, so the sets are spread evenly (disjoint when C * m <= F).
    let mut perm: Vec<(u32, u32)> = (0..f as u32)
        .map(|j| (g.block([TAG_CENTROID, j, 0, 0])[0], j))
        .collect();
    perm.sort_unstable();
    let mut centroids = vec![0.0f32; c * f];
    for k in 0..c {
        let start = k * f / c;
        for t in 0..m {
            centroids[k * f + perm[(start + t) % f].1 as usize] = amp;
        }
    }
    let mut features = Vec::new();
    features
        .try_reserve_exact(num_values)
        .map_err(|_| too_large())?;
    features.resize(num_values, 0.0f32);
    features
        .par_chunks_mut(f * CHUNK)
        .enumerate()
        .for_each(|(chunk, rows)| {
            for (r, row) in rows.chunks_mut(f).enumerate() {
                let i = chunk * CHUNK + r;
                let cen = &centroids[nodes[i].class as usize * f..][..f];
                for (j, (x, &m)) in row.iter_mut().zip(cen).enumerate() {
                    let b = g.block([TAG_FEATURE, i as u32, j as u32, 0]);
                    let sum: f32 = b.iter().map(|&u| Philox4x32::to_unit(u)).sum();
                    let z = (sum - 2.0) * 3f32.sqrt();
                    *x = (m + z).max(0.0);
                }
            }
        });

    // Edges: per-chunk counts, offsets, then each chunk fills its own slice.
    let chunk_counts: Vec<usize> = nodes
        .par_chunks(CHUNK)
        .map(|ch| ch.iter().map(out_degree).sum::<usize>())
        .collect();
    let total: usize = chunk_counts.iter().sum();
    let mut edge_src = Vec::new();
    let mut edge_dst = Vec::new();
    edge_src.try_reserve_exact(total).map_err(|_| too_large())?;
    edge_dst.try_reserve_exact(total).map_err(|_| too_large())?;
    edge_src.resize(total, 0u32);
    edge_dst.resize(total, 0u32);
    let mut parts = Vec::with_capacity(chunk_counts.len());
    let (mut src_rest, mut dst_rest) = (edge_src.as_mut_slice(), edge_dst.as_mut_slice());
    for (k, &cnt) in chunk_counts.iter().enumerate() {
        let (s, sr) = src_rest.split_at_mut(cnt);
        let (d, dr) = dst_rest.split_at_mut(cnt);
        parts.push((k, s, d));
        src_rest = sr;
        dst_rest = dr;
    }
    parts.into_par_iter().for_each(|(k, src, dst)| {
        let mut e = 0;
        let first = k * CHUNK;
        for (i, nd) in nodes[first..(first + CHUNK).min(n)]
            .iter()
            .enumerate()
            .map(|(r, nd)| (first + r, nd))
        {
            let members =
                &by_class[class_start[nd.class as usize]..class_start[nd.class as usize + 1]];
            for t in 0..out_degree(nd) {
                let w = g.block([TAG_EDGE, i as u32, t as u32, 0]);
                let mut j = if Philox4x32::to_unit(w[0]) < P_SAME {
                    members[below(w[1], members.len())] as usize
                } else {
                    below(w[1], n)
                };
                if j == i {
                    // Redraw uniformly among the other n - 1 nodes.
                    j = below(w[2], n - 1);
                    if j >= i {
                        j += 1;
                    }
                }
                src[e] = i as u32;
                dst[e] = j as u32;
                e += 1;
            }
        }
    });

    let labels: Vec<u32> = nodes.par_iter().map(|nd| nd.label).collect();
    let train_mask: Vec<bool> = nodes.par_iter().map(|nd| nd.split == 0).collect();
    let val_mask: Vec<bool> = nodes.par_iter().map(|nd| nd.split == 1).collect();
    let test_mask: Vec<bool> = nodes.par_iter().map(|nd| nd.split == 2).collect();
    Ok(Dataset {
        name: spec.to_spec_string(),
        num_nodes: n,
        num_features: f,
        num_classes: c,
        features,
        labels,
        edge_src,
        edge_dst,
        train_mask,
        val_mask,
        test_mask,
    })
}

/// Physical memory in bytes (`u64::MAX` when unknown).
fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions; it returns -1 for unsupported names.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        return u64::MAX;
    }
    (pages as u64).saturating_mul(size as u64)
}
