//! The engine node's start-up of a serving cluster: waits for every other node of the
//! cluster file to join as a serving node, sends each its setup (placement, peers, model)
//! and the served inputs from the engine's [`ServeStore`] (unless, after a take-over, the
//! node's own copy has the same digest), and waits until every node reports its
//! partitions running. A node that joins as a training node, fails its setup,
//! or does not come within the cluster's join timeout is an error naming it.
use super::proto::{
    PeerAddr, ServeMsg, ServeSetup, ServedWire, WireModel, WireServeFault, INPUT_CHUNK,
};
use crate::cluster::config::ClusterFile;
use crate::cluster::node::{ControlInbox, EndpointHandle, InboxEvent};
use crate::cluster::proto::ControlMsg;
use crate::faults::FaultPlan;
use crate::serving::shell::ServeStore;
use crate::ActorError;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use trellis_transport::quic::QuicTransport;
use trellis_transport::RunId;

/// Serve on a cluster: this process is node `id` (the cluster file's coordinator) and runs
/// the engine; the other nodes host the partitions placed on them.
#[derive(Debug, Clone)]
pub struct ClusterServing {
    pub cluster: ClusterFile,
    pub id: u32,
    /// Write the bound address here (for launchers; ephemeral ports).
    pub addr_file: Option<PathBuf>,
    /// After a take-over: the placement the service started with (else the cluster
    /// file's), and the nodes of the service lost before (not in `cluster`), which may
    /// come back.
    pub home: Option<Vec<u32>>,
    pub lost: Vec<u32>,
    /// With `takeover = "majority"`: the engine node stops answering while it has lost
    /// more than half of the service's nodes (a majority may take over without it).
    pub quorum: Option<super::succession::Quorum>,
}

impl ClusterServing {
    /// `placement[p]`: the node serving partition `p` of `parts`.
    pub fn placement(&self, parts: usize) -> Result<Vec<u32>, ActorError> {
        self.cluster.placement(parts)
    }

    /// The placement the service started with, given the one it starts with now.
    pub fn home(&self, placement: &[u32]) -> Vec<u32> {
        self.home.clone().unwrap_or_else(|| placement.to_vec())
    }
}

/// Brings up the serving nodes of `serving`'s cluster for run `run`: joins, setups, inputs,
/// readiness. Returns where every node of the service (this one too) listens.
pub async fn connect(
    ep: &EndpointHandle,
    inbox: &mut ControlInbox,
    serving: &ClusterServing,
    store: &ServeStore,
    placement: &[u32],
    run: RunId,
    faults: &FaultPlan,
) -> Result<Vec<PeerAddr>, ActorError> {
    let cluster = &serving.cluster;
    let workers = cluster.workers();
    let until = Instant::now() + Duration::from_millis(cluster.join_timeout_ms);
    let mut addrs: BTreeMap<u32, String> = BTreeMap::new();
    addrs.insert(ep.id, ep.addr().to_string());
    // The digest of the inputs each joining node holds, if it holds any (after a take-over).
    let mut held: BTreeMap<u32, [u8; 32]> = BTreeMap::new();
    while workers.iter().any(|w| !addrs.contains_key(w)) {
        let (from, msg) = match next(inbox, until).await? {
            Some(m) => m,
            None => {
                let missing: Vec<u32> = workers
                    .iter()
                    .copied()
                    .filter(|w| !addrs.contains_key(w))
                    .collect();
                return Err(ActorError::Cluster(format!(
                    "nodes {missing:?} did not join within {} ms (start them with trellis serve --cluster FILE --id N)",
                    cluster.join_timeout_ms
                )));
            }
        };
        match msg {
            ServeMsg::Join { addr, inputs } if workers.contains(&from) => {
                let parsed = addr.parse().map_err(|e| ActorError::Node {
                    node: from,
                    detail: format!("joined with a bad address {addr}: {e}"),
                })?;
                ep.transport.add_peer(from, parsed);
                addrs.insert(from, addr);
                if let Some(d) = inputs {
                    held.insert(from, d);
                }
            }
            other => tracing::warn!(
                peer = from,
                "ignored {} from node {from} while nodes join",
                other.kind()
            ),
        }
    }
    let peers: Vec<PeerAddr> = addrs
        .iter()
        .map(|(&node, addr)| PeerAddr {
            node,
            addr: addr.clone(),
            incarnation: None,
        })
        .collect();
    let model = {
        let m = store
            .model
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        WireModel::of(&m)?
    };
    let setup = ServeSetup {
        run: *run.as_bytes(),
        placement: placement.to_vec(),
        home: serving.home(placement),
        peers: peers.clone(),
        model,
        sparse_input: store.sparse_input,
        faults: WireServeFault::shipped(faults, placement, ep.id),
        inputs_follow: true,
    };
    // A node whose copy of the inputs equals this one's (a survivor of the engine node's
    // loss, which applied the same updates) keeps it; the others get the inputs.
    let mine = (!held.is_empty()).then(|| store.inputs_digest());
    let needs = |w: &u32| mine.is_none() || held.get(w) != mine.as_ref();
    let inputs = workers.iter().any(needs).then(|| {
        let s = store.served.read().unwrap_or_else(|e| e.into_inner());
        ServedWire::of(&s).encode()
    });
    for w in &workers {
        let inputs = inputs.as_deref().filter(|_| needs(w));
        send_setup(&ep.transport, *w, &setup, inputs)?;
        if inputs.is_none() {
            crate::cluster::say(&format!(
                "serving: node {w} holds the same inputs; none sent"
            ));
        }
    }
    let mut ready: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    while workers.iter().any(|w| !ready.contains_key(w)) {
        let Some((from, msg)) =
            next(inbox, until.max(Instant::now() + Duration::from_secs(120))).await?
        else {
            let missing: Vec<u32> = workers
                .iter()
                .copied()
                .filter(|w| !ready.contains_key(w))
                .collect();
            return Err(ActorError::Cluster(format!(
                "nodes {missing:?} did not start their serving partitions in time"
            )));
        };
        match msg {
            ServeMsg::Ready { parts } => {
                let want: Vec<u32> = (0..placement.len() as u32)
                    .filter(|&p| placement[p as usize] == from)
                    .collect();
                if parts != want {
                    return Err(ActorError::Node {
                        node: from,
                        detail: format!("serves partitions {parts:?}, it was given {want:?}"),
                    });
                }
                ready.insert(from, parts);
            }
            ServeMsg::SetupFailed { error } => {
                return Err(ActorError::Node {
                    node: from,
                    detail: format!("its serving setup failed: {error}"),
                })
            }
            ServeMsg::Join { .. } => {}
            // A node set up already announces its front end, which may forward a request
            // before this one is up: said, and answered 503 at once.
            ServeMsg::Http { addr } => {
                crate::cluster::say(&format!("node {from} answers HTTP on http://{addr}"))
            }
            ServeMsg::HttpRequest { id, .. } => super::remote::reply_forwarded(
                &ep.transport,
                from,
                id,
                super::remote::unavailable("the engine node is setting the service up"),
            ),
            other => tracing::warn!(
                peer = from,
                "ignored {} from node {from} during the setup",
                other.kind()
            ),
        }
    }
    for (node, parts) in &ready {
        crate::cluster::say(&format!("serving: node {node} serves partitions {parts:?}"));
    }
    Ok(peers)
}

/// Sends node `to` its `setup` and, when given, the served `inputs` (an encoded
/// [`ServedWire`]) in chunks as they are cut; without them the setup says none follow.
pub(crate) fn send_setup(
    t: &QuicTransport,
    to: u32,
    setup: &ServeSetup,
    inputs: Option<&[u8]>,
) -> Result<(), ActorError> {
    let send = |msg: &ServeMsg| super::tell(t, to, msg);
    let setup = ServeSetup {
        inputs_follow: inputs.is_some(),
        ..setup.clone()
    };
    send(&ServeMsg::Setup(setup))?;
    let Some(inputs) = inputs else {
        return Ok(());
    };
    let total = inputs.len() as u64;
    for (i, chunk) in inputs.chunks(INPUT_CHUNK).enumerate() {
        send(&ServeMsg::Inputs {
            offset: (i * INPUT_CHUNK) as u64,
            total,
            data: chunk.to_vec(),
        })?;
    }
    Ok(())
}

/// The next serving message before `until` (`None` then). A node that joins for training
/// is refused and the start fails naming it; a node lost meanwhile fails it too.
async fn next(
    inbox: &mut ControlInbox,
    until: Instant,
) -> Result<Option<(u32, ServeMsg)>, ActorError> {
    loop {
        match inbox.next_event(None, Some(until)).await? {
            InboxEvent::Message {
                from,
                msg: ControlMsg::Serve(env),
            } => match ServeMsg::open(&env, from) {
                Ok(m) => return Ok(Some((from, m))),
                Err(e) => return Err(ActorError::Cluster(e.to_string())),
            },
            InboxEvent::Message {
                from,
                msg: ControlMsg::Join { .. },
            } => {
                return Err(ActorError::Node {
                    node: from,
                    detail: "joined as a training node (trellis node); this cluster serves: start it with trellis serve --cluster FILE --id N".into(),
                })
            }
            InboxEvent::Message { from, msg } => {
                tracing::warn!(peer = from, "ignored {msg:?} from node {from}")
            }
            InboxEvent::PeerDown { node, detail } => {
                return Err(ActorError::Node { node, detail })
            }
            InboxEvent::Timeout => return Ok(None),
        }
    }
}
