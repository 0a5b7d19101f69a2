//! The actix and tokio shells around the protocol machines of one process: the partition
//! actor, the node supervisor and the async coordinator pump.
pub mod coordinator;
pub mod handle;
pub mod partition;
pub mod supervisor;
