//! Seeded fault schedules: from one seed, the cluster's shape (nodes, partitions, replicas,
//! model), its network and the faults to inject, so a failing schedule replays from its seed.
use super::net::{NetSpec, SimRng};
use crate::faults::{FaultPlan, APPLY_LAYER};
use trellis_runtime::ModelKind;
use trellis_transport::Phase;

/// Partition counts the simulator prepares partitionings for.
pub const PART_COUNTS: [u32; 4] = [1, 2, 3, 4];
/// Model kinds the simulator trains.
pub const MODELS: [ModelKind; 3] = [ModelKind::Gcn, ModelKind::Sage, ModelKind::Gat];
/// Epochs each schedule trains.
pub const EPOCHS: u32 = 3;
/// Layers of the simulated models.
pub const LAYERS: u16 = 2;

/// The kinds of fault the simulator injects, as counted when they fire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimFault {
    /// A partition panics in a stage of a step, or in its optimizer step, after overwriting
    /// part of its state.
    ActorPanic,
    /// A node's process dies.
    NodeCrash,
    /// A node dies while the coordinator is recovering from another failure.
    CrashDuringRecovery,
    /// The coordinator dies; the run resumes from its last checkpoint.
    CoordinatorCrash,
    /// A node stops (SIGSTOP) past the idle timeout, is fenced, then wakes and sends.
    StaleNodeWakes,
    /// The coordinator's clock jumps forward past a deadline.
    ClockJump,
    /// A link drops everything for a while.
    LinkCut,
    MessageLost,
    MessageDuplicated,
    MessageReordered,
    FrameCorrupted,
}

impl SimFault {
    pub fn name(self) -> &'static str {
        match self {
            SimFault::ActorPanic => "actor-panic",
            SimFault::NodeCrash => "node-crash",
            SimFault::CrashDuringRecovery => "crash-during-recovery",
            SimFault::CoordinatorCrash => "coordinator-crash",
            SimFault::StaleNodeWakes => "stale-node-wakes",
            SimFault::ClockJump => "clock-jump",
            SimFault::LinkCut => "link-cut",
            SimFault::MessageLost => "message-lost",
            SimFault::MessageDuplicated => "message-duplicated",
            SimFault::MessageReordered => "message-reordered",
            SimFault::FrameCorrupted => "frame-corrupted",
        }
    }
}

/// A fault that fires when the coordinator starts an epoch (or, for
/// [`TimedFault::CrashDuringRecovery`], when it next starts a recovery from that epoch on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimedFault {
    NodeCrash { node: u32 },
    CrashDuringRecovery { node: u32 },
    CoordinatorCrash,
    StaleNodeWakes { node: u32, pause_ms: u64 },
    ClockJump { ms: u64 },
    LinkCut { a: u32, b: u32, ms: u64 },
}

/// A fault planned for an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedFault {
    pub epoch: u32,
    pub fault: TimedFault,
    pub fired: bool,
}

/// One schedule: the cluster, its network and its faults.
#[derive(Debug)]
pub struct Schedule {
    pub seed: u64,
    /// Node processes, the coordinator (node 0) included.
    pub nodes: u32,
    pub parts: u32,
    /// Replica nodes per partition.
    pub replicas: u32,
    pub model: ModelKind,
    /// Halo staleness of the run (0 or 1; 0 when the coordinator crashes: checkpoints do not
    /// hold the rows partitions keep for their next epoch).
    pub staleness: u32,
    /// Halo rows skipped when they barely changed (`--skip-threshold 0.5 --max-staleness
    /// 2`); off when the coordinator crashes, as staleness.
    pub skip: bool,
    pub net: NetSpec,
    /// Panics, fired by the partition machines themselves.
    pub panics: FaultPlan,
    pub timed: Vec<PlannedFault>,
}

impl Schedule {
    /// The schedule of `seed`. `faulty`: inject faults and network chaos (else the network is
    /// perfect and nothing fails: the reference run).
    pub fn generate(seed: u64, faulty: bool) -> Self {
        let mut r = SimRng::new(seed);
        let parts = PART_COUNTS[r.below(PART_COUNTS.len() as u64) as usize];
        // Mostly small clusters, sometimes up to 256 nodes.
        let nodes = match r.below(10) {
            0..=5 => r.range(2, 6) as u32,
            6..=8 => r.range(7, 32) as u32,
            _ => r.range(33, 256) as u32,
        };
        let replicas = r.range(1, 2) as u32;
        let model = MODELS[r.below(MODELS.len() as u64) as usize];
        let mut s = Schedule {
            seed,
            nodes,
            parts,
            replicas,
            model,
            staleness: 0,
            skip: false,
            net: NetSpec::perfect(),
            panics: FaultPlan::none(),
            timed: Vec::new(),
        };
        if !faulty {
            return s;
        }
        let pick = |r: &mut SimRng, v: &[f64]| v[r.below(v.len() as u64) as usize];
        s.net = NetSpec {
            delay_us: (50, r.range(100, 2000)),
            loss: pick(&mut r, &[0.0, 0.0, 0.001, 0.005]),
            duplicate: pick(&mut r, &[0.0, 0.01, 0.05]),
            reorder: pick(&mut r, &[0.0, 0.01, 0.1]),
            corrupt: pick(&mut r, &[0.0, 0.0, 0.002]),
        };
        let workers = nodes - 1;
        let worker = |r: &mut SimRng| 1 + r.below(u64::from(workers)) as u32;
        let faults = r.below(5);
        for _ in 0..faults {
            let epoch = r.range(1, u64::from(EPOCHS)) as u32;
            let fault = match r.below(9) {
                0..=2 => {
                    let part = r.below(u64::from(parts)) as u32;
                    let (layer, phase) = match r.below(4) {
                        0 => (r.below(u64::from(LAYERS)) as u16, Phase::Forward),
                        1 => (r.below(u64::from(LAYERS)) as u16, Phase::Backward),
                        2 => (r.below(u64::from(LAYERS)) as u16, Phase::Eval),
                        _ => (APPLY_LAYER, Phase::Forward),
                    };
                    s.panics = if r.chance(0.3) && layer != APPLY_LAYER {
                        std::mem::take(&mut s.panics)
                            .panic_in_second_stage(part, epoch, layer, phase)
                    } else {
                        std::mem::take(&mut s.panics).panic_at(part, epoch, layer, phase)
                    };
                    continue;
                }
                3 => TimedFault::NodeCrash {
                    node: worker(&mut r),
                },
                4 => TimedFault::CrashDuringRecovery {
                    node: worker(&mut r),
                },
                5 => TimedFault::CoordinatorCrash,
                6 => TimedFault::StaleNodeWakes {
                    node: worker(&mut r),
                    pause_ms: r.range(400, 900),
                },
                7 => TimedFault::ClockJump {
                    ms: r.range(1_100, 5_000),
                },
                _ => {
                    let a = r.below(u64::from(nodes)) as u32;
                    let b = (a + 1 + r.below(u64::from(nodes - 1)) as u32) % nodes;
                    TimedFault::LinkCut {
                        a,
                        b,
                        ms: r.range(10, 600),
                    }
                }
            };
            s.timed.push(PlannedFault {
                epoch,
                fault,
                fired: false,
            });
        }
        // Drawn last, so the rest of every seed's schedule is what it was before staleness.
        let crashes = s
            .timed
            .iter()
            .any(|f| f.fault == TimedFault::CoordinatorCrash);
        s.staleness = u32::from(r.chance(0.5) && !crashes);
        s.skip = r.chance(0.5) && !crashes;
        s
    }
}
