//! Finite-difference gradient checks of every layer's backward pass.
//!
//! The loss is `L = sum(out * R)` for a fixed random `R`, evaluated with f64 accumulation;
//! central differences of `L` are compared with the analytic gradients of the weights and of
//! every input row (halo rows included, on a block that covers only part of the graph).
use super::*;
use crate::graph::{Block, Graph};
use std::borrow::Cow;

fn stream() -> Stream {
    Stream::cpu(2).unwrap()
}

fn rand_tensor(rows: usize, cols: usize, seed: u64) -> Tensor {
    let g = Philox4x32::new(seed);
    let v = (0..rows * cols)
        .map(|i| 2.0 * Philox4x32::to_unit(g.block([i as u32, 7, 0, 0])[0]) - 1.0)
        .collect();
    Tensor::from_vec(rows, cols, v).unwrap()
}

fn small_graph() -> Graph {
    // 9 nodes: a ring with chords, plus node 8 isolated.
    let src = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 5];
    let dst = [1, 2, 3, 4, 5, 6, 7, 0, 4, 6, 1];
    Graph::from_edges(9, &src, &dst).unwrap()
}

fn loss(
    model: &mut Model,
    s: &Stream,
    l: usize,
    block: &Block,
    x: &LayerInput,
    r: &Tensor,
    ctx: StepCtx,
) -> f64 {
    let out = model
        .forward_layer(s, l, block, Cow::Borrowed(x), ctx)
        .unwrap();
    out.as_slice()
        .iter()
        .zip(r.as_slice())
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum()
}

fn check_layer(kind: ModelKind, layer: usize, dropout: f32) {
    check_layer_with(kind, layer, dropout, false);
    if layer == 0 {
        check_layer_with(kind, layer, dropout, true);
    }
}

/// The small model every check uses: 6 inputs, 3 classes, hidden 4 (2 heads for GAT).
fn small_config(kind: ModelKind, dropout: f32) -> ModelConfig {
    let mut cfg = ModelConfig::paper_defaults(kind, 6, 3, 11);
    cfg.hidden = 4;
    cfg.heads = 2;
    cfg.out_heads = 2;
    cfg.dropout = dropout;
    cfg.attn_dropout = dropout;
    cfg
}

/// `cfg`'s model with non-zero biases, so no pre-activation sits exactly on a ReLU kink.
fn small_model(cfg: ModelConfig) -> Model {
    let mut model = Model::new(cfg).unwrap();
    for (k, p) in model.params_mut().iter_mut().enumerate() {
        if p.name.ends_with("bias") {
            p.value = rand_tensor(p.value.rows(), p.value.cols(), 100 + k as u64);
        }
    }
    model
}

/// With `sparse`, the input is mostly zeros and held as a sparse matrix.
fn check_layer_with(kind: ModelKind, layer: usize, dropout: f32, sparse: bool) {
    check_layer_of(small_config(kind, dropout), layer, sparse);
}

/// Checks layer `layer` of `cfg`'s model on a block with halo rows.
fn check_layer_of(cfg: ModelConfig, layer: usize, sparse: bool) {
    let s = stream();
    let kind = cfg.kind;
    let graph = small_graph();
    // Inner nodes 1,2,3,5,8 (not ascending by degree), the rest become halo.
    let block = Block::build(&graph, &[1, 2, 3, 5, 8], kind.aggregation()).unwrap();
    let mut model = small_model(cfg);
    let in_dim = model.layer_in_dim(layer);
    let mut x = rand_tensor(block.n_in(), in_dim, 3);
    if sparse {
        x.as_mut_slice()
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| i % 13 != 0)
            .for_each(|(_, v)| *v = 0.0);
    }
    let wrap = |t: &Tensor| {
        if sparse {
            LayerInput::auto(&s, t.clone()).unwrap()
        } else {
            LayerInput::Dense(t.clone())
        }
    };
    assert_eq!(wrap(&x).is_sparse(), sparse);
    let ctx = StepCtx {
        epoch: 4,
        train: true,
    };
    let out = model
        .forward_layer(&s, layer, &block, Cow::Owned(wrap(&x)), ctx)
        .unwrap();
    let r = rand_tensor(out.rows(), out.cols(), 5);
    model.zero_grad(&s).unwrap();
    let gx = model
        .backward_layer(&s, layer, &block, r.clone(), true)
        .unwrap()
        .unwrap();

    let eps = 1e-3f32;
    let l0 = loss(&mut model, &s, layer, &block, &wrap(&x), &r, ctx);
    // A ReLU kink between `v - eps` and `v + eps` bends the central difference; the one-sided
    // difference on the kink-free side still follows the gradient.
    let follows = |ana: f64, lp: f64, lm: f64| {
        let tol = |n: f64| (ana - n).abs() <= 2e-2 * n.abs().max(ana.abs()) + 2e-3;
        let e = eps as f64;
        tol((lp - lm) / (2.0 * e)) || tol((l0 - lm) / e) || tol((lp - l0) / e)
    };
    // Input rows.
    // With a sparse input only the stored entries are checked (the others are not inputs).
    for i in (0..x.len()).filter(|&i| !sparse || x.as_slice()[i] != 0.0) {
        let mut xp = x.clone();
        xp.as_mut_slice()[i] += eps;
        let lp = loss(&mut model, &s, layer, &block, &wrap(&xp), &r, ctx);
        xp.as_mut_slice()[i] -= 2.0 * eps;
        let lm = loss(&mut model, &s, layer, &block, &wrap(&xp), &r, ctx);
        let num = (lp - lm) / (2.0 * eps as f64);
        let ana = gx.as_slice()[i] as f64;
        assert!(
            follows(ana, lp, lm),
            "{kind} layer {layer} d/dx[{i}]: analytic {ana} vs numeric {num}"
        );
    }
    // Parameters of this layer.
    let grads: Vec<(String, Tensor)> = model
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.grad.clone()))
        .collect();
    let prefix = format!("layers.{layer}.");
    let mut checked = 0;
    for (pi, (name, g)) in grads.iter().enumerate() {
        if !name.starts_with(&prefix) {
            continue;
        }
        for i in 0..g.len() {
            let orig = model.params()[pi].value.as_slice()[i];
            model.params_mut()[pi].value.as_mut_slice()[i] = orig + eps;
            let lp = loss(&mut model, &s, layer, &block, &wrap(&x), &r, ctx);
            model.params_mut()[pi].value.as_mut_slice()[i] = orig - eps;
            let lm = loss(&mut model, &s, layer, &block, &wrap(&x), &r, ctx);
            model.params_mut()[pi].value.as_mut_slice()[i] = orig;
            let num = (lp - lm) / (2.0 * eps as f64);
            let ana = g.as_slice()[i] as f64;
            assert!(
                follows(ana, lp, lm),
                "{kind} layer {layer} d/d{name}[{i}]: analytic {ana} vs numeric {num}"
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}

#[test]
fn gcn_hidden_layer() {
    check_layer(ModelKind::Gcn, 0, 0.0);
}
#[test]
fn gcn_output_layer_with_dropout() {
    check_layer(ModelKind::Gcn, 1, 0.3);
}
#[test]
fn gcn_hidden_layer_with_dropout() {
    check_layer(ModelKind::Gcn, 0, 0.3);
}
#[test]
fn sage_hidden_layer() {
    check_layer(ModelKind::Sage, 0, 0.0);
}
#[test]
fn sage_output_layer_with_dropout() {
    check_layer(ModelKind::Sage, 1, 0.3);
}
#[test]
fn gat_hidden_layer() {
    check_layer(ModelKind::Gat, 0, 0.0);
}
#[test]
fn gat_output_layer() {
    check_layer(ModelKind::Gat, 1, 0.0);
}
#[test]
fn gat_hidden_layer_with_dropout() {
    check_layer(ModelKind::Gat, 0, 0.3);
}

/// A deep config: `layers` layers with hidden widths `widths` (per head), with or without
/// residual connections.
fn deep_config(kind: ModelKind, widths: &[usize], residual: bool, dropout: f32) -> ModelConfig {
    let mut cfg = small_config(kind, dropout);
    cfg.layers = widths.len() + 1;
    cfg.hidden = widths[0];
    cfg.hidden_sizes = widths.to_vec();
    cfg.residual = residual;
    cfg
}

/// Every layer of deep models (3 and 4 layers, with and without residual connections, an
/// identity and a projected one) on a block with halo rows: weights and every input row.
#[test]
fn deep_and_residual_layers_of_every_model() {
    for kind in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat] {
        for widths in [&[4, 4][..], &[4, 4, 3][..]] {
            for residual in [false, true] {
                let cfg = deep_config(kind, widths, residual, 0.2);
                if residual {
                    assert_eq!(cfg.residual_of(1), Residual::Identity);
                    let last_hidden = widths.len() - 1;
                    let want = if widths.len() == 3 {
                        Residual::Projection
                    } else {
                        Residual::Identity
                    };
                    assert_eq!(cfg.residual_of(last_hidden), want);
                    assert_eq!(cfg.residual_of(0), Residual::None);
                    assert_eq!(cfg.residual_of(widths.len()), Residual::None);
                }
                for layer in 0..cfg.layers {
                    check_layer_of(cfg.clone(), layer, false);
                }
            }
        }
    }
}

/// The whole stack, forward and backward through every layer (residual connections
/// included), against central differences of `sum(logits * R)` in every parameter.
fn check_whole_model(cfg: ModelConfig) {
    let s = stream();
    let kind = cfg.kind;
    let graph = small_graph();
    let block = Block::full(&graph, kind.aggregation()).unwrap();
    let mut model = small_model(cfg);
    let x = LayerInput::Dense(rand_tensor(block.n_in(), 6, 3));
    let ctx = StepCtx {
        epoch: 2,
        train: true,
    };
    let out = model.forward_full(&s, &block, &x, ctx).unwrap();
    let r = rand_tensor(out.rows(), out.cols(), 5);
    model.zero_grad(&s).unwrap();
    model.backward_full(&s, &block, r.clone()).unwrap();
    let full_loss = |m: &mut Model| -> f64 {
        let out = m.forward_full(&s, &block, &x, ctx).unwrap();
        m.clear_caches();
        out.as_slice()
            .iter()
            .zip(r.as_slice())
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum()
    };
    let eps = 1e-3f32;
    let tol = |a: f64, n: f64| (a - n).abs() <= 2e-2 * n.abs().max(a.abs()) + 2e-3;
    let l0 = full_loss(&mut model);
    let grads: Vec<Tensor> = model.params().iter().map(|p| p.grad.clone()).collect();
    for (pi, g) in grads.iter().enumerate() {
        let name = model.params()[pi].name.clone();
        for i in 0..g.len() {
            let orig = model.params()[pi].value.as_slice()[i];
            model.params_mut()[pi].value.as_mut_slice()[i] = orig + eps;
            let lp = full_loss(&mut model);
            model.params_mut()[pi].value.as_mut_slice()[i] = orig - eps;
            let lm = full_loss(&mut model);
            model.params_mut()[pi].value.as_mut_slice()[i] = orig;
            let e = eps as f64;
            let central = (lp - lm) / (2.0 * e);
            // A ReLU kink between `orig - eps` and `orig + eps` bends the central difference;
            // the one-sided difference on the kink-free side still follows the gradient.
            let (left, right) = ((l0 - lm) / e, (lp - l0) / e);
            let ana = g.as_slice()[i] as f64;
            assert!(
                tol(ana, central) || tol(ana, left) || tol(ana, right),
                "{kind} {} layers: d/d{name}[{i}]: analytic {ana} vs numeric {central} \
                 (left {left}, right {right})",
                model.num_layers()
            );
        }
    }
}

#[test]
fn whole_deep_models_with_and_without_residual() {
    for kind in [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat] {
        for widths in [&[4, 4][..], &[5, 5, 3][..]] {
            for residual in [false, true] {
                check_whole_model(deep_config(kind, widths, residual, 0.2));
            }
        }
    }
}

#[test]
fn residual_projections_are_parameters_and_shallow_residual_models_are_refused() {
    let cfg = deep_config(ModelKind::Gat, &[4, 4, 3], true, 0.0);
    let m = Model::new(cfg.clone()).unwrap();
    let res: Vec<&Param> = m
        .params()
        .iter()
        .filter(|p| p.name.ends_with("res.weight"))
        .collect();
    assert_eq!(res.len(), 1, "only layer 2 (8 -> 6 wide) projects");
    assert_eq!(res[0].name, "layers.2.res.weight");
    assert_eq!(res[0].value.shape(), (8, 6));
    let plain = Model::new(ModelConfig {
        residual: false,
        ..cfg.clone()
    })
    .unwrap();
    assert!(!cfg.same_architecture(plain.config()));
    assert_eq!(plain.params().len() + 1, m.params().len());
    let mut shallow = small_config(ModelKind::Gcn, 0.0);
    shallow.residual = true;
    let err = Model::new(shallow).unwrap_err().to_string();
    assert!(err.contains("at least 3 layers"), "{err}");
    let mut miscounted = deep_config(ModelKind::Sage, &[4, 4], false, 0.0);
    miscounted.hidden_sizes = vec![4];
    let err = Model::new(miscounted).unwrap_err().to_string();
    assert!(err.contains("1 hidden widths for a 3-layer model"), "{err}");
    // A config saved before per-layer widths and residuals existed still loads.
    let old = r#"{"kind":"gcn","in_dim":6,"hidden":4,"out_dim":3,"layers":2,"heads":1,
        "out_heads":1,"dropout":0.5,"attn_dropout":0.0,"seed":1}"#;
    let old: ModelConfig = serde_json::from_str(old).unwrap();
    assert!(!old.residual && old.hidden_sizes.is_empty());
    assert!(!serde_json::to_string(&old).unwrap().contains("residual"));
}

#[test]
fn init_depends_only_on_seed() {
    let cfg = ModelConfig::paper_defaults(ModelKind::Gat, 10, 3, 9);
    let s = Stream::cpu(1).unwrap();
    let digest = |m: &Model| m.weights_digest(&s).unwrap();
    let a = Model::new(cfg.clone()).unwrap();
    let b = Model::new(cfg.clone()).unwrap();
    assert_eq!(digest(&a), digest(&b));
    let c = Model::new(ModelConfig { seed: 10, ..cfg }).unwrap();
    assert_ne!(digest(&a), digest(&c));
}

/// GraphSAGE layers that widen or keep the width aggregate first (`(Ā X) W_l`): their
/// gradients, with dropout, on a block with halo rows; a narrowing one transforms first.
#[test]
fn sage_layers_that_do_not_narrow_aggregate_first() {
    let cfg = deep_config(ModelKind::Sage, &[8, 8], false, 0.3);
    for layer in 0..cfg.layers {
        check_layer_of(cfg.clone(), layer, false);
    }
    check_layer_of(cfg, 0, true);
}

/// What an aggregate-first GraphSAGE layer keeps for backward: the aggregated rows and the
/// inner input rows, not the halo rows, whether its input was
/// owned or borrowed; a narrowing layer keeps every input row.
#[test]
fn aggregate_first_sage_layers_keep_no_halo_rows() {
    let s = stream();
    let graph = small_graph();
    let block = Block::build(&graph, &[1, 2, 3, 5, 8], Aggregation::Mean).unwrap();
    let (n_in, n_out) = (block.n_in(), block.n_out());
    assert!(n_in > n_out);
    let ctx = StepCtx {
        epoch: 1,
        train: true,
    };
    for dropout in [0.0, 0.3] {
        let mut model = small_model(deep_config(ModelKind::Sage, &[8, 8], false, dropout));
        let x = LayerInput::Dense(rand_tensor(n_in, 6, 3));
        for owned in [false, true] {
            let input = if owned {
                Cow::Owned(x.clone())
            } else {
                Cow::Borrowed(&x)
            };
            model.forward_layer(&s, 0, &block, input, ctx).unwrap();
            let Some(Cache::Sage(c)) = &model.caches[0] else {
                panic!("a training forward keeps a cache")
            };
            let sage::Saved::Aggregated { mean, inner } = &c.saved else {
                panic!("a widening layer aggregates first")
            };
            assert_eq!((mean.rows(), inner.rows()), (n_out, n_out));
            assert_eq!(mean.cols(), 6);
            assert_eq!(inner.host("test").unwrap().len(), n_out * 6);
        }
        let h = LayerInput::Dense(rand_tensor(n_in, 8, 4));
        model
            .forward_layer(&s, 2, &block, Cow::Borrowed(&h), ctx)
            .unwrap();
        let Some(Cache::Sage(c)) = &model.caches[2] else {
            panic!("a training forward keeps a cache")
        };
        assert!(matches!(&c.saved, sage::Saved::Input(x) if x.rows() == n_in));
    }
}
