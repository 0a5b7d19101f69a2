//! Typed errors of the runtime. Every data error names the file and the problem.
use std::path::PathBuf;
use thiserror::Error;

/// Errors raised while loading data, building graphs, training or writing reports.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file was read but its contents are wrong (dtype, shape, values, truncation).
    #[error("{path}: {detail}")]
    BadFile { path: PathBuf, detail: String },
    /// The data set as a whole is inconsistent (e.g. node counts differ between files).
    #[error("invalid data set: {0}")]
    BadData(String),
    /// A configuration value is out of range or a spec does not parse.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A kernel rejected its operands.
    #[error(transparent)]
    Gpu(#[from] trellis_gpu::GpuError),
}

impl RuntimeError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RuntimeError::Io {
            path: path.into(),
            source,
        }
    }
    /// A content error in `path`.
    pub fn bad_file(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        RuntimeError::BadFile {
            path: path.into(),
            detail: detail.into(),
        }
    }
}
