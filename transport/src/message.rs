//! Message types shared by every transport.
use crate::TraceContext;
use std::fmt;
use std::sync::Arc;

/// A partition id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartId(pub u32);

impl fmt::Display for PartId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identifies one training run; messages of other runs are dropped.
pub type RunId = uuid::Uuid;

/// Which pass a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Training forward: halo rows of a layer's output.
    Forward,
    /// Training backward: gradients of halo rows, sent back to their owners.
    Backward,
    /// Evaluation forward (no dropout).
    Eval,
}

/// Addressing and sequencing of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgHeader {
    pub run: RunId,
    pub epoch: u32,
    /// The layer whose output (forward) or input gradient (backward) the payload holds; with
    /// [`TRANSFORMED`] set, the layer's transformed rows `Z` (forward) or their gradient
    /// (backward) for a split layer.
    pub layer: u16,
    pub phase: Phase,
    pub from: PartId,
    pub to: PartId,
}

/// Flag in [`MsgHeader::layer`]: the payload holds a split layer's transformed rows (or
/// their gradients), exchanged between the layer's two stages. Layer numbers stay below it.
pub const TRANSFORMED: u16 = 0x8000;

/// Flag in [`MsgHeader::layer`], beside [`TRANSFORMED`]: the payload holds the changes of a
/// split layer's degree-scaled transformed rows (a serving partition's incremental update of
/// the rows they reach). Layer numbers stay below it.
pub const INCREMENT: u16 = 0x4000;

/// A shared, immutable f32 buffer: moving it between actors never copies the rows.
pub type SharedBuf = Arc<[f32]>;

/// A halo block's rows: exact fp32, or encoded by a halo codec ([`crate::codec`]).
#[derive(Debug, Clone)]
pub enum HaloPayload {
    /// The rows as they are (`rows * cols` values), shared: in-process never copied.
    F32(SharedBuf),
    /// The rows encoded by a lossy codec: codec id, format version, scales, packed codes.
    Encoded(Arc<[u8]>),
}

impl HaloPayload {
    /// Bytes of the payload as it travels.
    pub fn len_bytes(&self) -> u64 {
        match self {
            HaloPayload::F32(d) => d.len() as u64 * 4,
            HaloPayload::Encoded(b) => b.len() as u64,
        }
    }
}

/// Rows of embeddings (forward) or gradients (backward) for the receiver's halo exchange.
///
/// The rows are in the order both sides agreed on when the graph was partitioned: the
/// sender's send list to the receiver (ascending global id).
#[derive(Debug, Clone)]
pub struct HaloBlock {
    pub header: MsgHeader,
    pub rows: u32,
    pub cols: u32,
    pub payload: HaloPayload,
    /// The sending span's trace context, when the sender traces (W3C `traceparent`).
    pub trace: Option<TraceContext>,
}

impl HaloBlock {
    /// Payload size in bytes, as sent (encoded when a codec is on).
    pub fn payload_bytes(&self) -> u64 {
        self.payload.len_bytes()
    }

    /// What the payload would take as exact fp32 rows.
    pub fn raw_bytes(&self) -> u64 {
        self.rows as u64 * self.cols as u64 * 4
    }

    /// The rows as fp32 values (`rows * cols`, row-major): the shared buffer itself when
    /// exact, decoded (and checked) when encoded.
    pub fn values(&self) -> Result<std::borrow::Cow<'_, [f32]>, crate::codec::CodecError> {
        match &self.payload {
            HaloPayload::F32(d) => Ok(std::borrow::Cow::Borrowed(&d[..])),
            HaloPayload::Encoded(b) => Ok(std::borrow::Cow::Owned(crate::codec::decode(
                b,
                self.rows as usize,
                self.cols as usize,
            )?)),
        }
    }

    /// The rows' values written into `out` (`cols` wide), row `r` at row `place(r)`: copied,
    /// or decoded in place when encoded; a place past the end of `out` is an error.
    pub fn values_into(
        &self,
        out: &mut [f32],
        place: &dyn Fn(usize) -> usize,
    ) -> Result<(), crate::codec::CodecError> {
        let (rows, cols) = (self.rows as usize, self.cols as usize);
        match &self.payload {
            HaloPayload::F32(d) => crate::codec::place_rows(d, rows, cols, out, place),
            HaloPayload::Encoded(b) => crate::codec::decode_into(b, rows, cols, out, place),
        }
    }
}
