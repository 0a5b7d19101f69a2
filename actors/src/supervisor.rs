//! The node supervisor: starts each partition actor on its own arbiter (thread) under actix's
//! `Supervisor`, wires it to the transport, and stops and joins every thread at the end.
use crate::partition::PartitionActor;
use crate::replica::ReplicaStore;
use crate::state::PartitionState;
use crate::topology::FaultPlan;
use actix::prelude::*;
use std::sync::Arc;
use trellis_transport::{PartId, RunId, Transport};

/// The partition actors of one node.
pub struct NodeSupervisor {
    arbiters: Vec<Arbiter>,
    addrs: Vec<Addr<PartitionActor>>,
    parts: Vec<PartId>,
    transport: Arc<dyn Transport>,
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
        let mut arbiters = Vec::new();
        let mut addrs = Vec::new();
        let mut parts = Vec::new();
        for state in states {
            let part = state.part();
            let arb = Arbiter::new();
            let (t, r, f) = (transport.clone(), replicas.clone(), faults.clone());
            let addr = Supervisor::start_in_arbiter(&arb.handle(), move |_| {
                PartitionActor::new(state, run, t, r, f)
            });
            let deliver_to = addr.clone();
            transport.register(
                part,
                Arc::new(move |b| {
                    let ok = deliver_to.connected();
                    deliver_to.do_send(crate::messages::Halo(b));
                    ok
                }),
            );
            arbiters.push(arb);
            addrs.push(addr);
            parts.push(part);
        }
        NodeSupervisor {
            arbiters,
            addrs,
            parts,
            transport,
        }
    }

    /// Addresses of the partition actors, in the order their states were given.
    pub fn addrs(&self) -> &[Addr<PartitionActor>] {
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
