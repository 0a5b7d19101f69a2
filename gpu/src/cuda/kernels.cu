// Every CUDA kernel of Trellis. Compiled once per device context with NVRTC (see context.rs),
// after the prelude and philox.cuh that source.rs puts in front of it. Launch code:
// gpu/src/cuda/launch.rs (one Rust function per kernel, with the grid it needs).
//
// Conventions, relied on by the launch code:
// - Every kernel is a grid-stride loop over its work items, so any grid of at least one block
//   covers any size; the launcher never launches for zero items (a zero grid is an error).
// - Element offsets are 64-bit (u64): rows x width may exceed 2^32. Node ids and column
//   indices are u32, CSR row pointers are u64.
// - The module is compiled with --fmad=false: a * b + c is rounded twice, as in Rust (which
//   never contracts), so kernels that sum in the CPU backend's order give its exact bits.
// - Index operands are validated on the host before launch (the op API checks shapes and
//   index bounds), so kernels do not re-check them.

typedef unsigned int u32;
typedef unsigned long long u64;

#define GRID_LOOP(i, n)                                                                     \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n);                  \
         i += (u64)blockDim.x * gridDim.x)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ------------------------------------------------------------------------------------------
// Sparse: SpMM, SDDMM, edge softmax
// ------------------------------------------------------------------------------------------

#define SPMM_WARP 32
#define SPMM_COLS_PER_LANE 8

// out[row, c] (+)= sum_e w(e, c) * x[col(e), c] over the entries e of `row`, in CSR order.
// One warp per row (grid-stride over rows); lane l owns columns base + l + 32 t, t < 8, so the
// x loads of a warp are coalesced. mode 0: w = 1 (plain sum); 1: w = weights[e];
// 2: w = weights[e * heads + c / (width / heads)]. accumulate != 0 adds into out.
extern "C" __global__ void trellis_spmm(const u64* indptr, const u32* indices,
                                        const float* weights, int mode, u32 heads, u64 n_rows,
                                        const float* x, u64 width, float* out, int accumulate) {
    const u64 warps_per_block = blockDim.x / SPMM_WARP;
    const u64 lane = threadIdx.x % SPMM_WARP;
    const u64 d = width / heads;
    for (u64 row = (u64)blockIdx.x * warps_per_block + threadIdx.x / SPMM_WARP; row < n_rows;
         row += (u64)gridDim.x * warps_per_block) {
        const u64 e0 = indptr[row];
        const u64 e1 = indptr[row + 1];
        float* orow = out + row * width;
        for (u64 base = 0; base < width; base += SPMM_WARP * SPMM_COLS_PER_LANE) {
            float acc[SPMM_COLS_PER_LANE];
            u64 head[SPMM_COLS_PER_LANE];
#pragma unroll
            for (int t = 0; t < SPMM_COLS_PER_LANE; ++t) {
                const u64 c = base + lane + SPMM_WARP * t;
                acc[t] = 0.0f;
                head[t] = (mode == 2 && c < width) ? c / d : 0;
            }
            for (u64 e = e0; e < e1; ++e) {
                const float* xr = x + (u64)indices[e] * width;
                const float we = mode == 1 ? weights[e] : 1.0f;
#pragma unroll
                for (int t = 0; t < SPMM_COLS_PER_LANE; ++t) {
                    const u64 c = base + lane + SPMM_WARP * t;
                    if (c < width) {
                        if (mode == 0) {
                            acc[t] += xr[c];
                        } else if (mode == 1) {
                            acc[t] += we * xr[c];
                        } else {
                            acc[t] += weights[e * heads + head[t]] * xr[c];
                        }
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < SPMM_COLS_PER_LANE; ++t) {
                const u64 c = base + lane + SPMM_WARP * t;
                if (c < width) {
                    orow[c] = accumulate ? orow[c] + acc[t] : acc[t];
                }
            }
        }
    }
}

// out[e * heads + h] = <a[row(e), h-block], b[col(e), h-block]>, one thread per (entry, head),
// summed in the CPU backend's order (8 strided partial sums combined as
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the tail in order).
extern "C" __global__ void trellis_sddmm_dot(const u32* entry_rows, const u32* indices, u64 nnz,
                                             u32 heads, const float* a, const float* b,
                                             u64 width, float* out) {
    const u64 d = width / heads;
    GRID_LOOP(i, nnz * heads) {
        const u64 e = i / heads;
        const u64 h = i % heads;
        const float* x = a + (u64)entry_rows[e] * width + h * d;
        const float* y = b + (u64)indices[e] * width + h * d;
        float l[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        const u64 whole = d / 8 * 8;
        for (u64 t = 0; t < whole; t += 8) {
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                l[q] += x[t + q] * y[t + q];
            }
        }
        float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        for (u64 t = whole; t < d; ++t) {
            s += x[t] * y[t];
        }
        out[i] = s;
    }
}

// out[e * heads + h] = left[row(e) * heads + h] + right[col(e) * heads + h].
extern "C" __global__ void trellis_sddmm_add(const u32* entry_rows, const u32* indices, u64 nnz,
                                             u32 heads, const float* left, const float* right,
                                             float* out) {
    GRID_LOOP(i, nnz * heads) {
        const u64 e = i / heads;
        const u64 h = i % heads;
        out[i] = left[(u64)entry_rows[e] * heads + h] + right[(u64)indices[e] * heads + h];
    }
}

// Softmax over each row's entries, per head; one thread per (row, head), CPU order.
extern "C" __global__ void trellis_edge_softmax(const u64* indptr, u64 n_rows, u32 heads,
                                                const float* scores, float* out) {
    GRID_LOOP(i, n_rows * heads) {
        const u64 row = i / heads;
        const u64 h = i % heads;
        const u64 e0 = indptr[row];
        const u64 e1 = indptr[row + 1];
        float mx = neg_inf();
        for (u64 e = e0; e < e1; ++e) {
            mx = fmaxf(mx, scores[e * heads + h]);
        }
        float sum = 0.0f;
        for (u64 e = e0; e < e1; ++e) {
            const float v = expf(scores[e * heads + h] - mx);
            out[e * heads + h] = v;
            sum += v;
        }
        const float inv = 1.0f / sum;
        for (u64 e = e0; e < e1; ++e) {
            out[e * heads + h] *= inv;
        }
    }
}

// out = alpha * (grad - sum_row(alpha * grad)), per row and head.
extern "C" __global__ void trellis_edge_softmax_backward(const u64* indptr, u64 n_rows,
                                                         u32 heads, const float* alpha,
                                                         const float* grad, float* out) {
    GRID_LOOP(i, n_rows * heads) {
        const u64 row = i / heads;
        const u64 h = i % heads;
        const u64 e0 = indptr[row];
        const u64 e1 = indptr[row + 1];
        float dot = 0.0f;
        for (u64 e = e0; e < e1; ++e) {
            dot += alpha[e * heads + h] * grad[e * heads + h];
        }
        for (u64 e = e0; e < e1; ++e) {
            const u64 k = e * heads + h;
            out[k] = alpha[k] * (grad[k] - dot);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Rows: gather, deterministic scatter-add
// ------------------------------------------------------------------------------------------

// out[r, c] = x[idx[r], c].
extern "C" __global__ void trellis_gather_rows(const float* x, u64 width, const u32* idx,
                                               u64 n_idx, float* out) {
    GRID_LOOP(i, n_idx * width) {
        const u64 r = i / width;
        const u64 c = i % width;
        out[i] = x[(u64)idx[r] * width + c];
    }
}

// out[targets[g], c] += src[order[k], c] for k in group_ptr[g]..group_ptr[g + 1], in ascending
// k (the plan lists each target's source rows in ascending order), one thread per (target,
// column): the CPU backend's order, with no atomics, so the bits are deterministic.
extern "C" __global__ void trellis_scatter_add_rows(const float* src, u64 width,
                                                    const u32* targets, const u64* group_ptr,
                                                    const u32* order, u64 n_groups, float* out) {
    GRID_LOOP(i, n_groups * width) {
        const u64 g = i / width;
        const u64 c = i % width;
        float* o = out + (u64)targets[g] * width + c;
        float acc = *o;
        for (u64 k = group_ptr[g]; k < group_ptr[g + 1]; ++k) {
            acc += src[(u64)order[k] * width + c];
        }
        *o = acc;
    }
}

// ------------------------------------------------------------------------------------------
// Dense elementwise
// ------------------------------------------------------------------------------------------

// x[r, c] += bias[c].
extern "C" __global__ void trellis_add_bias(float* x, u64 n, const float* bias, u64 width) {
    GRID_LOOP(i, n) { x[i] += bias[i % width]; }
}

// partial[b, c] = sum of g[r, c] over rows r of block b (block_rows rows), in row order.
extern "C" __global__ void trellis_column_sums_partial(const float* g, u64 rows, u64 width,
                                                       u64 block_rows, float* partial) {
    const u64 n_blocks = (rows + block_rows - 1) / block_rows;
    GRID_LOOP(i, n_blocks * width) {
        const u64 b = i / width;
        const u64 c = i % width;
        const u64 r1 = (b + 1) * block_rows < rows ? (b + 1) * block_rows : rows;
        float acc = 0.0f;
        for (u64 r = b * block_rows; r < r1; ++r) {
            acc += g[r * width + c];
        }
        partial[i] = acc;
    }
}

// out[c] += sum over blocks b (in order) of partial[b, c].
extern "C" __global__ void trellis_column_sums_finish(const float* partial, u64 n_blocks,
                                                      u64 width, float* out) {
    GRID_LOOP(c, width) {
        float s = partial[c];
        for (u64 b = 1; b < n_blocks; ++b) {
            s += partial[b * width + c];
        }
        out[c] += s;
    }
}

// Activation kinds: 0 identity, 1 ReLU, 2 ELU(param = alpha), 3 leaky ReLU(param = slope).
__device__ __forceinline__ float act_apply(int kind, float param, float x) {
    switch (kind) {
    case 1: return fmaxf(x, 0.0f);
    case 2: return x > 0.0f ? x : param * expm1f(x);
    case 3: return x > 0.0f ? x : param * x;
    default: return x;
    }
}

__device__ __forceinline__ float act_derivative(int kind, float param, float x) {
    switch (kind) {
    case 1: return x > 0.0f ? 1.0f : 0.0f;
    case 2: return x > 0.0f ? 1.0f : param * expf(x);
    case 3: return x > 0.0f ? 1.0f : param;
    default: return 1.0f;
    }
}

__device__ __forceinline__ float act_derivative_from_output(int kind, float param, float y) {
    switch (kind) {
    case 1: return y > 0.0f ? 1.0f : 0.0f;
    case 2: return y > 0.0f ? 1.0f : y + param;
    case 3: return y > 0.0f ? 1.0f : param;
    default: return 1.0f;
    }
}

// y = act(x).
extern "C" __global__ void trellis_activation(int kind, float param, const float* x, float* y,
                                              u64 n) {
    GRID_LOOP(i, n) { y[i] = act_apply(kind, param, x[i]); }
}

// x = act(x).
extern "C" __global__ void trellis_activate_inplace(int kind, float param, float* x, u64 n) {
    GRID_LOOP(i, n) { x[i] = act_apply(kind, param, x[i]); }
}

// gx = gy * act'(x).
extern "C" __global__ void trellis_activation_backward(int kind, float param, const float* x,
                                                       const float* gy, float* gx, u64 n) {
    GRID_LOOP(i, n) { gx[i] = gy[i] * act_derivative(kind, param, x[i]); }
}

// gy *= act'(x) taken from the output y = act(x).
extern "C" __global__ void trellis_activation_backward_from_output(int kind, float param,
                                                                   const float* y, float* gy,
                                                                   u64 n) {
    GRID_LOOP(i, n) { gy[i] *= act_derivative_from_output(kind, param, y[i]); }
}

// bits[w] bit k = (y[64 w + k] > 0).
extern "C" __global__ void trellis_positive_bits(const float* y, u64 n, u64* bits, u64 n_words) {
    GRID_LOOP(w, n_words) {
        u64 word = 0;
        for (u64 k = 0; k < 64; ++k) {
            const u64 i = w * 64 + k;
            if (i < n && y[i] > 0.0f) {
                word |= 1ull << k;
            }
        }
        bits[w] = word;
    }
}

// g[i] = 0 where bit i of bits is clear.
extern "C" __global__ void trellis_mask_by_bits(const u64* bits, float* g, u64 n) {
    GRID_LOOP(i, n) {
        if (((bits[i / 64] >> (i % 64)) & 1ull) == 0) {
            g[i] = 0.0f;
        }
    }
}

// y += alpha * x.
extern "C" __global__ void trellis_axpy(float alpha, const float* x, float* y, u64 n) {
    GRID_LOOP(i, n) { y[i] += alpha * x[i]; }
}

// ------------------------------------------------------------------------------------------
// Dropout (Philox4x32-10 keyed as gpu/src/rng.rs: masks equal the CPU backend's)
// ------------------------------------------------------------------------------------------

// Dense: one thread per (row, block of 8 columns); row r uses global id gids[r].
extern "C" __global__ void trellis_dropout(float* x, u64 n_rows, u64 width, const u32* gids,
                                           u64 seed, u32 epoch, u32 layer_site, u32 threshold,
                                           float scale) {
    const u64 n_blocks = (width + 7) / 8;
    GRID_LOOP(i, n_rows * n_blocks) {
        const u64 r = i / n_blocks;
        const u64 b = i % n_blocks;
        const u64 c0 = b * 8;
        const u64 c1 = c0 + 8 < width ? c0 + 8 : width;
        float* row = x + r * width;
        const trellis_u32x4 u = trellis_dropout_block(seed, epoch, layer_site, gids[r], (u32)b);
        for (u64 c = c0; c < c1; ++c) {
            row[c] = trellis_drop(row[c], trellis_draw16(u, (u32)(c - c0)), threshold, scale);
        }
    }
}

// Stored values of a CSR matrix: entry (r, c) uses the draw of (gids[r], column c).
extern "C" __global__ void trellis_dropout_csr(const u32* entry_rows, const u32* indices,
                                               float* vals, u64 nnz, const u32* gids, u64 seed,
                                               u32 epoch, u32 layer_site, u32 threshold,
                                               float scale) {
    GRID_LOOP(e, nnz) {
        const u32 c = indices[e];
        const trellis_u32x4 u =
            trellis_dropout_block(seed, epoch, layer_site, gids[entry_rows[e]], c / 8);
        vals[e] = trellis_drop(vals[e], trellis_draw16(u, c % 8), threshold, scale);
    }
}

// Per-entry values (heads per entry): value k of row r's segment uses the draw of (gids[r], k).
extern "C" __global__ void trellis_edge_dropout(const u32* entry_rows, const u64* indptr,
                                                float* vals, u64 nnz, u32 heads, const u32* gids,
                                                u64 seed, u32 epoch, u32 layer_site,
                                                u32 threshold, float scale) {
    GRID_LOOP(i, nnz * heads) {
        const u32 r = entry_rows[i / heads];
        const u64 k = i - indptr[r] * heads;
        const trellis_u32x4 u =
            trellis_dropout_block(seed, epoch, layer_site, gids[r], (u32)(k / 8));
        vals[i] = trellis_drop(vals[i], trellis_draw16(u, (u32)(k % 8)), threshold, scale);
    }
}

// ------------------------------------------------------------------------------------------
// Loss and accuracy
// ------------------------------------------------------------------------------------------

// Index of the first maximum of z[0..classes] (NaNs never win), as the CPU's argmax.
__device__ __forceinline__ u64 argmax_row(const float* z, u64 classes, float* mx_out) {
    float mx = neg_inf();
    u64 arg = 0;
    for (u64 j = 0; j < classes; ++j) {
        if (z[j] > mx) {
            mx = z[j];
            arg = j;
        }
    }
    *mx_out = mx;
    return arg;
}

// Per row r: if times[r] > 0 (how often r is selected), row_loss[r] = logsumexp(z) - z[label]
// (f64), row_hit[r] = (argmax == label), grad row = scale * times * (softmax - onehot); else a
// zero gradient row. The host sums row_loss over the selected rows in their order.
extern "C" __global__ void trellis_softmax_nll(const float* logits, u64 n, u64 classes,
                                               const u32* labels, const u32* times, float scale,
                                               float* grad, double* row_loss, u32* row_hit) {
    GRID_LOOP(r, n) {
        const float* z = logits + r * classes;
        float* g = grad + r * classes;
        if (times[r] == 0) {
            for (u64 j = 0; j < classes; ++j) {
                g[j] = 0.0f;
            }
            row_loss[r] = 0.0;
            row_hit[r] = 0;
            continue;
        }
        float mx;
        const u64 arg = argmax_row(z, classes, &mx);
        double s = 0.0;
        for (u64 j = 0; j < classes; ++j) {
            s += exp((double)(z[j] - mx));
        }
        const double lse = (double)mx + log(s);
        const u64 y = labels[r];
        row_loss[r] = lse - (double)z[y];
        row_hit[r] = arg == y ? 1u : 0u;
        const float sc = scale * (float)times[r];
        for (u64 j = 0; j < classes; ++j) {
            const float p = (float)exp((double)z[j] - lse);
            g[j] = sc * (p - (j == y ? 1.0f : 0.0f));
        }
    }
}

// *count += number of rows[k] whose argmax equals its label.
extern "C" __global__ void trellis_accuracy_count(const float* logits, u64 classes,
                                                  const u32* labels, const u32* rows, u64 n_sel,
                                                  u32* count) {
    GRID_LOOP(k, n_sel) {
        const u64 r = rows[k];
        float mx;
        if (argmax_row(logits + r * classes, classes, &mx) == labels[r]) {
            atomicAdd(count, 1u);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Optimizers (the host computes step = lr / (1 - beta1^t) and sqrt(1 - beta2^t) in f64)
// ------------------------------------------------------------------------------------------

extern "C" __global__ void trellis_adam(float* p, const float* g, float* m, float* v, u64 n,
                                        float step, float bc2_sqrt, float beta1, float beta2,
                                        float eps, float weight_decay) {
    GRID_LOOP(i, n) {
        const float gi = g[i] + weight_decay * p[i];
        m[i] = beta1 * m[i] + (1.0f - beta1) * gi;
        v[i] = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        const float denom = sqrtf(v[i]) / bc2_sqrt + eps;
        p[i] -= step * m[i] / denom;
    }
}

extern "C" __global__ void trellis_sgd(float* p, const float* g, float* buf, u64 n, float lr,
                                       float momentum, float weight_decay) {
    GRID_LOOP(i, n) {
        const float gi = g[i] + weight_decay * p[i];
        buf[i] = momentum != 0.0f ? momentum * buf[i] + gi : gi;
        p[i] -= lr * buf[i];
    }
}
