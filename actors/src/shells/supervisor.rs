//! The node supervisor: starts each partition actor on its own arbiter (thread) under actix's
//! `Supervisor`, wires it to the transport, and stops and joins every thread at the end.
use crate::faults::FaultPlan;
use crate::protocol::state::PartitionState;
use crate::replica::ReplicaStore;
use crate::shells::partition::{PartitionActor, PartitionRef};
use actix::prelude::*;
use std::sync::Arc;
use trellis_gpu::CancelToken;
use trellis_transport::{PartId, RunId, Transport};

/// The partition actors of one node.
pub struct NodeSupervisor {
    arbiters: Vec<Arbiter>,
    addrs: Vec<PartitionRef>,
    parts: Vec<PartId>,
    transport: Arc<dyn Transport>,
    run: RunId,
    replicas: Arc<ReplicaStore>,
    faults: Arc<FaultPlan>,
}

impl NodeSupervisor {
    /// Starts one supervised actor per state, each on a new arbiter. Must run inside an actix
    /// system.
    pub fn start(
        states: Vec<PartitionState>,
        run: RunId,
        transport: Arc<dyn Transport>,
        replicas: Arc<ReplicaStore>,
        faults: Arc<FaultPlan>,
    ) -> Self {
        let mut node = NodeSupervisor {
            arbiters: Vec::new(),
            addrs: Vec::new(),
            parts: Vec::new(),
            transport,
            run,
            replicas,
            faults,
        };
        for state in states {
            node.adopt(state);
        }
        node
    }

    /// Starts one more supervised actor (a partition re-placed here after a node loss) on a
    /// new arbiter and routes its halo blocks to it.
    pub fn adopt(&mut self, mut state: PartitionState) -> PartitionRef {
        let part = state.part();
        let cancel = CancelToken::new();
        state.set_cancel(cancel.clone());
        let token = cancel.clone();
        let arb = Arbiter::new();
        let (t, r, f) = (
            self.transport.clone(),
            self.replicas.clone(),
            self.faults.clone(),
        );
        let run = self.run;
        let addr = Supervisor::start_in_arbiter(&arb.handle(), move |_| {
            PartitionActor::new(state, run, t, r, f, token.clone())
        });
        let deliver_to = addr.clone();
        self.transport.register(
            part,
            Arc::new(move |b| {
                let ok = deliver_to.connected();
                deliver_to.do_send(crate::protocol::messages::Halo(b));
                ok
            }),
        );
        self.arbiters.push(arb);
        let r = PartitionRef { addr, cancel };
        self.addrs.push(r.clone());
        self.parts.push(part);
        r
    }

    /// Stops partition `part`'s actor and joins its thread (it moves to another node); its
    /// halo blocks are no longer delivered here. Returns whether it was hosted here.
    pub fn evict(&mut self, part: PartId) -> bool {
        let Some(i) = self.parts.iter().position(|&p| p == part) else {
            return false;
        };
        self.transport.unregister(part);
        self.parts.remove(i);
        drop(self.addrs.remove(i));
        let arb = self.arbiters.remove(i);
        arb.stop();
        let _ = arb.join();
        true
    }

    /// The fault plan of this node's actors.
    pub fn faults(&self) -> &Arc<FaultPlan> {
        &self.faults
    }

    /// The node's replica store.
    pub fn replicas(&self) -> &Arc<ReplicaStore> {
        &self.replicas
    }

    /// Addresses of the partition actors, in the order their states were given.
    pub fn addrs(&self) -> &[PartitionRef] {
        &self.addrs
    }

    /// The partitions this supervisor hosts, in the order of [`NodeSupervisor::addrs`].
    pub fn parts(&self) -> &[PartId] {
        &self.parts
    }

    /// Stops every actor and joins every arbiter thread.
    pub fn shutdown(self) {
        for &p in &self.parts {
            self.transport.unregister(p);
        }
        drop(self.addrs);
        for arb in self.arbiters {
            arb.stop();
            let _ = arb.join();
        }
    }
}
