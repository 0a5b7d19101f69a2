//! Fault plans: the faults a test, `--chaos` or the simulator injects, as named records, and
//! the count of those that actually **fired** (a fault planned for an epoch the run never
//! reaches, or for a partition that moved away, fires nothing and is not counted).
//!
//! Each node holds its own copy of the plan (a cluster parses `--chaos` on every node); a fault
//! fires once, on the node where its condition first holds.
use crate::ActorError;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use trellis_transport::Phase;

/// A partition panics when it starts a stage of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedPanic {
    pub part: u32,
    pub epoch: u32,
    pub layer: u16,
    pub phase: Phase,
    /// In the second stage of a split layer's step (after its first stage sent its blocks).
    pub second_stage: bool,
    /// Whether it fired (or was retired: it fired on the node that hosted the partition).
    pub fired: bool,
}

/// A partition stops answering for a while in its first step of an epoch (a hung kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedStall {
    pub part: u32,
    pub epoch: u32,
    pub duration: Duration,
    pub fired: bool,
}

/// A node's process SIGKILLs itself when the coordinator starts an epoch, or
/// (`in_apply`) when the epoch's optimizer step reaches one of its partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedKill {
    pub node: u32,
    pub epoch: u32,
    pub in_apply: bool,
    pub fired: bool,
}

/// A serving partition actor fails when it starts computing `layer` of the `update`-th
/// graph update (counting from 1) it takes part in, as [`ServeFaultAction`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedServeFault {
    pub part: u32,
    pub update: u64,
    pub layer: u16,
    pub action: ServeFaultAction,
    pub fired: bool,
}

/// What a serving fault does to the partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeFaultAction {
    /// It overwrites its tables, as a kernel interrupted half-way would, and panics
    /// (`serve-panic`).
    Panic,
    /// It hangs this long before computing (a stuck kernel; `serve-stall`): past the
    /// engine's step timeout the pass fails without a panic.
    Stall(Duration),
}

/// A serving fault that fired: what to do, and the panic message of a panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueServeFault {
    pub action: ServeFaultAction,
    pub message: String,
}

/// What a link fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkAction {
    /// Drop every message both ways for this long.
    Cut(Duration),
    /// Hold every message for this long (both ways).
    Delay(Duration),
    /// Corrupt the next halo frame from `a` to `b`.
    Corrupt,
}

/// A fault on the link between nodes `a` and `b`, applied by each end once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkFault {
    pub action: LinkAction,
    pub a: u32,
    pub b: u32,
    pub epoch: u32,
    /// Whether end `a` (index 0) and end `b` (index 1) applied it.
    pub applied: [bool; 2],
}

/// The kinds of fault, as counted when they fire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    Panic,
    Stall,
    KillNode,
    CutLink,
    DelayLink,
    CorruptFrame,
    ServePanic,
    ServeStall,
}

impl FaultKind {
    /// The `--chaos` name of the kind.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Panic => "panic",
            FaultKind::Stall => "stall",
            FaultKind::KillNode => "kill-node",
            FaultKind::CutLink => "cut-link",
            FaultKind::DelayLink => "delay",
            FaultKind::CorruptFrame => "corrupt",
            FaultKind::ServePanic => "serve-panic",
            FaultKind::ServeStall => "serve-stall",
        }
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl LinkAction {
    fn kind(self) -> FaultKind {
        match self {
            LinkAction::Cut(_) => FaultKind::CutLink,
            LinkAction::Delay(_) => FaultKind::DelayLink,
            LinkAction::Corrupt => FaultKind::CorruptFrame,
        }
    }
}

/// The `layer` of a panic planned in the optimizer step (`phase=apply`) rather than a layer.
pub const APPLY_LAYER: u16 = u16::MAX;

/// The message of an injected panic starts with this (the binary's panic hook prints such
/// panics as one line).
pub const INJECTED_PANIC: &str = "injected fault:";

/// Whether the panic hook of [`quiet_injected_panics`] prints injected panics at all.
static PRINT_INJECTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Makes injected panics print one line (`injected fault: partition P, ...`) instead of the
/// default hook's message and backtrace, whatever `RUST_BACKTRACE` says; every other panic
/// goes to the hook that was installed before. `print: false` silences them entirely (the
/// simulator injects thousands). Idempotent.
pub fn quiet_injected_panics(print: bool) {
    PRINT_INJECTED.store(print, std::sync::atomic::Ordering::Relaxed);
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let text = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied());
            match text {
                Some(t) if t.starts_with(INJECTED_PANIC) => {
                    if PRINT_INJECTED.load(std::sync::atomic::Ordering::Relaxed) {
                        eprintln!("{t}");
                    }
                }
                _ => previous(info),
            }
        }));
    });
}

/// Faults to inject (tests and `--chaos`): each fires once.
#[derive(Debug, Default)]
pub struct FaultPlan {
    panics: Mutex<Vec<PlannedPanic>>,
    stalls: Mutex<Vec<PlannedStall>>,
    kills: Mutex<Vec<PlannedKill>>,
    links: Mutex<Vec<LinkFault>>,
    serve_faults: Mutex<Vec<PlannedServeFault>>,
    /// Faults that fired on this node, by kind.
    fired: Mutex<BTreeMap<FaultKind, u32>>,
}

/// Every `--chaos` fault kind with its fields (for help texts and errors).
pub const CHAOS_KINDS: &str =
    "panic:part=P:epoch=E[:layer=L][:phase=forward|backward|eval|apply][:stage=2], \
kill-node:node=N:epoch=E[:phase=apply], cut-link:a=N:b=M:epoch=E:ms=T, delay:a=N:b=M:ms=T[:epoch=E], \
corrupt:a=N:b=M:epoch=E, serve-panic:part=P:update=U[:layer=L], \
serve-stall:part=P:update=U:ms=T[:layer=L] (trellis serve)";

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Panic partition `part` in the `phase` pass of `layer` in `epoch`.
    pub fn panic_at(self, part: u32, epoch: u32, layer: u16, phase: Phase) -> Self {
        self.plan_panic(part, epoch, layer, phase, false)
    }

    /// As [`FaultPlan::panic_at`], in the second stage of a split layer's step (after its
    /// first stage sent its blocks).
    pub fn panic_in_second_stage(self, part: u32, epoch: u32, layer: u16, phase: Phase) -> Self {
        self.plan_panic(part, epoch, layer, phase, true)
    }

    fn plan_panic(self, part: u32, epoch: u32, layer: u16, phase: Phase, second: bool) -> Self {
        lock(&self.panics).push(PlannedPanic {
            part,
            epoch,
            layer,
            phase,
            second_stage: second,
            fired: false,
        });
        self
    }

    /// SIGKILL node `node`'s process when the coordinator starts `epoch` (cluster runs).
    pub fn kill_node_at(self, node: u32, epoch: u32) -> Self {
        lock(&self.kills).push(PlannedKill {
            node,
            epoch,
            in_apply: false,
            fired: false,
        });
        self
    }

    /// SIGKILL node `node`'s process when epoch `epoch`'s optimizer step reaches one of its
    /// partitions (`kill-node:...:phase=apply`): other nodes' partitions apply it meanwhile.
    pub fn kill_node_in_apply(self, node: u32, epoch: u32) -> Self {
        lock(&self.kills).push(PlannedKill {
            node,
            epoch,
            in_apply: true,
            fired: false,
        });
        self
    }

    /// Make partition `part` stop answering for `duration` in its first step of `epoch` (a
    /// hung kernel); the coordinator's deadline must turn it into an error.
    pub fn stall_at(self, part: u32, epoch: u32, duration: Duration) -> Self {
        lock(&self.stalls).push(PlannedStall {
            part,
            epoch,
            duration,
            fired: false,
        });
        self
    }

    /// A fault on the link between nodes `a` and `b` from `epoch` on.
    pub fn link_fault(self, a: u32, b: u32, epoch: u32, action: LinkAction) -> Self {
        lock(&self.links).push(LinkFault {
            action,
            a,
            b,
            epoch,
            applied: [false; 2],
        });
        self
    }

    /// Panic serving partition `part` when it starts layer `layer` of graph update `update`
    /// (counting from 1).
    pub fn serve_panic_at(self, part: u32, update: u64, layer: u16) -> Self {
        self.serve_fault_at(part, update, layer, ServeFaultAction::Panic)
    }

    /// Make serving partition `part` fail as `action` says when it starts layer `layer` of
    /// graph update `update` (counting from 1).
    pub fn serve_fault_at(
        self,
        part: u32,
        update: u64,
        layer: u16,
        action: ServeFaultAction,
    ) -> Self {
        lock(&self.serve_faults).push(PlannedServeFault {
            part,
            update,
            layer,
            action,
            fired: false,
        });
        self
    }

    /// Parses a `--chaos` spec: faults separated by `,` (see [`CHAOS_KINDS`]).
    pub fn parse(spec: &str) -> Result<Self, ActorError> {
        let mut plan = FaultPlan::none();
        for fault in spec.split(',').filter(|f| !f.trim().is_empty()) {
            plan = plan.parse_one(fault.trim())?;
        }
        Ok(plan)
    }

    fn parse_one(self, fault: &str) -> Result<Self, ActorError> {
        let bad = |m: String| {
            ActorError::Runtime(trellis_runtime::RuntimeError::Config(format!(
                "--chaos: {m}"
            )))
        };
        let mut fields = fault.split(':');
        let kind = fields.next().unwrap_or_default();
        if kind == "serve-panic" || kind == "serve-stall" {
            return self.parse_serve_fault(kind, fault, fields);
        }
        if !["panic", "kill-node", "cut-link", "delay", "corrupt"].contains(&kind) {
            return Err(bad(format!(
                "fault kind `{kind}` is not supported (supported: {CHAOS_KINDS})"
            )));
        }
        let link = matches!(kind, "cut-link" | "delay" | "corrupt");
        let mut keys: BTreeMap<&str, u32> = BTreeMap::new();
        let mut phase = Phase::Forward;
        for kv in fields {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("`{kv}` is not key=value")))?;
            let allowed = match k {
                "part" | "layer" | "stage" => kind == "panic",
                "phase" => kind == "panic" || kind == "kill-node",
                "node" => kind == "kill-node",
                "a" | "b" => link,
                "ms" => kind == "cut-link" || kind == "delay",
                "epoch" => true,
                _ => false,
            };
            if !allowed {
                return Err(bad(format!("unknown key `{k}` in `{fault}`")));
            }
            if k == "phase" {
                phase = match v {
                    "forward" => Phase::Forward,
                    "backward" => Phase::Backward,
                    "eval" => Phase::Eval,
                    "apply" => {
                        keys.insert("layer", u32::from(APPLY_LAYER));
                        Phase::Forward
                    }
                    _ => {
                        return Err(bad(format!(
                            "unknown phase `{v}` (forward, backward, eval, apply)"
                        )))
                    }
                };
                continue;
            }
            let n = v
                .parse::<u32>()
                .map_err(|_| bad(format!("`{v}` is not a number for {k}")))?;
            keys.insert(k, n);
        }
        let need = |k: &str, what: &str| {
            keys.get(k)
                .copied()
                .ok_or_else(|| bad(format!("`{fault}` needs {what}")))
        };
        if link {
            let (a, b) = (need("a", "a=N")?, need("b", "b=M")?);
            if a == b {
                return Err(bad(format!("`{fault}`: a link joins two different nodes")));
            }
            let ms = |k| need(k, "ms=T").map(|m| Duration::from_millis(u64::from(m)));
            let action = match kind {
                "cut-link" => LinkAction::Cut(ms("ms")?),
                "delay" => LinkAction::Delay(ms("ms")?),
                _ => LinkAction::Corrupt,
            };
            let epoch = match kind {
                "delay" => keys.get("epoch").copied().unwrap_or(1),
                _ => need("epoch", "epoch=E")?,
            };
            return Ok(self.link_fault(a, b, epoch, action));
        }
        let epoch = need("epoch", "epoch=E")?;
        if epoch == 0 {
            return Err(bad(format!("`{fault}`: epochs count from 1")));
        }
        if kind == "kill-node" {
            let node = need("node", "node=N")?;
            return match keys.get("layer") {
                Some(_) => Ok(self.kill_node_in_apply(node, epoch)),
                None if phase == Phase::Forward => Ok(self.kill_node_at(node, epoch)),
                None => Err(bad(format!(
                    "`{fault}`: a node is killed as its epoch starts or, with phase=apply, \
                     in its optimizer step"
                ))),
            };
        }
        let part = need("part", "part=P")?;
        let layer = keys.get("layer").copied().unwrap_or(0);
        let layer = u16::try_from(layer).map_err(|_| bad(format!("layer {layer} is too large")))?;
        let second = match keys.get("stage").copied().unwrap_or(1) {
            1 => false,
            2 => true,
            s => return Err(bad(format!("`{fault}`: stage is 1 or 2, not {s}"))),
        };
        Ok(self.plan_panic(part, epoch, layer, phase, second))
    }

    /// `serve-panic:part=P:update=U[:layer=L]`, `serve-stall:part=P:update=U:ms=T[:layer=L]`.
    fn parse_serve_fault<'a>(
        self,
        kind: &str,
        fault: &str,
        fields: impl Iterator<Item = &'a str>,
    ) -> Result<Self, ActorError> {
        let bad = |m: String| {
            ActorError::Runtime(trellis_runtime::RuntimeError::Config(format!(
                "--chaos: {m}"
            )))
        };
        let mut keys: BTreeMap<&str, u64> = BTreeMap::new();
        for kv in fields {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("`{kv}` is not key=value")))?;
            let allowed: &[&str] = if kind == "serve-stall" {
                &["part", "update", "layer", "ms"]
            } else {
                &["part", "update", "layer"]
            };
            if !allowed.contains(&k) {
                return Err(bad(format!("unknown key `{k}` in `{fault}`")));
            }
            let n = v
                .parse::<u64>()
                .map_err(|_| bad(format!("`{v}` is not a number for {k}")))?;
            keys.insert(k, n);
        }
        let need = |k: &str| {
            keys.get(k)
                .copied()
                .ok_or_else(|| bad(format!("`{fault}` needs {k}=N")))
        };
        let part = u32::try_from(need("part")?)
            .map_err(|_| bad(format!("`{fault}`: part is too large")))?;
        let update = need("update")?;
        if update == 0 {
            return Err(bad(format!("`{fault}`: updates count from 1")));
        }
        let layer = keys.get("layer").copied().unwrap_or(0);
        let layer = u16::try_from(layer).map_err(|_| bad(format!("layer {layer} is too large")))?;
        let action = if kind == "serve-stall" {
            ServeFaultAction::Stall(Duration::from_millis(need("ms")?))
        } else {
            ServeFaultAction::Panic
        };
        Ok(self.serve_fault_at(part, update, layer, action))
    }

    /// Refuses faults `trellis serve` cannot inject (training faults), and serving faults that
    /// can never fire on `parts` partitions and `layers` layers.
    pub fn check_serving(&self, parts: u32, layers: u16) -> Result<(), ActorError> {
        let bad = |m: String| {
            ActorError::Runtime(trellis_runtime::RuntimeError::Config(format!(
                "--chaos: {m}"
            )))
        };
        if !lock(&self.panics).is_empty() || !lock(&self.stalls).is_empty() || self.kills_nodes() {
            return Err(bad(
                "only serve-panic and serve-stall faults can be injected into a service".into(),
            ));
        }
        for p in lock(&self.serve_faults).iter() {
            if p.part >= parts {
                return Err(bad(format!(
                    "partition {} does not exist (the service has {parts}); it could never fire",
                    p.part
                )));
            }
            if p.layer >= layers {
                return Err(bad(format!(
                    "layer {} does not exist (the model has {layers}); it could never fire",
                    p.layer
                )));
            }
        }
        Ok(())
    }

    /// The serving fault due when partition `part` starts layer `layer` of graph update
    /// `update`, if any (each fires once, and is counted then).
    pub fn serve_fault_due(&self, part: u32, update: u64, layer: u16) -> Option<DueServeFault> {
        let mut due = None;
        for f in lock(&self.serve_faults).iter_mut() {
            if !f.fired && due.is_none() && (f.part, f.update, f.layer) == (part, update, layer) {
                f.fired = true;
                due = Some(f.action);
            }
        }
        due.map(|action| {
            let kind = match action {
                ServeFaultAction::Panic => FaultKind::ServePanic,
                ServeFaultAction::Stall(_) => FaultKind::ServeStall,
            };
            self.count(kind);
            DueServeFault {
                action,
                message: format!(
                    "{INJECTED_PANIC} serving partition {part}, update {update}, layer {layer}"
                ),
            }
        })
    }

    /// The planned serving faults (with whether each fired).
    pub fn serve_faults(&self) -> Vec<PlannedServeFault> {
        lock(&self.serve_faults).clone()
    }

    /// Refuses faults that can never fire in a run of `epochs` epochs over `parts` partitions,
    /// `layers` layers and `nodes` node processes (0: a single process, no nodes to fault).
    pub fn check_reachable(
        &self,
        epochs: u32,
        parts: u32,
        layers: u16,
        nodes: u32,
    ) -> Result<(), ActorError> {
        let bad = |m: String| {
            ActorError::Runtime(trellis_runtime::RuntimeError::Config(format!(
                "--chaos: {m}; it could never fire"
            )))
        };
        let epoch_ok = |epoch: u32| {
            if epoch > epochs {
                return Err(bad(format!(
                    "epoch {epoch} is past the run's last epoch ({epochs})"
                )));
            }
            Ok(())
        };
        let node_ok = |node: u32| {
            if nodes > 0 && node >= nodes {
                return Err(bad(format!(
                    "node {node} does not exist (the cluster has {nodes})"
                )));
            }
            Ok(())
        };
        for p in lock(&self.panics).iter() {
            if p.part >= parts {
                return Err(bad(format!(
                    "partition {} does not exist (the run has {parts})",
                    p.part
                )));
            }
            epoch_ok(p.epoch)?;
            if p.layer >= layers && p.layer != APPLY_LAYER {
                return Err(bad(format!(
                    "layer {} does not exist (the model has {layers})",
                    p.layer
                )));
            }
        }
        for k in lock(&self.kills).iter() {
            node_ok(k.node)?;
            epoch_ok(k.epoch)?;
        }
        for l in lock(&self.links).iter() {
            node_ok(l.a.max(l.b))?;
            epoch_ok(l.epoch)?;
        }
        Ok(())
    }

    /// Whether the plan has faults that need a cluster (node kills, link faults).
    pub fn kills_nodes(&self) -> bool {
        !lock(&self.kills).is_empty() || !lock(&self.links).is_empty()
    }

    /// The link faults node `me` must apply now that `epoch` starts: (peer, action), each
    /// once. Cuts and delays act on both ends; a corruption on the sending end `a`.
    pub fn link_faults_due(&self, me: u32, epoch: u32) -> Vec<(u32, LinkAction)> {
        let mut due = Vec::new();
        let mut links = lock(&self.links);
        for f in links.iter_mut().filter(|f| f.epoch <= epoch) {
            if me == f.a && !f.applied[0] {
                f.applied[0] = true;
                due.push((f.b, f.action));
            }
            if me == f.b && !f.applied[1] && f.action != LinkAction::Corrupt {
                f.applied[1] = true;
                due.push((f.a, f.action));
            }
        }
        drop(links);
        for (_, action) in &due {
            self.count(action.kind());
        }
        due
    }

    /// Whether node `node` must die now that `epoch` starts (fires once).
    pub fn kill_due(&self, node: u32, epoch: u32) -> bool {
        let mut due = false;
        for k in lock(&self.kills).iter_mut() {
            if !k.fired && !k.in_apply && k.node == node && k.epoch <= epoch {
                k.fired = true;
                due = true;
            }
        }
        if due {
            self.count(FaultKind::KillNode);
        }
        due
    }

    /// Whether node `node` must die now that epoch `epoch`'s optimizer step reaches it
    /// (fires once).
    pub fn kill_in_apply_due(&self, node: u32, epoch: u32) -> bool {
        let mut due = false;
        for k in lock(&self.kills).iter_mut() {
            if !k.fired && k.in_apply && k.node == node && k.epoch == epoch {
                k.fired = true;
                due = true;
            }
        }
        if due {
            self.count(FaultKind::KillNode);
        }
        due
    }

    /// Marks `part`'s panics up to `epoch` as fired: the partition moved here after they fired
    /// on the node that hosted it (each node holds its own copy of the plan). Retired faults
    /// are not counted here: they fired (and were counted) elsewhere.
    pub fn retire_panics(&self, part: u32, epoch: u32) {
        for f in lock(&self.panics)
            .iter_mut()
            .filter(|f| f.part == part && f.epoch <= epoch)
        {
            f.fired = true;
        }
    }

    /// The stall due for partition `part` in `epoch`, if any (fires once).
    pub fn stall_due(&self, part: u32, epoch: u32) -> Option<Duration> {
        let mut stall = None;
        for f in lock(&self.stalls).iter_mut() {
            if !f.fired && (f.part, f.epoch) == (part, epoch) {
                f.fired = true;
                stall = Some(f.duration);
            }
        }
        if stall.is_some() {
            self.count(FaultKind::Stall);
        }
        stall
    }

    /// The panic due when partition `part` starts this stage, if any (fires once): the panic
    /// message to raise.
    pub fn panic_due(
        &self,
        part: u32,
        epoch: u32,
        layer: u16,
        phase: Phase,
        second_stage: bool,
    ) -> Option<String> {
        let mut fire = false;
        for f in lock(&self.panics).iter_mut() {
            let here = (f.part, f.epoch, f.layer, f.phase, f.second_stage)
                == (part, epoch, layer, phase, second_stage);
            if here && !f.fired {
                f.fired = true;
                fire = true;
            }
        }
        fire.then(|| {
            self.count(FaultKind::Panic);
            let stage = if second_stage { " (second stage)" } else { "" };
            let at = if layer == APPLY_LAYER {
                "the optimizer step".to_string()
            } else {
                format!("{phase:?} layer {layer}")
            };
            format!("{INJECTED_PANIC} partition {part}, epoch {epoch}, {at}{stage}")
        })
    }

    fn count(&self, kind: FaultKind) {
        *lock(&self.fired).entry(kind).or_default() += 1;
    }

    /// Faults that fired on this node so far, by kind.
    pub fn fired(&self) -> BTreeMap<FaultKind, u32> {
        lock(&self.fired).clone()
    }

    /// Total faults that fired on this node so far.
    pub fn fired_total(&self) -> u32 {
        lock(&self.fired).values().sum()
    }

    /// The planned panics (with whether each fired).
    pub fn panics(&self) -> Vec<PlannedPanic> {
        lock(&self.panics).clone()
    }
}

/// Locks a plan's list; a poisoned lock (a panic while it was held) still holds valid data.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_kill_in_the_optimizer_step_fires_there_only() {
        let plan = FaultPlan::parse("kill-node:node=2:epoch=3:phase=apply").unwrap();
        assert!(!plan.kill_due(2, 3), "not as the epoch starts");
        assert!(!plan.kill_in_apply_due(2, 2));
        assert!(!plan.kill_in_apply_due(1, 3));
        assert!(plan.kill_in_apply_due(2, 3));
        assert!(!plan.kill_in_apply_due(2, 3), "fires once");
        assert_eq!(plan.fired().get(&FaultKind::KillNode), Some(&1));
        let e = FaultPlan::parse("kill-node:node=2:epoch=3:phase=backward").unwrap_err();
        assert!(e.to_string().contains("phase=apply"), "{e}");
    }

    #[test]
    fn chaos_specs_parse_or_fail_clearly() {
        let plan = FaultPlan::parse(
            "panic:part=1:epoch=3,panic:part=0:epoch=5:layer=1:phase=backward:stage=2",
        )
        .unwrap();
        let p = plan.panics();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].part, p[0].epoch, p[0].layer), (1, 3, 0));
        assert_eq!(p[0].phase, Phase::Forward);
        assert!(!p[0].second_stage && !p[0].fired);
        assert_eq!((p[1].part, p[1].epoch, p[1].layer), (0, 5, 1));
        assert!(p[1].phase == Phase::Backward && p[1].second_stage);
        let plan = FaultPlan::parse("kill-node:node=2:epoch=3").unwrap();
        assert!(plan.kills_nodes());
        assert!(!plan.kill_due(2, 2) && !plan.kill_due(1, 3));
        assert!(plan.kill_due(2, 3) && !plan.kill_due(2, 3), "fires once");
        assert_eq!(plan.fired().get(&FaultKind::KillNode), Some(&1));
        let plan = FaultPlan::parse(
            "cut-link:a=1:b=2:epoch=2:ms=100,corrupt:a=2:b=0:epoch=3,delay:a=0:b=1:ms=5",
        )
        .unwrap();
        assert_eq!(
            plan.link_faults_due(1, 1),
            vec![(0, LinkAction::Delay(Duration::from_millis(5)))]
        );
        assert_eq!(
            plan.link_faults_due(1, 2),
            vec![(2, LinkAction::Cut(Duration::from_millis(100)))]
        );
        assert_eq!(
            plan.link_faults_due(2, 3).len(),
            2,
            "cut (b side) and corrupt (a side)"
        );
        assert_eq!(
            plan.link_faults_due(0, 3).len(),
            1,
            "only the delay: corruption is one-sided"
        );
        for (spec, needle) in [
            ("cut-link:a=1:b=2:epoch=2", "ms=T"),
            ("corrupt:a=1:b=1:epoch=2", "two different"),
            ("partition:part=1:epoch=2", "not supported"),
            ("kill-node:part=1:epoch=2", "part"),
            ("panic:part=1", "epoch"),
            ("panic:part=1:epoch=0", "count from 1"),
            ("panic:part=x:epoch=1", "`x`"),
            ("panic:part=1:epoch=1:phase=up", "phase"),
            ("panic:part=1:epoch=1:stage=3", "stage"),
        ] {
            let e = FaultPlan::parse(spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    /// Regression: `retire_panics` set the second-stage flag instead of the fired flag, so a
    /// panic retired on the node a partition moved to could still fire there.
    #[test]
    fn retire_panics_marks_them_fired() {
        let plan = FaultPlan::none()
            .panic_at(1, 3, 0, Phase::Forward)
            .panic_at(1, 9, 0, Phase::Forward);
        plan.retire_panics(1, 3);
        assert_eq!(plan.panic_due(1, 3, 0, Phase::Forward, false), None);
        assert!(plan.panic_due(1, 3, 0, Phase::Forward, true).is_none());
        assert!(
            plan.panic_due(1, 9, 0, Phase::Forward, false).is_some(),
            "later ones stay"
        );
        assert_eq!(
            plan.fired_total(),
            1,
            "retired faults are not counted again"
        );
    }

    #[test]
    fn serving_panics_parse_fire_once_and_are_counted() {
        let plan = FaultPlan::parse("serve-panic:part=1:update=2:layer=1").unwrap();
        plan.check_serving(2, 2).unwrap();
        assert!(plan.serve_fault_due(1, 1, 1).is_none());
        assert!(plan.serve_fault_due(0, 2, 1).is_none());
        assert!(plan.serve_fault_due(1, 2, 0).is_none());
        assert_eq!(plan.fired_total(), 0, "nothing fired yet");
        let due = plan.serve_fault_due(1, 2, 1).unwrap();
        assert_eq!(due.action, ServeFaultAction::Panic);
        let msg = due.message;
        assert!(msg.starts_with(INJECTED_PANIC), "{msg}");
        assert!(plan.serve_fault_due(1, 2, 1).is_none(), "fires once");
        assert_eq!(plan.fired().get(&FaultKind::ServePanic), Some(&1));
        assert!(plan.serve_faults()[0].fired);
        let stall = FaultPlan::parse("serve-stall:part=0:update=1:ms=250:layer=1").unwrap();
        stall.check_serving(2, 2).unwrap();
        let due = stall.serve_fault_due(0, 1, 1).unwrap();
        assert_eq!(
            due.action,
            ServeFaultAction::Stall(Duration::from_millis(250))
        );
        assert_eq!(stall.fired().get(&FaultKind::ServeStall), Some(&1));
        for (spec, parts, needle) in [
            ("serve-panic:part=1", 2, "update=N"),
            ("serve-panic:part=1:update=0", 2, "count from 1"),
            (
                "serve-panic:part=1:update=1:epoch=3",
                2,
                "unknown key `epoch`",
            ),
            ("serve-panic:part=2:update=1", 2, "partition 2"),
            ("serve-panic:part=0:update=1:layer=2", 2, "layer 2"),
            ("panic:part=0:epoch=1", 2, "only serve-panic"),
            ("serve-stall:part=0:update=1", 2, "needs ms=N"),
            ("serve-panic:part=0:update=1:ms=5", 2, "unknown key `ms`"),
        ] {
            let e = FaultPlan::parse(spec)
                .and_then(|p| p.check_serving(parts, 2))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn faults_that_cannot_fire_are_refused() {
        let ok =
            FaultPlan::parse("panic:part=3:epoch=10:layer=1,kill-node:node=2:epoch=4").unwrap();
        ok.check_reachable(10, 4, 2, 3).unwrap();
        for (spec, needle) in [
            ("panic:part=4:epoch=1", "partition 4"),
            ("panic:part=0:epoch=11", "epoch 11"),
            ("panic:part=0:epoch=1:layer=2", "layer 2"),
            ("kill-node:node=3:epoch=1", "node 3"),
            ("cut-link:a=0:b=5:epoch=1:ms=5", "node 5"),
        ] {
            let e = FaultPlan::parse(spec)
                .unwrap()
                .check_reachable(10, 4, 2, 3)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(needle) && e.contains("never fire"),
                "{spec}: {e}"
            );
        }
    }
}
