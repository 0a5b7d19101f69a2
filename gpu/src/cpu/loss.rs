//! Log-softmax + negative log-likelihood loss and accuracy over selected rows.
use super::row_chunk;
use rayon::prelude::*;

/// Loss of a batch of selected rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossSums {
    /// Sum over selected rows of `-log softmax(logits)[label]` (f64, summed in row order).
    pub loss_sum: f64,
    /// Number of selected rows whose argmax equals the label.
    pub correct: usize,
    /// Number of selected rows.
    pub count: usize,
}

/// Log-softmax + NLL over `rows` of `logits` (`n x classes`). Writes into `grad` the gradient
/// of `scale * loss_sum` (zero on unselected rows): `scale * (softmax - onehot)` for a row
/// selected once, and `times * scale * (softmax - onehot)` for a row listed `times` times in
/// `rows` (it counts that often in `loss_sum` too).
///
/// Row-parallel over `grad` (each row written by one task), with the per-row losses summed
/// sequentially in `rows` order afterwards: bit-identical for any thread count.
pub fn softmax_nll(
    logits: &[f32],
    classes: usize,
    labels: &[u32],
    rows: &[u32],
    scale: f32,
    grad: &mut [f32],
) -> LossSums {
    assert_eq!(
        logits.len(),
        labels.len() * classes,
        "softmax_nll: logits/labels mismatch"
    );
    assert_eq!(
        grad.len(),
        logits.len(),
        "softmax_nll: grad has the wrong length"
    );
    let n = labels.len();
    if n == 0 || classes == 0 {
        assert!(
            rows.is_empty(),
            "softmax_nll: rows selected from an empty set of logits"
        );
        return LossSums {
            loss_sum: 0.0,
            correct: 0,
            count: 0,
        };
    }
    // How often each row is selected (panics on an out-of-range row before any write).
    let mut times = vec![0u32; n];
    for &r in rows {
        times[r as usize] += 1;
    }
    let mut row_loss = vec![0.0f64; n];
    let mut row_hit = vec![false; n];
    let chunk = row_chunk(n, classes);
    grad.par_chunks_mut(chunk * classes)
        .zip(
            row_loss
                .par_chunks_mut(chunk)
                .zip(row_hit.par_chunks_mut(chunk)),
        )
        .enumerate()
        .for_each(|(c, (g, (loss, hit)))| {
            for (k, grow) in g.chunks_mut(classes).enumerate() {
                let r = c * chunk + k;
                if times[r] == 0 {
                    grow.fill(0.0);
                    continue;
                }
                let z = &logits[r * classes..(r + 1) * classes];
                let (lse, arg) = log_sum_exp(z);
                let y = labels[r] as usize;
                assert!(
                    y < classes,
                    "softmax_nll: label {y} out of {classes} classes"
                );
                loss[k] = lse - z[y] as f64;
                hit[k] = arg == y;
                let s = scale * times[r] as f32;
                for (j, (gv, &zv)) in grow.iter_mut().zip(z).enumerate() {
                    let p = ((zv as f64) - lse).exp() as f32;
                    *gv = s * (p - if j == y { 1.0 } else { 0.0 });
                }
            }
        });
    let loss_sum = rows.iter().map(|&r| row_loss[r as usize]).sum();
    let correct = rows.iter().filter(|&&r| row_hit[r as usize]).count();
    LossSums {
        loss_sum,
        correct,
        count: rows.len(),
    }
}

/// Number of `rows` whose argmax of `logits` equals the label (ties go to the lowest index).
pub fn accuracy_count(logits: &[f32], classes: usize, labels: &[u32], rows: &[u32]) -> usize {
    if classes == 0 {
        return 0;
    }
    rows.par_iter()
        .filter(|&&r| {
            let r = r as usize;
            argmax(&logits[r * classes..(r + 1) * classes]).1 == labels[r] as usize
        })
        .count()
}

/// `(max(z), argmax(z))`; ties go to the lowest index, NaNs are skipped.
fn argmax(z: &[f32]) -> (f32, usize) {
    let mut mx = f32::NEG_INFINITY;
    let mut arg = 0;
    for (i, &v) in z.iter().enumerate() {
        if v > mx {
            mx = v;
            arg = i;
        }
    }
    (mx, arg)
}

/// `(log(sum(exp(z))), argmax(z))`, stable, in f64. Ties go to the lowest index.
fn log_sum_exp(z: &[f32]) -> (f64, usize) {
    let (mx, arg) = argmax(z);
    let s: f64 = z.iter().map(|&v| ((v - mx) as f64).exp()).sum();
    (mx as f64 + s.ln(), arg)
}
