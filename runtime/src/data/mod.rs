//! Data sets: the in-memory [`Dataset`] and the loaders that produce it.
//!
//! Sources: a PyTorch Geometric export (a folder of `.npy` files, or one `.npz`), an OGB
//! node-property-prediction folder, or the built-in synthetic stochastic block model.
use crate::{Result, RuntimeError};
use std::path::{Path, PathBuf};

mod npy;
mod ogb;
mod synthetic;

pub use synthetic::SyntheticSpec;

/// A node-classification data set held in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Human-readable name (folder name or the synthetic spec).
    pub name: String,
    pub num_nodes: usize,
    pub num_features: usize,
    pub num_classes: usize,
    /// Node features, `num_nodes x num_features`, row-major.
    pub features: Vec<f32>,
    /// Class of each node, `< num_classes`.
    pub labels: Vec<u32>,
    /// Directed edges as given (`src[i] -> dst[i]`, PyG's `edge_index[0]` and `[1]`).
    pub edge_src: Vec<u32>,
    pub edge_dst: Vec<u32>,
    pub train_mask: Vec<bool>,
    pub val_mask: Vec<bool>,
    pub test_mask: Vec<bool>,
}

/// Where a data set comes from, parsed from a `--data` argument.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// `synthetic:nodes=N,degree=D,features=F,classes=C,seed=S`.
    Synthetic(SyntheticSpec),
    /// A folder of `.npy` files exported from PyG.
    NpyDir(PathBuf),
    /// One `.npz` archive with the same keys.
    Npz(PathBuf),
    /// An OGB node-property-prediction folder (`raw/`, `split/`).
    Ogb(PathBuf),
}

impl DataSource {
    /// Parses a `--data` argument; a path is classified by what it holds.
    pub fn parse(spec: &str) -> Result<Self> {
        if let Some(rest) = spec.strip_prefix("synthetic:") {
            return Ok(DataSource::Synthetic(SyntheticSpec::parse(rest)?));
        }
        if spec == "synthetic" {
            return Ok(DataSource::Synthetic(SyntheticSpec::default()));
        }
        let p = PathBuf::from(spec);
        if p.extension().is_some_and(|e| e == "npz") {
            return Ok(DataSource::Npz(p));
        }
        if !p.exists() {
            return Err(RuntimeError::io(
                &p,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        if p.join("raw").is_dir() && p.join("split").is_dir() {
            return Ok(DataSource::Ogb(p));
        }
        if p.is_dir() {
            return Ok(DataSource::NpyDir(p));
        }
        Err(RuntimeError::bad_file(
            &p,
            "not a data folder (.npy files or OGB layout) nor an .npz archive",
        ))
    }

    /// Loads and validates the data set.
    pub fn load(&self) -> Result<Dataset> {
        let ds = match self {
            DataSource::Synthetic(s) => synthetic::generate(s)?,
            DataSource::NpyDir(p) => npy::load_dir(p)?,
            DataSource::Npz(p) => npy::load_npz(p)?,
            DataSource::Ogb(p) => ogb::load(p)?,
        };
        ds.validate()?;
        Ok(ds)
    }
}

impl Dataset {
    /// Checks the invariants every loader promises; loaders report file-specific errors first.
    pub fn validate(&self) -> Result<()> {
        let n = self.num_nodes;
        let bad = |m: String| Err(RuntimeError::BadData(m));
        if self.features.len() != n * self.num_features {
            return bad(format!(
                "{} feature values for {n} nodes x {} features",
                self.features.len(),
                self.num_features
            ));
        }
        if self.labels.len() != n {
            return bad(format!("{} labels for {n} nodes", self.labels.len()));
        }
        for (name, m) in [
            ("train", &self.train_mask),
            ("val", &self.val_mask),
            ("test", &self.test_mask),
        ] {
            if m.len() != n {
                return bad(format!("{name} mask has {} entries for {n} nodes", m.len()));
            }
        }
        if self.edge_src.len() != self.edge_dst.len() {
            return bad("edge source and target lists differ in length".into());
        }
        if let Some(&v) = self
            .edge_src
            .iter()
            .chain(&self.edge_dst)
            .find(|&&v| v as usize >= n)
        {
            return bad(format!("edge endpoint {v} out of range for {n} nodes"));
        }
        if let Some(&c) = self
            .labels
            .iter()
            .find(|&&c| c as usize >= self.num_classes)
        {
            return bad(format!(
                "label {c} out of range for {} classes",
                self.num_classes
            ));
        }
        if self.features.iter().any(|x| !x.is_finite()) {
            return bad("features contain NaN or infinity".into());
        }
        Ok(())
    }

    /// What the split masks make of the accuracies, when it is not what they seem: an empty
    /// split, or nodes in two splits at once. One sentence per problem (none for a clean split).
    pub fn split_warnings(&self) -> Vec<String> {
        let count = |m: &[bool]| m.iter().filter(|&&b| b).count();
        let both = |a: &[bool], b: &[bool]| a.iter().zip(b).filter(|(&x, &y)| x && y).count();
        let (train, val, test) = (
            count(&self.train_mask),
            count(&self.val_mask),
            count(&self.test_mask),
        );
        let mut w = Vec::new();
        if train == 0 {
            w.push("the training mask is empty: no gradient flows, the weights stay at their initial values".to_string());
        }
        if val == 0 {
            w.push("the validation mask is empty: validation accuracy is 0 every epoch, so the \"best\" epoch is the first".to_string());
        }
        if test == 0 {
            w.push(
                "the test mask is empty: the reported test accuracy is 0 and means nothing"
                    .to_string(),
            );
        }
        for (a, b, n, what) in [
            (
                "training",
                "test",
                both(&self.train_mask, &self.test_mask),
                "test accuracy is measured partly on training nodes and overstates generalisation",
            ),
            (
                "training",
                "validation",
                both(&self.train_mask, &self.val_mask),
                "the best epoch is chosen partly on training nodes",
            ),
            (
                "validation",
                "test",
                both(&self.val_mask, &self.test_mask),
                "the test accuracy is partly the accuracy the best epoch was chosen by",
            ),
        ] {
            if n > 0 {
                w.push(format!(
                    "{n} nodes are in both the {a} and the {b} mask: {what}"
                ));
            }
        }
        w
    }

    /// Node ids where `mask` is true.
    pub fn mask_ids(mask: &[bool]) -> Vec<u32> {
        mask.iter()
            .enumerate()
            .filter(|(_, &m)| m)
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// A digest of the data set's contents (features, labels, edges, masks).
    pub fn digest(&self) -> String {
        let mut h = blake3::Hasher::new();
        h.update(&(self.num_nodes as u64).to_le_bytes());
        h.update(&(self.num_features as u64).to_le_bytes());
        h.update(&(self.num_classes as u64).to_le_bytes());
        let mut buf = Vec::with_capacity(1 << 16);
        for chunk in self.features.chunks(1 << 14) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
            h.update(&buf);
        }
        for v in [&self.labels, &self.edge_src, &self.edge_dst] {
            for chunk in v.chunks(1 << 14) {
                buf.clear();
                buf.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
                h.update(&buf);
            }
        }
        for m in [&self.train_mask, &self.val_mask, &self.test_mask] {
            buf.clear();
            buf.extend(m.iter().map(|&b| b as u8));
            h.update(&buf);
        }
        h.finalize().to_hex().to_string()
    }
}

/// Path helper for loaders: `dir/name`.
pub(crate) fn file_in(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}
