//! `trellis predict`: layer-wise full-graph inference with a saved model, into a `.npy` file.
use super::train::load_data;
use anyhow::{bail, Context, Result};
use clap::Args;
use ndarray::Array2;
use std::path::{Path, PathBuf};
use trellis_gpu::Stream;
use trellis_runtime::inference::{parts_of, Inference, LayerOutputs, NodeGraph};
use trellis_runtime::model_file::{self, ModelMeta, SavedModel};
use trellis_runtime::partition::{assign, PartitionMethod};
use trellis_runtime::{Dataset, Graph};

/// Options of `trellis predict`.
#[derive(Debug, Clone, Args)]
pub struct PredictArgs {
    /// A model file written by `trellis train --save-model`.
    #[arg(long)]
    pub model: PathBuf,
    /// The graph to predict on (same forms as `trellis train --data`).
    #[arg(long)]
    pub data: String,
    /// Where to write the output: float32 `[N, C]` logits, or the rows of `--embeddings`.
    #[arg(long)]
    pub out: PathBuf,
    /// Write this layer's output (0 = first layer) instead of the logits.
    #[arg(long)]
    pub embeddings: Option<usize>,
    /// Compute with this many parts (each computes its own nodes' rows over its block);
    /// the output is the same, bit for bit.
    #[arg(long, default_value_t = 1)]
    pub partitions: usize,
    /// How to partition: metis or random.
    #[arg(long, default_value = "metis")]
    pub partition_method: PartitionMethod,
    /// CPU threads for kernels (0 = all CPUs).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// A loaded model checked against a loaded data set, ready for inference.
pub struct Prepared {
    /// What the model file says about the model.
    pub meta: ModelMeta,
    /// Short name of the weights (first digits of their digest).
    pub version: String,
    pub graph: NodeGraph,
    pub inference: Inference,
    /// Each node's part.
    pub owner: Vec<u32>,
    pub parts: usize,
}

/// Loads `model` and checks it fits `ds`; partitions the graph into `parts`.
pub fn prepare(
    model: &Path,
    ds: &Dataset,
    parts: usize,
    method: PartitionMethod,
    threads: usize,
) -> Result<Prepared> {
    let saved = model_file::load(model)?;
    saved.check_fits(ds.num_features, ds.num_classes)?;
    let graph = Graph::from_dataset(ds)?;
    let owner = assign(&graph, ds, parts.max(1), method, saved.meta.config.seed)
        .with_context(|| format!("cannot split the graph into {parts} parts"))?;
    let stream = Stream::cpu(threads)?;
    let version = saved.version();
    let SavedModel { model, meta, .. } = saved;
    let inference = Inference::new(model, stream, meta.normalize_features)?;
    Ok(Prepared {
        meta,
        version,
        graph: NodeGraph::from_graph(&graph),
        inference,
        owner,
        parts: parts.max(1),
    })
}

/// Runs layer-wise inference over every node of `ds`.
pub fn predict(p: &mut Prepared, ds: &Dataset) -> Result<LayerOutputs> {
    let x = p.inference.prepare_features(ds.features.clone())?;
    Ok(p.inference
        .run(&p.graph, &x, &parts_of(&p.owner, p.parts))?)
}

/// Writes a row table as a float32 `.npy` file.
pub fn write_npy(path: &Path, rows: usize, width: usize, data: Vec<f32>) -> Result<()> {
    let a = Array2::from_shape_vec((rows, width), data).expect("rows x width values");
    ndarray_npy::write_npy(path, &a).with_context(|| format!("cannot write {}", path.display()))
}

pub fn run(a: PredictArgs) -> Result<()> {
    let ds = load_data(&a.data)?;
    let mut p = prepare(&a.model, &ds, a.partitions, a.partition_method, a.threads)?;
    let layers = p.meta.config.layers;
    if let Some(l) = a.embeddings {
        if l >= layers {
            bail!("--embeddings {l}: the model has layers 0..{} ", layers - 1);
        }
    }
    let t = std::time::Instant::now();
    let mut out = predict(&mut p, &ds)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let layer = a.embeddings.unwrap_or(layers - 1);
    let rows = out.layers.swap_remove(layer);
    let n = rows.len();
    let width = rows.width;
    write_npy(&a.out, n, width, rows.data)?;
    println!(
        "{} model {} ({} epoch {}): {} x {} {} of {} written to {} ({} part{}, {:.1} ms)",
        p.meta.config.kind,
        a.model.display(),
        p.version,
        p.meta.epoch,
        n,
        width,
        if a.embeddings.is_some() {
            "embeddings"
        } else {
            "logits"
        },
        ds.name,
        a.out.display(),
        p.parts,
        if p.parts == 1 { "" } else { "s" },
        ms
    );
    Ok(())
}
