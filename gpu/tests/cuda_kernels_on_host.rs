//! The CUDA kernels executed on the host, against the CPU backend — without a GPU.
//!
//! `kernels.cu` uses no shared memory, no warp intrinsics and no barriers, so running every
//! (block, thread) of a launch one after another is an exact emulation of it. This test
//! compiles the very source NVRTC compiles (`kernel_source::device_source`) with the host C++
//! compiler, with the few CUDA built-ins it uses defined for the host, launches the kernels on
//! small grids (2-3 blocks of 64 threads, so every grid-stride loop wraps) over inputs with
//! awkward sizes, and compares the results with the CPU backend: bit for bit where the kernel
//! sums in the CPU's order, within 1e-5 relative otherwise. It checks index arithmetic, bounds
//! and summation order; what only a GPU can check (launch limits, memory model, NVRTC itself)
//! is left to `tests/backends.rs` on a GPU machine.
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::Command;
use trellis_gpu::bench::{random_csr, random_tensor};
use trellis_gpu::kernel_source::device_source;
use trellis_gpu::rng::{dropout_scale, dropout_threshold};
use trellis_gpu::{cpu, AdamConfig, Csr, DropoutKey};

const STUBS: &str = r#"
#include <math.h>
#include <string.h>
#include <stdio.h>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
struct trellis_dim3 { unsigned int x, y, z; };
static trellis_dim3 blockIdx, blockDim, threadIdx, gridDim;
static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    unsigned int o = *p; *p += v; return o;
}
"#;

const LAUNCH: &str = r#"
// Runs every thread of a grid x block launch in turn.
template <class F> static void launch(unsigned grid, unsigned block, F f) {
    gridDim.x = grid; blockDim.x = block; gridDim.y = gridDim.z = blockDim.y = blockDim.z = 1;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) { blockIdx.x = b; threadIdx.x = t; f(); }
}
template <class T> static void print_bits(const std::vector<T>& v, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (sizeof(T) == 4) { unsigned int b; memcpy(&b, &v[i], 4); printf("%u ", b); }
        else { unsigned long long b; memcpy(&b, &v[i], 8); printf("%llu ", b); }
    }
    printf("\n");
}
"#;

/// A host program: arrays, launches, printed outputs.
#[derive(Default)]
struct Prog {
    body: String,
}

impl Prog {
    fn f32s(&mut self, name: &str, v: &[f32]) -> &mut Self {
        let bits: Vec<String> = v.iter().map(|x| x.to_bits().to_string()).collect();
        let _ = writeln!(
            self.body,
            "std::vector<unsigned int> {name}_b = {{{}}}; std::vector<float> {name}({}); \
             memcpy({name}.data(), {name}_b.data(), 4 * {});",
            bits.join(","),
            v.len().max(1),
            v.len()
        );
        self
    }
    fn ints(&mut self, ty: &str, name: &str, v: &[u64]) -> &mut Self {
        let s: Vec<String> = v.iter().map(|x| format!("{x}ull")).collect();
        let _ = writeln!(
            self.body,
            "std::vector<{ty}> {name}({}); {{ unsigned long long src[] = {{{}0}}; \
             for (size_t i = 0; i < {}; ++i) {name}[i] = ({ty})src[i]; }}",
            v.len().max(1),
            s.iter().map(|x| format!("{x},")).collect::<String>(),
            v.len()
        );
        self
    }
    fn u32s(&mut self, name: &str, v: &[u32]) -> &mut Self {
        self.ints(
            "u32",
            name,
            &v.iter().map(|&x| x as u64).collect::<Vec<_>>(),
        )
    }
    fn u64s(&mut self, name: &str, v: &[u64]) -> &mut Self {
        self.ints("u64", name, v)
    }
    fn zeros(&mut self, ty: &str, name: &str, n: usize) -> &mut Self {
        let _ = writeln!(self.body, "std::vector<{ty}> {name}({}, 0);", n.max(1));
        self
    }
    /// `grid` blocks of 64 threads; `call` uses the arrays' `.data()`.
    fn launch(&mut self, grid: u32, call: &str) -> &mut Self {
        let _ = writeln!(self.body, "launch({grid}, 64, [&] {{ {call}; }});");
        self
    }
    fn print(&mut self, name: &str, n: usize) -> &mut Self {
        let _ = writeln!(self.body, "print_bits({name}, {n});");
        self
    }
    /// Compiles and runs; one line of numbers per printed array. `Err` if no compiler.
    fn run(&self, tag: &str) -> Result<Vec<Vec<u64>>, String> {
        let dir =
            std::env::temp_dir().join(format!("trellis-kernels-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let (src, exe) = (dir.join("k.cpp"), dir.join("k"));
        let text = format!(
            "{STUBS}\n{}\n{LAUNCH}\nint main() {{\n{}\nreturn 0;\n}}\n",
            device_source(),
            self.body
        );
        std::fs::write(&src, text).map_err(|e| e.to_string())?;
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-O1", "-std=c++17", "-ffp-contract=off", "-w", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .map_err(|e| format!("no C++ compiler ({cxx}): {e}"))?;
        assert!(
            out.status.success(),
            "kernels.cu does not compile for the host:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let run = Command::new(&exe).output().unwrap();
        assert!(run.status.success(), "kernel program failed");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(String::from_utf8(run.stdout)
            .unwrap()
            .lines()
            .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
            .collect())
    }
}

fn skip(why: &str) {
    let msg = format!("SKIPPED kernels on host: {why}\n");
    let _ = std::io::stderr().lock().write_all(msg.as_bytes());
}

fn f32s(bits: &[u64]) -> Vec<f32> {
    bits.iter().map(|&b| f32::from_bits(b as u32)).collect()
}

#[track_caller]
fn same_bits(what: &str, got: &[u64], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, w)) in got.iter().zip(want).enumerate() {
        let g = f32::from_bits(g as u32);
        assert!(
            g == *w || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

#[track_caller]
fn close(what: &str, got: &[u64], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in f32s(got).iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// CSR arrays as the device holds them: u64 row pointers and each entry's row.
fn device_csr(p: &mut Prog, tag: &str, m: &Csr) {
    let indptr: Vec<u64> = m.indptr().iter().map(|&x| x as u64).collect();
    let mut rows = Vec::new();
    for r in 0..m.n_rows() {
        rows.extend(std::iter::repeat_n(r as u32, m.degree(r)));
    }
    p.u64s(&format!("{tag}_indptr"), &indptr)
        .u32s(&format!("{tag}_indices"), m.indices())
        .u32s(&format!("{tag}_rows"), &rows)
        .f32s(&format!("{tag}_vals"), m.values().unwrap());
}

#[test]
fn sparse_kernels_match_the_cpu_backend() {
    // 37 x 29 with empty rows; widths across the 32-lane x 8-column SpMM pass.
    for (tag, width, heads) in [
        ("a", 1usize, 1usize),
        ("b", 33, 1),
        ("c", 300, 3),
        ("d", 16, 8),
    ] {
        let m = random_csr(37, 29, 5, 7).unwrap();
        let x = random_tensor(29, width, 8).into_vec();
        let hw = random_tensor(1, m.nnz() * heads, 9).into_vec();
        let a = random_tensor(37, width, 10).into_vec();
        let mut p = Prog::default();
        device_csr(&mut p, "m", &m);
        p.f32s("x", &x).f32s("hw", &hw).f32s("a", &a);
        let (nnz, n) = (m.nnz(), 37 * width);
        for (i, (mode, w)) in [(0, "m_vals"), (1, "m_vals"), (2, "hw")].iter().enumerate() {
            let h = if *mode == 2 { heads } else { 1 };
            let out = ["out0", "out1", "out2"][i];
            p.zeros("float", out, n).launch(
                2,
                &format!(
                    "trellis_spmm(m_indptr.data(), m_indices.data(), {w}.data(), {mode}, {h}, 37, \
                     x.data(), {width}, {out}.data(), 0)"
                ),
            );
            p.print(out, n);
        }
        // Accumulate: out1 (A x, stored weights) += A x once more.
        p.launch(
            3,
            &format!(
                "trellis_spmm(m_indptr.data(), m_indices.data(), m_vals.data(), 1, 1, 37, \
                 x.data(), {width}, out1.data(), 1)"
            ),
        )
        .print("out1", n);
        // SDDMM over a (37 x width) and b = x (29 x width).
        p.zeros("float", "dot", nnz * heads)
            .launch(
                3,
                &format!(
                    "trellis_sddmm_dot(m_rows.data(), m_indices.data(), {nnz}, {heads}, a.data(), \
                     x.data(), {width}, dot.data())"
                ),
            )
            .print("dot", nnz * heads);
        // Edge softmax of the dot products and its backward against hw as the gradient.
        p.zeros("float", "sm", nnz * heads)
            .launch(
                2,
                &format!(
                    "trellis_edge_softmax(m_indptr.data(), 37, {heads}, dot.data(), sm.data())"
                ),
            )
            .print("sm", nnz * heads)
            .zeros("float", "smb", nnz * heads)
            .launch(
                2,
                &format!(
                    "trellis_edge_softmax_backward(m_indptr.data(), 37, {heads}, sm.data(), \
                     hw.data(), smb.data())"
                ),
            )
            .print("smb", nnz * heads);
        let out = match p.run(tag) {
            Ok(o) => o,
            Err(why) => return skip(&why),
        };

        let mut want = vec![0.0f32; n];
        cpu::spmm(&m, None, 1, &x, width, &mut want);
        same_bits(&format!("{tag} spmm ones"), &out[0], &want);
        cpu::spmm(&m, m.values(), 1, &x, width, &mut want);
        same_bits(&format!("{tag} spmm stored"), &out[1], &want);
        let mut per_head = vec![0.0f32; n];
        cpu::spmm(&m, Some(&hw), heads, &x, width, &mut per_head);
        same_bits(&format!("{tag} spmm per head"), &out[2], &per_head);
        let twice: Vec<f32> = want.iter().map(|v| v + v).collect();
        same_bits(&format!("{tag} spmm accumulate"), &out[3], &twice);
        let mut dot = vec![0.0f32; nnz * heads];
        cpu::sddmm_dot(&m, heads, &a, &x, width, &mut dot);
        same_bits(&format!("{tag} sddmm_dot"), &out[4], &dot);
        let mut sm = vec![0.0f32; nnz * heads];
        cpu::edge_softmax(&m, heads, &dot, &mut sm);
        close(&format!("{tag} edge_softmax"), &out[5], &sm);
        let mut smb = vec![0.0f32; nnz * heads];
        cpu::edge_softmax_backward(&m, heads, &f32s(&out[5]), &hw, &mut smb);
        close(&format!("{tag} edge_softmax_backward"), &out[6], &smb);
    }
}

#[test]
fn row_kernels_and_dropout_match_the_cpu_backend() {
    let width = 70;
    let x = random_tensor(23, width, 1).into_vec();
    let idx: Vec<u32> = (0..41).map(|i| ((i * 7 + 3) % 23) as u32).collect();
    let src = random_tensor(41, width, 2).into_vec();
    // The scatter plan: distinct targets ascending, each with its source rows ascending.
    let mut targets: Vec<u32> = idx.clone();
    targets.sort_unstable();
    targets.dedup();
    let mut order = Vec::new();
    let mut group_ptr = vec![0u64];
    for &t in &targets {
        order.extend((0..idx.len() as u32).filter(|&r| idx[r as usize] == t));
        group_ptr.push(order.len() as u64);
    }
    let gids: Vec<u32> = (0..23).map(|i| i * 1000 + 17).collect();
    let key = DropoutKey {
        seed: 0x1234_5678_9abc,
        epoch: 9,
        layer: 1,
        site: 0,
    };
    let p_drop = 0.4f32;
    let (thr, scale, ls) = (
        dropout_threshold(p_drop),
        dropout_scale(p_drop),
        key.counter(0, 0)[1],
    );
    let m = random_csr(23, width, 6, 3).unwrap();
    let heads = 3;
    let ev = random_tensor(1, m.nnz() * heads, 4).into_vec();

    let mut p = Prog::default();
    p.f32s("x", &x).u32s("idx", &idx).f32s("src", &src);
    p.u32s("targets", &targets)
        .u64s("gptr", &group_ptr)
        .u32s("order", &order);
    p.u32s("gids", &gids).f32s("ev", &ev);
    device_csr(&mut p, "m", &m);
    p.zeros("float", "g", 41 * width)
        .launch(
            3,
            &format!("trellis_gather_rows(x.data(), {width}, idx.data(), 41, g.data())"),
        )
        .print("g", 41 * width);
    p.f32s("sc", &x)
        .launch(
            2,
            &format!(
                "trellis_scatter_add_rows(src.data(), {width}, targets.data(), gptr.data(), \
                 order.data(), {}, sc.data())",
                targets.len()
            ),
        )
        .print("sc", 23 * width);
    p.f32s("dx", &x)
        .launch(
            2,
            &format!(
                "trellis_dropout(dx.data(), 23, {width}, gids.data(), {}ull, {}, {ls}, {thr}, \
                 scale_f)",
                key.seed, key.epoch
            ),
        )
        .print("dx", 23 * width);
    p.launch(
        3,
        &format!(
            "trellis_dropout_csr(m_rows.data(), m_indices.data(), m_vals.data(), {}, gids.data(), \
             {}ull, {}, {ls}, {thr}, scale_f)",
            m.nnz(),
            key.seed,
            key.epoch
        ),
    )
    .print("m_vals", m.nnz());
    p.launch(
        2,
        &format!(
            "trellis_edge_dropout(m_rows.data(), m_indptr.data(), ev.data(), {}, {heads}, \
             gids.data(), {}ull, {}, {ls}, {thr}, scale_f)",
            m.nnz(),
            key.seed,
            key.epoch
        ),
    )
    .print("ev", m.nnz() * heads);
    p.body = format!(
        "float scale_f; {{ unsigned int b = {}u; memcpy(&scale_f, &b, 4); }}\n{}",
        scale.to_bits(),
        p.body
    );
    let out = match p.run("rows") {
        Ok(o) => o,
        Err(why) => return skip(&why),
    };

    let mut g = vec![0.0f32; 41 * width];
    cpu::gather_rows(&x, width, &idx, &mut g);
    same_bits("gather_rows", &out[0], &g);
    let mut sc = x.clone();
    cpu::scatter_add_rows(&src, width, &idx, &mut sc);
    same_bits("scatter_add_rows", &out[1], &sc);
    let mut dx = x.clone();
    cpu::dropout(&mut dx, width, &gids, key, p_drop);
    same_bits("dropout", &out[2], &dx);
    let mut mv = m.clone();
    let (ip, ix, vals) = mv.parts_mut();
    cpu::dropout_csr(ip, ix, vals.unwrap(), &gids, key, p_drop);
    same_bits("dropout_csr", &out[3], mv.values().unwrap());
    let mut e = ev.clone();
    cpu::edge_dropout(m.indptr(), &mut e, heads, &gids, key, p_drop);
    same_bits("edge_dropout", &out[4], &e);
}

#[test]
fn dense_loss_and_optimizer_kernels_match_the_cpu_backend() {
    // 2100 rows: column sums span three 1024-row blocks.
    let (rows, width) = (2100usize, 9usize);
    let gm = random_tensor(rows, width, 5).into_vec();
    let (n, classes) = (57usize, 7usize);
    let logits: Vec<f32> = random_tensor(n, classes, 6)
        .as_slice()
        .iter()
        .map(|v| 5.0 * v)
        .collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| i * 5 % classes as u32).collect();
    let sel: Vec<u32> = (0..30).map(|i| (i * 11 % n) as u32).chain([3, 3]).collect();
    let mut times = vec![0u32; n];
    sel.iter().for_each(|&r| times[r as usize] += 1);
    let k = 4099;
    let (pp, pg, pm) = (
        random_tensor(1, k, 7).into_vec(),
        random_tensor(1, k, 8).into_vec(),
        random_tensor(1, k, 9).into_vec(),
    );
    let pv: Vec<f32> = random_tensor(1, k, 10)
        .as_slice()
        .iter()
        .map(|v| v.abs())
        .collect();
    let cfg = AdamConfig {
        lr: 0.01,
        weight_decay: 5e-4,
        ..Default::default()
    };
    let t = 3u64;
    let step = (cfg.lr as f64 / (1.0 - (cfg.beta1 as f64).powi(t as i32))) as f32;
    let bc2 = ((1.0 - (cfg.beta2 as f64).powi(t as i32)).sqrt()) as f32;

    let mut p = Prog::default();
    p.f32s("gm", &gm)
        .zeros("float", "part", 3 * width)
        .f32s("cs", &[0.5; 9]);
    p.launch(
        1,
        &format!("trellis_column_sums_partial(gm.data(), {rows}, {width}, 1024, part.data())"),
    )
    .launch(
        1,
        &format!("trellis_column_sums_finish(part.data(), 3, {width}, cs.data())"),
    )
    .print("cs", width);
    p.f32s("lg", &logits)
        .u32s("labels", &labels)
        .u32s("times", &times)
        .u32s("sel", &sel);
    p.zeros("float", "grad", n * classes)
        .zeros("double", "rl", n)
        .zeros("u32", "hit", n);
    p.launch(
        2,
        &format!(
            "trellis_softmax_nll(lg.data(), {n}, {classes}, labels.data(), times.data(), 0.25f, \
             grad.data(), rl.data(), hit.data())"
        ),
    )
    .print("grad", n * classes)
    .print("rl", n)
    .print("hit", n);
    p.zeros("u32", "count", 1)
        .launch(2, &format!("trellis_accuracy_count(lg.data(), {classes}, labels.data(), sel.data(), {}, count.data())", sel.len()))
        .print("count", 1);
    p.f32s("pp", &pp)
        .f32s("pg", &pg)
        .f32s("pm", &pm)
        .f32s("pv", &pv);
    p.launch(
        3,
        &format!(
            "trellis_adam(pp.data(), pg.data(), pm.data(), pv.data(), {k}, {}f, {}f, {}f, {}f, \
             {}f, {}f)",
            hexf(step),
            hexf(bc2),
            hexf(cfg.beta1),
            hexf(cfg.beta2),
            hexf(cfg.eps),
            hexf(cfg.weight_decay)
        ),
    )
    .print("pp", k)
    .print("pm", k)
    .print("pv", k);
    let out = match p.run("dense") {
        Ok(o) => o,
        Err(why) => return skip(&why),
    };

    let mut cs = vec![0.0f32; width];
    cpu::column_sums(&gm, width, &mut cs);
    let cs: Vec<f32> = cs.iter().map(|s| 0.5 + s).collect();
    same_bits("column sums", &out[0], &cs);
    let mut grad = vec![0.0f32; n * classes];
    let loss = cpu::softmax_nll(&logits, classes, &labels, &sel, 0.25, &mut grad);
    close("softmax_nll grad", &out[1], &grad);
    let rl: Vec<f64> = out[2].iter().map(|&b| f64::from_bits(b)).collect();
    let sum: f64 = sel.iter().map(|&r| rl[r as usize]).sum();
    assert!(
        (sum - loss.loss_sum).abs() <= 1e-9 * loss.loss_sum.abs(),
        "{sum} vs {}",
        loss.loss_sum
    );
    let correct = sel.iter().filter(|&&r| out[3][r as usize] != 0).count();
    assert_eq!(correct, loss.correct);
    assert_eq!(
        out[4][0] as usize,
        cpu::accuracy_count(&logits, classes, &labels, &sel)
    );
    let (mut wp, mut wm, mut wv) = (pp.clone(), pm.clone(), pv.clone());
    cpu::adam_step(&cfg, t, &mut wp, &pg, &mut wm, &mut wv);
    same_bits("adam param", &out[5], &wp);
    same_bits("adam m", &out[6], &wm);
    same_bits("adam v", &out[7], &wv);
}

/// An exact C++ float literal (hex float) for `v`.
fn hexf(v: f32) -> String {
    if v == 0.0 {
        return "0x0p+0".into();
    }
    let bits = v.to_bits();
    let sign = if bits >> 31 == 1 { "-" } else { "" };
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0 {
        format!("{sign}0x0.{:06x}p-126", man << 1)
    } else {
        format!("{sign}0x1.{:06x}p{}", man << 1, exp - 127)
    }
}

#[test]
fn elementwise_kernels_match_the_cpu_backend() {
    use trellis_gpu::{Activation, SgdConfig};
    let (rows, width) = (13usize, 67usize);
    let n = rows * width;
    let x = random_tensor(rows, width, 21).into_vec();
    let gy = random_tensor(rows, width, 22).into_vec();
    let bias = random_tensor(1, width, 23).into_vec();
    let m = random_csr(rows, 11, 4, 24).unwrap();
    let heads = 2;
    let (left, right) = (
        random_tensor(rows, heads, 25).into_vec(),
        random_tensor(11, heads, 26).into_vec(),
    );
    let acts = [
        (0, 0.0f32, Activation::Identity),
        (1, 0.0, Activation::Relu),
        (2, 1.0, Activation::Elu { alpha: 1.0 }),
        (3, 0.2, Activation::LeakyRelu { slope: 0.2 }),
    ];
    let sgd = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 1e-3,
    };

    let mut p = Prog::default();
    p.f32s("x", &x).f32s("gy", &gy).f32s("bias", &bias);
    p.f32s("xb", &x)
        .launch(
            2,
            &format!("trellis_add_bias(xb.data(), {n}, bias.data(), {width})"),
        )
        .print("xb", n);
    for (kind, param, _) in acts {
        let _ = writeln!(
            p.body,
            "{{ std::vector<float> y({n}), yi = x, gx({n}), go = gy; \
             launch(3, 64, [&] {{ trellis_activation({kind}, {}f, x.data(), y.data(), {n}); }}); \
             launch(2, 64, [&] {{ trellis_activate_inplace({kind}, {}f, yi.data(), {n}); }}); \
             launch(2, 64, [&] {{ trellis_activation_backward({kind}, {}f, x.data(), gy.data(), gx.data(), {n}); }}); \
             launch(2, 64, [&] {{ trellis_activation_backward_from_output({kind}, {}f, y.data(), go.data(), {n}); }}); \
             print_bits(y, {n}); print_bits(yi, {n}); print_bits(gx, {n}); print_bits(go, {n}); }}",
            hexf(param),
            hexf(param),
            hexf(param),
            hexf(param)
        );
    }
    let words = n.div_ceil(64);
    p.zeros("u64", "bits", words)
        .launch(
            1,
            &format!("trellis_positive_bits(x.data(), {n}, bits.data(), {words})"),
        )
        .print("bits", words)
        .f32s("gm", &gy)
        .launch(
            2,
            &format!("trellis_mask_by_bits(bits.data(), gm.data(), {n})"),
        )
        .print("gm", n);
    p.f32s("ya", &gy)
        .launch(
            2,
            &format!("trellis_axpy({}f, x.data(), ya.data(), {n})", hexf(-0.3)),
        )
        .print("ya", n);
    p.f32s("sp", &x).f32s(
        "sb",
        &bias.iter().cycle().take(n).copied().collect::<Vec<_>>(),
    );
    p.launch(
        3,
        &format!(
            "trellis_sgd(sp.data(), gy.data(), sb.data(), {n}, {}f, {}f, {}f)",
            hexf(sgd.lr),
            hexf(sgd.momentum),
            hexf(sgd.weight_decay)
        ),
    )
    .print("sp", n)
    .print("sb", n);
    device_csr(&mut p, "m", &m);
    p.f32s("left", &left)
        .f32s("right", &right)
        .zeros("float", "sa", m.nnz() * heads);
    p.launch(
        2,
        &format!(
            "trellis_sddmm_add(m_rows.data(), m_indices.data(), {}, {heads}, left.data(), \
             right.data(), sa.data())",
            m.nnz()
        ),
    )
    .print("sa", m.nnz() * heads);
    let out = match p.run("elementwise") {
        Ok(o) => o,
        Err(why) => return skip(&why),
    };

    let mut xb = x.clone();
    cpu::add_bias(&mut xb, &bias);
    same_bits("add_bias", &out[0], &xb);
    for (i, (_, _, act)) in acts.iter().enumerate() {
        let mut y = vec![0.0f32; n];
        cpu::activation(*act, &x, &mut y);
        close(&format!("{act:?} forward"), &out[1 + 4 * i], &y);
        close(&format!("{act:?} in place"), &out[2 + 4 * i], &y);
        let mut gx = vec![0.0f32; n];
        cpu::activation_backward(*act, &x, &gy, &mut gx);
        close(&format!("{act:?} backward"), &out[3 + 4 * i], &gx);
        let go: Vec<f32> = gy
            .iter()
            .zip(&y)
            .map(|(g, &y)| g * act.derivative_from_output(y))
            .collect();
        close(
            &format!("{act:?} backward from output"),
            &out[4 + 4 * i],
            &go,
        );
    }
    let k = 17;
    let want_bits: Vec<u64> = x
        .chunks(64)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u64, |a, (j, &v)| a | (((v > 0.0) as u64) << j))
        })
        .collect();
    assert_eq!(out[k], want_bits, "positive_bits");
    let gm: Vec<f32> = gy
        .iter()
        .zip(&x)
        .map(|(&g, &v)| if v > 0.0 { g } else { 0.0 })
        .collect();
    same_bits("mask_by_bits", &out[k + 1], &gm);
    let mut ya = gy.clone();
    cpu::axpy(-0.3, &x, &mut ya);
    same_bits("axpy", &out[k + 2], &ya);
    let (mut sp, mut sb) = (
        x.clone(),
        bias.iter().cycle().take(n).copied().collect::<Vec<_>>(),
    );
    cpu::sgd_step(&sgd, &mut sp, &gy, &mut sb);
    same_bits("sgd param", &out[k + 3], &sp);
    same_bits("sgd buf", &out[k + 4], &sb);
    let mut sa = vec![0.0f32; m.nnz() * heads];
    cpu::sddmm_add(&m, heads, &left, &right, &mut sa);
    same_bits("sddmm_add", &out[k + 5], &sa);
}
