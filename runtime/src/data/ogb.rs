//! Loader for OGB node-property-prediction folders as OGB downloads them.
use super::Dataset;
use crate::Result;
use std::path::Path;

/// Loads `raw/{edge,node-feat,node-label}.csv.gz` and `split/<name>/{train,valid,test}.csv.gz`.
pub fn load(dir: &Path) -> Result<Dataset> {
    let _ = dir;
    todo!("ogb loader")
}
