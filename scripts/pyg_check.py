#!/usr/bin/env python3
"""Reproduce a Trellis model's logits from its safetensors file with numpy alone.

Usage: pyg_check.py MODEL.safetensors DATA_DIR TRELLIS_LOGITS.npy

Reads the tensors by their PyTorch Geometric names (conv1.lin.weight [out, in], ...), computes
the PyG modules' forward passes (GCNConv, SAGEConv with mean aggregation, GATConv) in float64
over the data folder's edge_index.npy and x.npy, for any number of layers, with Trellis's
residual connections (`trellis.model_config` "residual": hidden layers after the first add
their input after the activation, through `convN.res.weight` where the widths differ), and
prints the largest absolute difference to
the logits Trellis wrote. Exits 1 if it exceeds 1e-5.
"""
import json
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def graph(edge_index, n):
    """Symmetrised, deduplicated edges without self loops: (dst, src) rows, sorted."""
    src, dst = edge_index[0].astype(np.int64), edge_index[1].astype(np.int64)
    a = np.concatenate([src, dst])
    b = np.concatenate([dst, src])
    keep = a != b
    pairs = np.unique(np.stack([a[keep], b[keep]], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]  # row i, neighbour j


def gcn_layer(x, t, p, rows, cols, n):
    w, b = t[p + "lin.weight"].astype(np.float64), t[p + "bias"].astype(np.float64)
    deg = np.bincount(rows, minlength=n).astype(np.float64) + 1.0
    z = x @ w.T
    out = z / deg[:, None]  # self loop: 1 / sqrt(d_i d_i)
    norm = 1.0 / np.sqrt(deg[rows] * deg[cols])
    np.add.at(out, rows, norm[:, None] * z[cols])
    return out + b


def sage_layer(x, t, p, rows, cols, n):
    wl = t[p + "lin_l.weight"].astype(np.float64)
    bl = t[p + "lin_l.bias"].astype(np.float64)
    wr = t[p + "lin_r.weight"].astype(np.float64)
    deg = np.bincount(rows, minlength=n).astype(np.float64)
    agg = np.zeros((n, x.shape[1]))
    np.add.at(agg, rows, x[cols])
    agg = agg / np.maximum(deg, 1.0)[:, None]
    return agg @ wl.T + bl + x @ wr.T


def gat_layer(x, t, p, rows, cols, n, concat):
    w = t[p + "lin.weight"].astype(np.float64)
    att_src = t[p + "att_src"].astype(np.float64)[0]  # [H, D]
    att_dst = t[p + "att_dst"].astype(np.float64)[0]
    bias = t[p + "bias"].astype(np.float64)
    heads, d = att_src.shape
    xw = (x @ w.T).reshape(n, heads, d)
    a_src = (xw * att_src).sum(-1)  # [N, H]
    a_dst = (xw * att_dst).sum(-1)
    loops = np.arange(n)
    r = np.concatenate([rows, loops])
    c = np.concatenate([cols, loops])
    e = a_dst[r] + a_src[c]
    e = np.where(e > 0, e, 0.2 * e)
    emax = np.full((n, heads), -np.inf)
    np.maximum.at(emax, r, e)
    ex = np.exp(e - emax[r])
    den = np.zeros((n, heads))
    np.add.at(den, r, ex)
    alpha = ex / den[r]
    out = np.zeros((n, heads, d))
    np.add.at(out, r, alpha[:, :, None] * xw[c])
    out = out.reshape(n, heads * d) if concat else out.mean(axis=1)
    return out + bias


def main():
    model_path, data_dir, logits_path = sys.argv[1:4]
    tensors = load_file(model_path)
    with safe_open(model_path, framework="np") as f:
        meta = f.metadata()
    kind = meta["trellis.model_kind"]
    config = json.loads(meta["trellis.model_config"])
    layers = config["layers"]
    residual = config.get("residual", False)
    x = np.load(f"{data_dir}/x.npy").astype(np.float64)
    n = x.shape[0]
    if meta["trellis.normalize_features"] == "true":
        s = x.sum(axis=1, keepdims=True)
        x = np.where(s != 0, x / np.where(s != 0, s, 1.0), x)
    rows, cols = graph(np.load(f"{data_dir}/edge_index.npy"), n)
    h = x
    for l in range(layers):
        p = f"conv{l + 1}."
        last = l + 1 == layers
        h_in = h
        if kind == "gcn":
            h = gcn_layer(h, tensors, p, rows, cols, n)
        elif kind == "sage":
            h = sage_layer(h, tensors, p, rows, cols, n)
        elif kind == "gat":
            h = gat_layer(h, tensors, p, rows, cols, n, concat=not last)
        else:
            sys.exit(f"unknown model kind {kind}")
        if not last:
            h = np.maximum(h, 0.0) if kind != "gat" else np.where(h > 0, h, np.expm1(h))
            if residual and l > 0:
                res = tensors.get(p + "res.weight")
                h = h + (h_in if res is None else h_in @ res.astype(np.float64).T)
    ours = np.load(logits_path)
    if ours.shape != h.shape:
        sys.exit(f"shape {ours.shape} vs numpy {h.shape}")
    diff = float(np.abs(ours.astype(np.float64) - h).max())
    print(f"{kind}: {n} x {h.shape[1]} logits, max |trellis - numpy| = {diff:.3e}")
    sys.exit(0 if diff <= 1e-5 else 1)


if __name__ == "__main__":
    main()
