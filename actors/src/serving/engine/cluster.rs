//! The engine on a cluster: where its partitions are ([`EngineCluster`]), the loss of a
//! node (its partitions re-placed on the survivors), a lost node taken back, this engine
//! node cut off from most of its cluster (quorum, deposed by a successor), and the end
//! of the service on every node.
use super::*;

/// The engine's cluster, when it serves on one.
pub(super) struct EngineCluster {
    pub(super) link: Arc<ServeLink>,
    pub(super) transport: Arc<QuicTransport>,
    /// `placement[p]`: the node serving partition `p` now.
    pub(super) placement: Vec<u32>,
    pub(super) me: u32,
    pub(super) workers: Vec<u32>,
    /// Nodes lost so far (fenced), less those that came back.
    pub(super) lost: Vec<u32>,
    /// The run id a partition re-placed here joins.
    pub(super) run: RunId,
    /// The placement the service started with: a node that comes back gets its partitions
    /// back.
    pub(super) first_placement: Vec<u32>,
    /// Where every node of the service listens (a node that came back: its new address).
    pub(super) peers: Vec<PeerAddr>,
    /// `takeover = "majority"`: how many lost nodes stop this engine node.
    pub(super) quorum: Option<Quorum>,
    /// When this node, cut off, last sent its `Join` to the lost nodes.
    pub(super) probed: Option<Instant>,
}

impl EngineCluster {
    /// Routes this node's halo blocks by the placement, shows it and the lost nodes in the
    /// stats, and tells every other live node (`Reroute`; `returned`: nodes that came back,
    /// at their new addresses).
    pub(super) fn reroute(&self, stats: &EngineStats, returned: Vec<PeerAddr>) {
        route_serving(&self.transport, &self.placement, self.me);
        *stats.placement.lock().expect("stats lock") = self.placement.clone();
        stats.set_lost(&self.lost);
        self.check_quorum(stats);
        let msg = ServeMsg::Reroute {
            placement: self.placement.clone(),
            fenced: self.lost.clone(),
            returned,
        };
        for &w in self.workers.iter().filter(|w| !self.lost.contains(w)) {
            if let Err(e) = self.link.tell(w, &msg) {
                tracing::warn!("serving: rerouting node {w}: {e}");
            }
        }
    }

    /// With a quorum: refuses every request while more than half of the service's nodes
    /// are lost (they may take over without this node; answering could give what they no
    /// longer serve), and answers again once enough came back. Says so when it changes.
    pub(super) fn check_quorum(&self, stats: &EngineStats) {
        let Some(q) = self.quorum else {
            return;
        };
        let cut = (!q.may_serve(self.lost.len())).then(|| {
            let mut lost = self.lost.clone();
            lost.sort_unstable();
            format!(
                "nodes {lost:?} of {} are lost; a majority may serve with another engine node; \
                 this node answers again if they come back, or steps down for the node that took \
                 over once it reaches it",
                q.members
            )
        });
        let mut now = stats.cut_off.lock().expect("stats lock");
        match (&*now, &cut) {
            (None, Some(why)) => crate::cluster::say(&format!(
                "serving: node {} is cut off from most of its cluster and refuses every request: {why}",
                self.me
            )),
            (Some(_), None) => crate::cluster::say(&format!(
                "serving: node {} reaches most of its cluster again and answers",
                self.me
            )),
            _ => {}
        }
        *now = cut;
    }
}

impl Engine {
    /// How long a survivor may take to start a re-placed partition.
    pub(super) const HOST_WITHIN: Duration = Duration::from_secs(10);

    /// Re-places the partitions of nodes lost since the last call (restored from a store,
    /// with no tables yet) on the least loaded survivors, this node among them
    /// ([`succession::re_place`]): every other node routes their halo blocks there from
    /// now on and refuses the lost nodes. A survivor that cannot start one leaves it to
    /// this node. Returns the re-placed partitions.
    pub(super) async fn replace_lost(&mut self) -> Vec<u32> {
        let Some(c) = &mut self.cluster else {
            return Vec::new();
        };
        // Only this service's nodes: a loss reported again for an engine node this one took
        // over from is not one.
        let lost: Vec<u32> = c
            .link
            .take_lost()
            .into_iter()
            .filter(|n| c.workers.contains(n) && !c.lost.contains(n))
            .collect();
        if lost.is_empty() {
            return Vec::new();
        }
        c.lost.extend(&lost);
        let moved: Vec<u32> = (0..self.parts as u32)
            .filter(|&p| lost.contains(&c.placement[p as usize]))
            .collect();
        if !moved.is_empty() {
            self.stats.ready.store(false, Ordering::SeqCst);
        }
        let Some(node) = self.node.as_mut() else {
            return Vec::new();
        };
        let targets = succession::re_place(&c.placement, &moved, c.me, &c.lost);
        for (&p, &target) in moved.iter().zip(&targets) {
            if target != c.me {
                let hosted = c
                    .link
                    .request(
                        target,
                        p,
                        ServeRequest::Host,
                        Self::HOST_WITHIN.min(self.step_timeout),
                    )
                    .await;
                match hosted {
                    Ok(ServeReply::Hosting) => {
                        self.handles[p as usize] = PartHandle::Remote(RemoteServePart::new(
                            p,
                            target,
                            c.link.clone(),
                            self.step_timeout,
                        ));
                        c.placement[p as usize] = target;
                        continue;
                    }
                    Ok(other) => tracing::warn!(
                        "serving: node {target} did not start partition {p} ({other:?}); it runs here"
                    ),
                    Err(e) => tracing::warn!(
                        "serving: node {target} did not start partition {p} ({e}); it runs here"
                    ),
                }
            }
            match node.add_part(
                p,
                c.run,
                self.store.clone(),
                self.launch.faults.clone(),
                self.launch.threads,
                self.launch.priority.clone(),
            ) {
                Ok(addr) => {
                    self.handles[p as usize] = PartHandle::Local { part: p, addr };
                    c.placement[p as usize] = c.me;
                }
                Err(e) => tracing::error!("serving partition {p} cannot be re-placed: {e}"),
            }
        }
        c.reroute(&self.stats, Vec::new());
        let onto: Vec<u32> = moved.iter().map(|&p| c.placement[p as usize]).collect();
        crate::cluster::say(&format!(
            "serving: nodes {lost:?} lost; partitions {moved:?} re-placed on nodes {onto:?} and recomputed"
        ));
        moved
    }

    /// Recovers the partitions of lost nodes (noticed while idle): re-placed here and
    /// recomputed before anything else runs.
    pub(super) async fn recover_lost(&mut self) {
        let moved = self.replace_lost().await;
        if !moved.is_empty() {
            if let Err(e) = self.recover(moved).await {
                tracing::error!("serving: {e}");
            }
        }
    }

    /// Takes back the lost nodes whose restarted process joined again (noticed while idle):
    /// each is set up as at start-up (the current placement, model and inputs), then the
    /// partitions first placed on it move back to it from the nodes that adopted them, every
    /// node is rerouted (the node admitted again, at its new address), and the moved
    /// partitions are recomputed there before anything else runs.
    pub(super) async fn take_back_returned(&mut self) {
        let Some(c) = &self.cluster else {
            return;
        };
        for (node, addr) in c.link.take_returned() {
            match self.take_back(node, &addr).await {
                Ok(moved) => {
                    crate::cluster::say(&format!(
                        "serving: node {node} came back (at {addr}); partitions {moved:?} moved back to it and recomputed"
                    ));
                    if !moved.is_empty() {
                        if let Err(e) = self.recover(moved).await {
                            tracing::error!("serving: {e}");
                        }
                    }
                }
                Err(e) => {
                    crate::cluster::say(&format!("serving: node {node} was not taken back: {e}"));
                    if let Some(c) = &self.cluster {
                        c.link.node_lost(node, &format!("not taken back: {e}"));
                    }
                }
            }
        }
    }

    /// Sets node `node` (back at `addr`) up and moves its first partitions back to it;
    /// returns them.
    pub(super) async fn take_back(
        &mut self,
        node: u32,
        addr: &str,
    ) -> Result<Vec<u32>, ActorError> {
        let Some(c) = &mut self.cluster else {
            return Ok(Vec::new());
        };
        if !c.lost.contains(&node) {
            return Ok(Vec::new());
        }
        let parsed = addr.parse().map_err(|e| ActorError::Node {
            node,
            detail: format!("joined with a bad address {addr}: {e}"),
        })?;
        c.link.taken_back(node);
        c.transport.add_peer(node, parsed);
        match c.peers.iter_mut().find(|p| p.node == node) {
            Some(p) => p.addr = addr.to_string(),
            None => c.peers.push(PeerAddr {
                node,
                addr: addr.to_string(),
                incarnation: None,
            }),
        }
        let (model, sparse_input, inputs) = {
            let m = self
                .store
                .model
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let served = self.store.served.read().unwrap_or_else(|e| e.into_inner());
            (
                WireModel::of(&m)?,
                self.store.sparse_input,
                ServedWire::of(&served).encode(),
            )
        };
        let setup = ServeSetup {
            run: *c.run.as_bytes(),
            placement: c.placement.clone(),
            home: c.first_placement.clone(),
            peers: c.peers.clone(),
            model,
            sparse_input,
            faults: Vec::new(),
            inputs_follow: true,
        };
        let ready = c.link.expect_ready(node, Duration::from_secs(120));
        send_setup(&c.transport, node, &setup, Some(&inputs))?;
        ready.await?;
        c.lost.retain(|&n| n != node);
        let mut moved = Vec::new();
        for p in 0..self.parts as u32 {
            let holder = c.placement[p as usize];
            if c.first_placement[p as usize] != node || holder == node {
                continue;
            }
            let hosted = c
                .link
                .request(node, p, ServeRequest::Host, Self::HOST_WITHIN)
                .await?;
            if !matches!(hosted, ServeReply::Hosting) {
                return Err(ActorError::Node {
                    node,
                    detail: format!("did not start partition {p}: {hosted:?}"),
                });
            }
            if holder == c.me {
                if let Some(local) = self.node.as_mut() {
                    local.remove_part(p);
                }
            } else {
                c.link.tell(holder, &ServeMsg::DropPart { part: p })?;
            }
            self.handles[p as usize] = PartHandle::Remote(RemoteServePart::new(
                p,
                node,
                c.link.clone(),
                self.step_timeout,
            ));
            c.placement[p as usize] = node;
            moved.push(p);
        }
        let returned = PeerAddr {
            node,
            addr: addr.to_string(),
            incarnation: c.transport.node().incarnation_of(node),
        };
        if !moved.is_empty() {
            // Not ready before the new placement shows: the moved partitions have no
            // tables until the recovery pass has run.
            self.stats.ready.store(false, Ordering::SeqCst);
        }
        c.reroute(&self.stats, vec![returned]);
        Ok(moved)
    }

    /// While this node is cut off (`EngineCluster::check_quorum`), sends a fresh process's
    /// `Join` to every lost node each second: one that took over answers with a setup
    /// (`ServeLink::deposed_by`, which refuses it), one that looks for the engine node
    /// ignores it (its own `Join` comes here and it is taken back). True once a successor
    /// serves: this engine stops for it (`EngineStats::deposed_by` says which), and its
    /// process joins it as a serving node.
    pub(super) fn deposed(&mut self) -> bool {
        let Some(c) = &mut self.cluster else {
            return false;
        };
        if let Some(engine) = c.link.deposed_by() {
            *self.stats.deposed_by.lock().expect("stats lock") = Some(engine);
            crate::cluster::say(&format!(
                "serving: node {engine} took over as the engine node while node {} was cut off; \
                 this engine stops",
                c.me
            ));
            return true;
        }
        if self.stats.cut_off().is_none()
            || c.probed
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return false;
        }
        c.probed = Some(Instant::now());
        let Some(me) = c.peers.iter().find(|p| p.node == c.me) else {
            return false;
        };
        let join = ServeMsg::Join {
            addr: me.addr.clone(),
            inputs: None,
        };
        crate::cluster::serving::join_each(&c.transport, &c.lost, &join);
        false
    }

    /// Tells the other nodes the service stops (not when this engine stopped for a
    /// successor: the nodes still with it join the successor by themselves).
    pub(super) async fn stop_cluster(&mut self) {
        if self.stats.deposed_by().is_some() {
            // Closed gracefully, so the peers drop their connections to this endpoint at
            // once: the serving node this process becomes binds the same address, and a
            // message sent on a connection of the old endpoint would be lost.
            if let Some(c) = self.cluster.take() {
                c.transport.close().await;
            }
            return;
        }
        if let Some(c) = self.cluster.take() {
            for &w in c.workers.iter().filter(|w| !c.lost.contains(w)) {
                let _ = c.link.tell(w, &ServeMsg::Finish);
            }
            if let Err(e) = c.transport.flush_live(Duration::from_secs(2)).await {
                tracing::warn!("serving: {e}");
            }
        }
    }

    /// A node that does not answer is lost: fenced, and its partitions re-placed before
    /// the next pass (never computed with a graph that missed a change).
    pub(super) fn declare_lost(&self, node: u32, detail: &str) {
        if let Some(c) = &self.cluster {
            c.link.node_lost(node, detail);
        }
    }
}
