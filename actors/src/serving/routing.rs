//! Which part owns what: queries grouped by the parts that own their nodes, and the part a
//! new node joins. Pure functions of the ownership table.
use std::collections::BTreeMap;

/// The queried `nodes` grouped by owning part (parts ascending, each group in query order,
/// repeated nodes once).
pub fn route(nodes: &[u32], owner: &[u32]) -> BTreeMap<u32, Vec<u32>> {
    let mut out: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut seen = std::collections::HashSet::with_capacity(nodes.len());
    for &v in nodes {
        if seen.insert(v) {
            out.entry(owner[v as usize]).or_default().push(v);
        }
    }
    out
}

/// The part a new node with edges to `neighbours` joins: the part owning most of them (ties:
/// the smaller part, then the lower id), or the smallest part for a node without edges. This
/// keeps its aggregation local to one part as far as its edges allow.
pub fn place_new_node(neighbours: &[u32], owner: &[u32], sizes: &[usize]) -> u32 {
    let mut votes = vec![0usize; sizes.len()];
    for &v in neighbours {
        votes[owner[v as usize] as usize] += 1;
    }
    (0..sizes.len())
        .max_by(|&a, &b| {
            votes[a]
                .cmp(&votes[b])
                .then(sizes[b].cmp(&sizes[a]))
                .then(b.cmp(&a))
        })
        .unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_grouped_by_owner() {
        let owner = [0, 1, 1, 2, 0];
        let r = route(&[3, 0, 2, 4, 0], &owner);
        assert_eq!(r[&0], vec![0, 4]);
        assert_eq!(r[&1], vec![2]);
        assert_eq!(r[&2], vec![3]);
    }

    #[test]
    fn new_nodes_join_their_neighbours_or_the_smallest_part() {
        let owner = [0, 1, 1, 2];
        assert_eq!(place_new_node(&[1, 2, 0], &owner, &[5, 5, 5]), 1);
        assert_eq!(place_new_node(&[], &owner, &[5, 3, 4]), 1);
        // A tie between parts 0 and 2: the smaller one.
        assert_eq!(place_new_node(&[0, 3], &owner, &[5, 5, 4]), 2);
    }
}
