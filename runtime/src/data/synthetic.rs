//! The built-in synthetic data set: a seeded stochastic block model with class-correlated features.
use super::Dataset;
use crate::{Result, RuntimeError};

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
        SyntheticSpec { nodes: 10_000, degree: 10, features: 64, classes: 8, seed: 0 }
    }
}

impl SyntheticSpec {
    /// Parses `nodes=N,degree=D,features=F,classes=C,seed=S` (any subset, any order).
    pub fn parse(s: &str) -> Result<Self> {
        let mut spec = SyntheticSpec::default();
        for kv in s.split(',').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| RuntimeError::Config(format!("synthetic spec: `{kv}` is not key=value")))?;
            let n: u64 = v
                .parse()
                .map_err(|_| RuntimeError::Config(format!("synthetic spec: `{v}` is not a number for {k}")))?;
            match k {
                "nodes" => spec.nodes = n as usize,
                "degree" => spec.degree = n as usize,
                "features" => spec.features = n as usize,
                "classes" => spec.classes = n as usize,
                "seed" => spec.seed = n,
                _ => return Err(RuntimeError::Config(format!("synthetic spec: unknown key `{k}`"))),
            }
        }
        if spec.nodes == 0 || spec.classes == 0 || spec.features == 0 {
            return Err(RuntimeError::Config("synthetic spec: nodes, features and classes must be > 0".into()));
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

/// Generates the data set described by `spec`.
pub fn generate(spec: &SyntheticSpec) -> Result<Dataset> {
    let _ = spec;
    todo!("synthetic generator")
}
