//! Loader for PyTorch Geometric exports written with `numpy.save` (a folder) or `numpy.savez`.
use super::Dataset;
use crate::Result;
use std::path::Path;

/// Loads `edge_index.npy`, `x.npy`, `y.npy` and the three masks from `dir`.
pub fn load_dir(dir: &Path) -> Result<Dataset> {
    let _ = dir;
    todo!("npy loader")
}

/// Loads the same keys from one `.npz` archive.
pub fn load_npz(path: &Path) -> Result<Dataset> {
    let _ = path;
    todo!("npz loader")
}
