//! Who runs the engine of a serving cluster after its engine node is lost, and on which
//! nodes the partitions then run. Pure: every serving node computes the same answer from
//! what it was told (the setup's peers, the reroutes' placement and fenced nodes), so the
//! survivors agree on the new engine node without a vote.
//!
//! The rule: the lowest-numbered node of the setup that is neither the lost engine node nor
//! fenced, and that hosts a partition, takes over; the partitions of the lost nodes (the
//! engine node's, and those the engine had re-placed on itself) move to it, every other
//! partition stays where it ran. A node hosting a partition is preferred because the engine
//! sends graph updates and model installs to the partitions: only such a node's copy of the
//! served inputs is sure to be current.
//!
//! With `takeover = "majority"` (the default, [`Quorum`]) a successor takes over only with
//! more than half of the cluster file's nodes reaching it, and an engine node that lost
//! more than half stops answering, so the two sides of a network partition never both serve.
use crate::cluster::config::ClusterFile;

/// How many nodes decide who serves (`takeover = "majority"`): `members`, the nodes of the
/// cluster file the service started with. A successor needs more than half of them; an
/// engine node keeps serving while it has lost at most half (with exactly half lost
/// neither side could take over, and the engine node's side goes on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quorum {
    pub members: usize,
}

impl Quorum {
    /// Whether a successor that `reached` nodes (itself among them) may take over.
    pub fn may_take_over(&self, reached: usize) -> bool {
        2 * reached > self.members
    }

    /// Whether an engine node that lost `lost` nodes may go on serving: the lost nodes
    /// cannot take over without it.
    pub fn may_serve(&self, lost: usize) -> bool {
        2 * lost <= self.members
    }
}

/// The serving cluster after its engine node was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Succession {
    /// The node that takes over as the engine node.
    pub engine: u32,
    /// The lost engine node.
    pub lost: u32,
    /// Every node still serving (the new engine node among them), ascending.
    pub survivors: Vec<u32>,
    /// `placement[p]`: the node serving partition `p` after the take-over.
    pub placement: Vec<u32>,
}

/// The succession after the loss of engine node `lost`, seen from a node of a cluster whose
/// setup named `peers` (every node, the engine node among them), that has fenced `fenced`
/// since, and whose partitions run on `placement`. `None` when no node is left to take
/// over.
pub fn after_loss(
    peers: &[u32],
    lost: u32,
    fenced: &[u32],
    placement: &[u32],
) -> Option<Succession> {
    let mut survivors: Vec<u32> = peers
        .iter()
        .copied()
        .filter(|&n| n != lost && !fenced.contains(&n))
        .collect();
    survivors.sort_unstable();
    survivors.dedup();
    let engine = survivors
        .iter()
        .copied()
        .find(|n| placement.contains(n))
        .or_else(|| survivors.first().copied())?;
    let placement = placement
        .iter()
        .map(|&n| if survivors.contains(&n) { n } else { engine })
        .collect();
    Some(Succession {
        engine,
        lost,
        survivors,
        placement,
    })
}

impl Succession {
    /// The succession after this one's new engine node was lost too, before it had set the
    /// survivors up: the same rule among the other survivors, from this placement (the
    /// partitions it was to take go to the next one). `None` when no node is left.
    pub fn after_successor_loss(&self) -> Option<Succession> {
        after_loss(&self.survivors, self.engine, &[], &self.placement)
    }

    /// This succession with only the survivors `reached` (the new engine node and the nodes
    /// that joined it): the partitions of the others move to the new engine node too.
    pub fn among(&self, reached: &[u32]) -> Succession {
        let survivors: Vec<u32> = self
            .survivors
            .iter()
            .copied()
            .filter(|n| *n == self.engine || reached.contains(n))
            .collect();
        let placement = self
            .placement
            .iter()
            .map(|&n| {
                if survivors.contains(&n) {
                    n
                } else {
                    self.engine
                }
            })
            .collect();
        Succession {
            engine: self.engine,
            lost: self.lost,
            survivors,
            placement,
        }
    }

    /// The cluster file the new engine node serves with: `file` (certificates, timeouts)
    /// with only the survivors, the new engine node its coordinator, and the placement
    /// explicit.
    pub fn cluster(&self, file: &ClusterFile) -> ClusterFile {
        let mut c = file.clone();
        c.coordinator = self.engine;
        c.nodes.retain(|n| self.survivors.contains(&n.id));
        for n in &mut c.nodes {
            n.parts = Some(
                (0..self.placement.len() as u32)
                    .filter(|&p| self.placement[p as usize] == n.id)
                    .collect(),
            );
        }
        c
    }
}

/// Where the engine re-places the partitions `moved` (those of lost nodes; `placement` as
/// before the loss, `lost` every node lost so far): each, in order, on the node that then
/// serves the fewest partitions, among the engine node `engine` and the nodes still
/// serving one (their copy of the served inputs is current, see the module's doc); at
/// equal counts another node before the engine node (which also routes and answers every
/// request), then the lower id. `result[i]`: the node of `moved[i]`.
pub fn re_place(placement: &[u32], moved: &[u32], engine: u32, lost: &[u32]) -> Vec<u32> {
    let mut load: std::collections::BTreeMap<u32, usize> = std::collections::BTreeMap::new();
    load.insert(engine, 0);
    for (p, &n) in placement.iter().enumerate() {
        if !lost.contains(&n) && !moved.contains(&(p as u32)) {
            *load.entry(n).or_default() += 1;
        }
    }
    moved
        .iter()
        .map(|_| {
            let (&node, _) = load
                .iter()
                .min_by_key(|(&n, &count)| (count, n == engine, n))
                .expect("the engine node is a candidate");
            *load.get_mut(&node).expect("a candidate") += 1;
            node
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_nodes_partitions_go_to_the_least_loaded_survivors() {
        // Node 2 (partitions 4 and 5) lost: one to node 1 (not the engine at equal counts)...
        let targets = re_place(&[0, 0, 1, 1, 2, 2], &[4, 5], 0, &[2]);
        assert_eq!(targets, vec![1, 0]);
        // ...and to the engine node when it serves fewer.
        assert_eq!(re_place(&[0, 1, 1, 2], &[3], 0, &[2]), vec![0]);
        // A node serving nothing is not a candidate (its copy may be behind); nor a lost one.
        assert_eq!(re_place(&[0, 2, 3], &[2], 0, &[3]), vec![2]);
        assert_eq!(re_place(&[0, 2, 3], &[1, 2], 0, &[2, 3]), vec![0, 0]);
    }

    #[test]
    fn the_lowest_surviving_node_takes_over_with_the_lost_nodes_partitions() {
        // Engine 0 had re-placed node 2's partition 2 on itself before it was lost.
        let s = after_loss(&[0, 1, 2, 3], 0, &[2], &[0, 1, 0, 3]).unwrap();
        assert_eq!(s.engine, 1);
        assert_eq!(s.survivors, vec![1, 3]);
        assert_eq!(s.placement, vec![1, 1, 1, 3]);
        // Every survivor computes the same succession from the same view.
        assert_eq!(after_loss(&[3, 2, 1, 0], 0, &[2], &[0, 1, 0, 3]), Some(s));
        // Node 1 hosts nothing (explicit placement): its copy may be behind, node 2 takes over.
        let s = after_loss(&[0, 1, 2], 0, &[], &[0, 2, 2]).unwrap();
        assert_eq!((s.engine, s.placement), (2, vec![2, 2, 2]));
        // Nobody left.
        assert_eq!(after_loss(&[0, 1], 0, &[1], &[0, 1]), None);
    }

    #[test]
    fn a_successor_lost_during_its_take_over_is_succeeded_by_the_next_survivor() {
        let first = after_loss(&[0, 1, 2, 3], 0, &[], &[0, 1, 2, 3]).unwrap();
        assert_eq!((first.engine, &first.placement), (1, &vec![1, 1, 2, 3]));
        let second = first.after_successor_loss().unwrap();
        assert_eq!(second.engine, 2);
        assert_eq!(second.lost, 1);
        assert_eq!(second.survivors, vec![2, 3]);
        assert_eq!(second.placement, vec![2, 2, 2, 3]);
        let third = second.after_successor_loss().unwrap();
        assert_eq!((third.engine, &third.placement), (3, &vec![3, 3, 3, 3]));
        assert_eq!(third.after_successor_loss(), None);
    }

    #[test]
    fn a_majority_takes_over_and_an_engine_node_cut_off_from_one_stops() {
        let three = Quorum { members: 3 };
        // A successor with one other node of three may; a node alone may not.
        assert!(three.may_take_over(2));
        assert!(!three.may_take_over(1));
        // The engine node that lost one of three goes on; one that lost two stops (the two
        // may take over).
        assert!(three.may_serve(1));
        assert!(!three.may_serve(2));
        // Two nodes: nobody takes over, and the engine node always goes on.
        let two = Quorum { members: 2 };
        assert!(!two.may_take_over(1));
        assert!(two.may_serve(1));
        // Four nodes split two and two: the engine node's side serves, the other cannot
        // take over; never both.
        let four = Quorum { members: 4 };
        assert!(four.may_serve(2) && !four.may_take_over(2));
        for members in 1..8 {
            let q = Quorum { members };
            for lost in 0..=members {
                // The lost side (`lost` nodes) takes over only when the engine node stops.
                assert!(
                    !(q.may_serve(lost) && q.may_take_over(lost)),
                    "{members} {lost}"
                );
            }
        }
    }

    #[test]
    fn a_successor_takes_over_with_the_survivors_that_reached_it() {
        let s = after_loss(&[0, 1, 2, 3], 0, &[], &[0, 1, 2, 3]).unwrap();
        let s = s.among(&[3]);
        assert_eq!(s.engine, 1);
        assert_eq!(s.survivors, vec![1, 3]);
        assert_eq!(s.placement, vec![1, 1, 1, 3]);
    }

    #[test]
    fn the_cluster_file_names_the_new_engine_and_places_every_partition() {
        let file = ClusterFile::parse(
            "certs = \"c\"\npartitions = \"p\"\nidle_timeout_ms = 1500\n\
             [[node]]\nid = 0\naddr = \"127.0.0.1:0\"\n\
             [[node]]\nid = 1\naddr = \"127.0.0.1:0\"\n\
             [[node]]\nid = 2\naddr = \"127.0.0.1:0\"\n",
        )
        .unwrap();
        let s = after_loss(&[0, 1, 2], 0, &[], &[0, 1, 2]).unwrap();
        let c = s.cluster(&file);
        assert_eq!(c.coordinator, 1);
        assert_eq!(c.workers(), vec![2]);
        assert_eq!(c.idle_timeout_ms, 1500);
        assert_eq!(c.placement(3).unwrap(), vec![1, 1, 2]);
    }
}
