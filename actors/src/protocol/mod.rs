//! The protocol core, free of actors, sockets and clocks: each machine takes events and the
//! current time and returns actions (quinn-proto style); the actix, tokio and quinn code in
//! [`crate::shells`] and [`crate::cluster`], and the simulator in [`crate::sim`], are pumps
//! around them.
//!
//! - [`epoch`]: the coordinator's epoch protocol and recovery policy ([`epoch::EpochMachine`]).
//! - [`partition`]: one partition's inbox and parked step ([`partition::PartitionMachine`]).
//! - [`state`]: a partition's compute state and the per-layer steps (the model math).
//! - `halo`: halo row lists, block building and checking; `skip`: the sender's record of
//!   the rows each receiver holds, and the sparse payloads of rows that changed.
//! - [`messages`]: requests and replies between the coordinator and partitions.
//! - [`session`]: the cluster session of the coordinator node and of every other node
//!   ([`session::CoordinatorSession`], [`session::WorkerSession`]).
pub(crate) mod codec;
pub mod epoch;
pub(crate) mod halo;
pub mod messages;
pub mod partition;
pub mod session;
pub mod skip;
pub mod state;
