//! Semantic checks of a part archive that rkyv's bytecheck cannot see: lengths, id ranges
//! and orders. They run once when a part file is opened.
use super::format::{native, ArchivedPartitionData, FORMAT_VERSION};

/// The semantic invariants that bytecheck cannot see: lengths, ranges and orders.
pub(crate) fn check(d: &ArchivedPartitionData) -> std::result::Result<(), String> {
    let version = d.format_version.to_native();
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version} (this build reads {FORMAT_VERSION})"
        ));
    }
    let (part, parts) = (d.part.to_native(), d.num_parts.to_native());
    if part >= parts {
        return Err(format!("part {part} of {parts}"));
    }
    let n = d.num_global_nodes.to_native();
    let inner: &[u32] = native(d.inner.as_slice());
    let halo: &[u32] = native(d.halo.as_slice());
    for (name, ids) in [("inner", inner), ("halo", halo)] {
        if ids.windows(2).any(|w| w[0] >= w[1]) || ids.last().is_some_and(|&g| g as u64 >= n) {
            return Err(format!("{name} ids are not ascending global ids below {n}"));
        }
    }
    if !disjoint(inner, halo) {
        return Err("a node is both inner and halo".into());
    }
    let (ni, n_in) = (inner.len(), inner.len() + halo.len());
    let owner: &[u32] = native(d.halo_owner.as_slice());
    if owner.len() != halo.len() || owner.iter().any(|&q| q >= parts || q == part) {
        return Err("halo owners do not match the halo nodes".into());
    }
    let indptr: &[u64] = native(d.indptr.as_slice());
    let indices: &[u32] = native(d.indices.as_slice());
    if indptr.len() != ni + 1
        || indptr[0] != 0
        || indptr.windows(2).any(|w| w[0] > w[1])
        || indptr[ni] != indices.len() as u64
    {
        return Err(format!(
            "row pointers do not fit {ni} rows and {} entries",
            indices.len()
        ));
    }
    if indices.iter().any(|&j| j as usize >= n_in) {
        return Err(format!(
            "a neighbour index is out of range for {n_in} input rows"
        ));
    }
    if d.degrees.len() != n_in {
        return Err(format!("{} degrees for {n_in} input rows", d.degrees.len()));
    }
    let f = d.num_features.to_native() as usize;
    if Some(d.features.len()) != n_in.checked_mul(f) {
        return Err(format!(
            "{} feature values for {n_in} rows x {f} features",
            d.features.len()
        ));
    }
    let classes = d.num_classes.to_native();
    if d.labels.len() != ni || d.labels.iter().any(|c| c.to_native() >= classes) {
        return Err(format!(
            "labels do not fit {ni} inner nodes and {classes} classes"
        ));
    }
    if [&d.train_mask, &d.val_mask, &d.test_mask]
        .iter()
        .any(|m| m.len() != ni)
    {
        return Err(format!("masks do not have {ni} entries"));
    }
    let mut prev = None;
    for s in d.send.iter() {
        let q = s.to_part.to_native();
        if q >= parts
            || q == part
            || prev.is_some_and(|p| p >= q)
            || s.rows.iter().any(|r| r.to_native() as usize >= ni)
        {
            return Err(format!(
                "send list to part {q} is out of range or out of order"
            ));
        }
        prev = Some(q);
    }
    Ok(())
}

/// Whether two ascending lists share no element.
fn disjoint(a: &[u32], b: &[u32]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return false,
        }
    }
    true
}
