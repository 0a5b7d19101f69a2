//! Log-softmax + negative log-likelihood loss and accuracy over selected rows.
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
/// of `scale * loss_sum` (zero on unselected rows): `scale * (softmax - onehot)`.
pub fn softmax_nll(
    logits: &[f32],
    classes: usize,
    labels: &[u32],
    rows: &[u32],
    scale: f32,
    grad: &mut [f32],
) -> LossSums {
    assert_eq!(logits.len(), labels.len() * classes, "softmax_nll: logits/labels mismatch");
    assert_eq!(grad.len(), logits.len(), "softmax_nll: grad has the wrong length");
    grad.par_iter_mut().for_each(|g| *g = 0.0);
    // Per-row losses computed in parallel, then summed sequentially: deterministic.
    let per_row: Vec<(f64, bool)> = rows
        .par_iter()
        .map(|&r| {
            let r = r as usize;
            let z = &logits[r * classes..(r + 1) * classes];
            let (lse, argmax) = log_sum_exp(z);
            let y = labels[r] as usize;
            ((lse - z[y] as f64), argmax == y)
        })
        .collect();
    // Gradient rows are disjoint (selected rows are unique).
    let gptr = GradPtr(grad.as_mut_ptr());
    rows.par_iter().for_each(|&r| {
        let r = r as usize;
        let z = &logits[r * classes..(r + 1) * classes];
        let (lse, _) = log_sum_exp(z);
        let y = labels[r] as usize;
        let gp = &gptr;
        for c in 0..classes {
            let p = ((z[c] as f64) - lse).exp() as f32;
            let v = scale * (p - if c == y { 1.0 } else { 0.0 });
            // SAFETY: `r < n` (indexing `logits` above would have panicked otherwise) and
            // rows are distinct, so each task writes its own row of `grad`.
            unsafe { *gp.0.add(r * classes + c) = v };
        }
    });
    let loss_sum = per_row.iter().map(|x| x.0).sum();
    let correct = per_row.iter().filter(|x| x.1).count();
    LossSums { loss_sum, correct, count: rows.len() }
}

struct GradPtr(*mut f32);
// SAFETY: used only for disjoint row writes in `softmax_nll`.
unsafe impl Sync for GradPtr {}

/// Number of `rows` whose argmax of `logits` equals the label.
pub fn accuracy_count(logits: &[f32], classes: usize, labels: &[u32], rows: &[u32]) -> usize {
    rows.par_iter()
        .filter(|&&r| {
            let r = r as usize;
            log_sum_exp(&logits[r * classes..(r + 1) * classes]).1 == labels[r] as usize
        })
        .count()
}

/// `(log(sum(exp(z))), argmax(z))`, stable, in f64. Ties go to the lowest index.
fn log_sum_exp(z: &[f32]) -> (f64, usize) {
    let mut mx = f32::NEG_INFINITY;
    let mut arg = 0;
    for (i, &v) in z.iter().enumerate() {
        if v > mx {
            mx = v;
            arg = i;
        }
    }
    let s: f64 = z.iter().map(|&v| ((v - mx) as f64).exp()).sum();
    (mx as f64 + s.ln(), arg)
}
