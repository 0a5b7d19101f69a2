//! [`QuicError`]: every failure names the peer node (and its address when known).
use crate::wire::Rejection;
use crate::TransportError;
use std::net::SocketAddr;
use std::time::Duration;
use thiserror::Error;

/// Errors of the QUIC transport.
#[derive(Debug, Clone, Error)]
pub enum QuicError {
    #[error("node {node}: no address known for it")]
    UnknownNode { node: u32 },
    #[error("node {node} at {addr}: connection failed: {reason}")]
    Connect {
        node: u32,
        addr: SocketAddr,
        reason: String,
    },
    #[error("node {node} at {addr}: no connection within {after:?}")]
    ConnectTimeout {
        node: u32,
        addr: SocketAddr,
        after: Duration,
    },
    #[error("node {node} at {addr}: {what} not completed within {after:?}")]
    SendTimeout {
        node: u32,
        addr: SocketAddr,
        what: String,
        after: Duration,
    },
    #[error("node {node} at {addr}: connection lost: {reason}")]
    PeerLost {
        node: u32,
        addr: SocketAddr,
        reason: String,
    },
    #[error("node {node} at {addr}: send failed: {reason}")]
    Send {
        node: u32,
        addr: SocketAddr,
        reason: String,
    },
    #[error("node {node}: send queue full ({queued} bytes queued, limit {max})")]
    QueueFull { node: u32, queued: u64, max: u64 },
    #[error("node {node}: a message of {bytes} bytes exceeds the limit of {max}")]
    TooLarge { node: u32, bytes: u64, max: u64 },
    #[error("node {node}: {pending} messages still pending after {after:?}")]
    FlushTimeout {
        node: u32,
        pending: u64,
        after: Duration,
    },
    #[error("node {node}: this node is shut down")]
    Shutdown { node: u32 },
    #[error("endpoint: {0}")]
    Endpoint(String),
    #[error("TLS configuration: {0}")]
    Tls(String),
}

impl QuicError {
    /// True for a dial that did not produce a connection (in time), as opposed to the loss
    /// of an established connection: trying again later may succeed.
    pub fn is_dial_failure(&self) -> bool {
        matches!(
            self,
            QuicError::ConnectTimeout { .. } | QuicError::Connect { .. }
        )
    }

    /// The peer node the error is about, if any.
    pub fn node(&self) -> Option<u32> {
        match self {
            QuicError::Endpoint(_) | QuicError::Tls(_) => None,
            QuicError::UnknownNode { node }
            | QuicError::Connect { node, .. }
            | QuicError::ConnectTimeout { node, .. }
            | QuicError::SendTimeout { node, .. }
            | QuicError::PeerLost { node, .. }
            | QuicError::Send { node, .. }
            | QuicError::QueueFull { node, .. }
            | QuicError::TooLarge { node, .. }
            | QuicError::FlushTimeout { node, .. }
            | QuicError::Shutdown { node } => Some(*node),
        }
    }
}

impl From<QuicError> for TransportError {
    fn from(e: QuicError) -> Self {
        match e.node() {
            Some(node) => TransportError::Peer {
                node,
                reason: e.to_string(),
            },
            None => TransportError::Local(e.to_string()),
        }
    }
}

/// Application error codes a receiver stops a stream (or closes a connection) with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum StopCode {
    /// Graceful shutdown (connection close).
    Shutdown = 0,
    UnknownPartition = 1,
    UnknownRun = 2,
    StaleEpoch = 3,
    BadFrame = 4,
    Timeout = 5,
    /// Hello refused: wrong protocol, or a certificate not valid for the claimed node.
    Refused = 6,
}

impl StopCode {
    pub fn of_rejection(r: &Rejection) -> Self {
        match r {
            Rejection::UnknownPartition(_) => StopCode::UnknownPartition,
            Rejection::UnknownRun(_) => StopCode::UnknownRun,
            Rejection::StaleEpoch { .. } => StopCode::StaleEpoch,
            Rejection::Fenced(_) => StopCode::Refused,
        }
    }

    pub fn from_code(code: u64) -> Option<Self> {
        Some(match code {
            0 => StopCode::Shutdown,
            1 => StopCode::UnknownPartition,
            2 => StopCode::UnknownRun,
            3 => StopCode::StaleEpoch,
            4 => StopCode::BadFrame,
            5 => StopCode::Timeout,
            6 => StopCode::Refused,
            _ => return None,
        })
    }

    pub fn varint(self) -> quinn::VarInt {
        quinn::VarInt::from_u32(self as u32)
    }
}
