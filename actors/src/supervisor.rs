//! The node supervisor: starts each partition actor on its own arbiter (thread) under actix's
//! `Supervisor`, wires it to the transport, and stops and joins every thread at the end.
use crate::partition::PartitionActor;
use crate::replica::ReplicaStore;
use crate::state::PartitionState;
use crate::topology::FaultPlan;
use actix::prelude::*;
use std::sync::Arc;
use trellis_transport::{InProcessTransport, PartId, RunId};

/// The partition actors of one node.
pub struct NodeSupervisor {
    arbiters: Vec<Arbiter>,
    addrs: Vec<Addr<PartitionActor>>,
    transport: Arc<InProcessTransport>,
}

impl NodeSupervisor {
    /// Starts one supervised actor per state, each on a new arbiter. Must run inside an actix
    /// system.
    pub fn start(
        states: Vec<PartitionState>,
        run: RunId,
        transport: Arc<InProcessTransport>,
        replicas: Arc<ReplicaStore>,
        faults: Arc<FaultPlan>,
    ) -> Self {
        let mut arbiters = Vec::new();
        let mut addrs = Vec::new();
        for state in states {
            let part = state.part();
            let arb = Arbiter::new();
            let (t, r, f) = (transport.clone(), replicas.clone(), faults.clone());
            let addr = Supervisor::start_in_arbiter(&arb.handle(), move |_| {
                PartitionActor::new(state, run, t as Arc<dyn trellis_transport::Transport>, r, f)
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
        }
        NodeSupervisor {
            arbiters,
            addrs,
            transport,
        }
    }

    /// Addresses of the partition actors, by partition id.
    pub fn addrs(&self) -> &[Addr<PartitionActor>] {
        &self.addrs
    }

    /// Stops every actor and joins every arbiter thread.
    pub fn shutdown(self) {
        for p in 0..self.addrs.len() {
            self.transport.unregister(PartId(p as u32));
        }
        drop(self.addrs);
        for arb in self.arbiters {
            arb.stop();
            let _ = arb.join();
        }
    }
}
