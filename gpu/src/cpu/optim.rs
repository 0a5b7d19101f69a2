//! Optimizer steps: Adam and SGD (momentum), both with L2 weight decay as PyTorch applies it.
use crate::ops::{AdamConfig, SgdConfig};
use rayon::prelude::*;

/// One Adam step (`t` counts from 1). `grad` is not modified.
pub fn adam_step(
    cfg: &AdamConfig,
    t: u64,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    assert!(
        param.len() == grad.len() && m.len() == grad.len() && v.len() == grad.len(),
        "adam: length mismatch"
    );
    // t = 0 would divide by a zero bias correction and silently turn every parameter into NaN.
    assert!(t >= 1, "adam: steps count from 1");
    let (step, bc2_sqrt) = cfg.bias_correction(t);
    let (b1, b2, eps, wd) = (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay);
    param
        .par_chunks_mut(4096)
        .zip(grad.par_chunks(4096))
        .zip(m.par_chunks_mut(4096).zip(v.par_chunks_mut(4096)))
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let gi = g[i] + wd * p[i];
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                p[i] -= step * m[i] / denom;
            }
        });
}

/// One SGD step with optional momentum (`buf` holds the momentum buffer).
pub fn sgd_step(cfg: &SgdConfig, param: &mut [f32], grad: &[f32], buf: &mut [f32]) {
    assert!(
        param.len() == grad.len() && buf.len() == grad.len(),
        "sgd: length mismatch"
    );
    let (lr, mu, wd) = (cfg.lr, cfg.momentum, cfg.weight_decay);
    param
        .par_chunks_mut(4096)
        .zip(grad.par_chunks(4096).zip(buf.par_chunks_mut(4096)))
        .for_each(|(p, (g, b))| {
            for i in 0..p.len() {
                let gi = g[i] + wd * p[i];
                b[i] = if mu != 0.0 { mu * b[i] + gi } else { gi };
                p[i] -= lr * b[i];
            }
        });
}
