//! Launch plumbing shared by the op API on device operands (`launch_sparse.rs`,
//! `launch_dense.rs`: one method per kernel of `kernels.cu`, which checks shapes and index
//! bounds on the host, picks the grid, and enqueues the kernel on the compute stream).
//!
//! The invariant every `unsafe` launch of those files relies on: (1) the arguments are pushed in
//! the order and with the types of the kernel's signature in `kernels.cu`; (2) the kernel touches
//! only elements below the sizes it is given, and those sizes were checked against the buffers'
//! lengths just before (buffers hold at least their logical length); (3) index operands were
//! checked against the rows they index (host-side bounds of [`crate::cuda::DeviceIndex`] and
//! [`crate::cuda::DeviceCsr`], validated when uploaded); (4) buffer lifetime vs stream completion:
//! every buffer is borrowed until the launch is enqueued, and cudarc frees device memory in stream
//! order (and makes other streams wait on its recorded events), so no kernel can see a freed
//! buffer.
use super::memory::DeviceTensor;
use crate::ops::Activation;
use crate::DropoutKey;
use cudarc::driver::{CudaSlice, LaunchConfig};

/// Threads per block of every kernel (a multiple of the warp size).
pub(crate) const BLOCK: u32 = 256;
/// Most blocks launched; grid-stride loops cover the rest.
const MAX_BLOCKS: u64 = 1 << 20;

/// The grid for a grid-stride loop over `items` work items, `per_block` items per block per
/// pass; `None` when there is nothing to do (a zero-block launch is an error in CUDA).
pub(crate) fn grid(items: u64, per_block: u64) -> Option<LaunchConfig> {
    if items == 0 {
        return None;
    }
    let blocks = items.div_ceil(per_block.max(1)).min(MAX_BLOCKS) as u32;
    Some(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One thread per item.
pub(crate) fn grid1(items: usize) -> Option<LaunchConfig> {
    grid(items as u64, BLOCK as u64)
}

/// Enqueues kernel `$name` on the compute stream with `$args` (each a reference that outlives
/// the statement) if `$cfg` is `Some`. Must be used inside an `unsafe` block whose comment
/// states why the launch is sound.
macro_rules! launch {
    ($s:expr, $name:literal, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        match $cfg {
            None => Ok(()),
            Some(cfg) => {
                let f = $s.dev.kernel($name)?;
                let mut b = $s.compute.launch_builder(f);
                $( b.arg($arg); )*
                b.launch(cfg).map(|_| ()).map_err(|e| $crate::GpuError::cuda($name, e))
            }
        }
    }};
}
pub(crate) use launch;

/// Per-entry weights for [`super::GpuStream::spmm`] (as [`crate::EdgeWeights`], on the device).
#[derive(Debug, Clone, Copy)]
pub enum DeviceWeights<'a> {
    /// Every entry weighs 1.
    Ones,
    /// The matrix's own values.
    Stored,
    /// `heads` weights per entry, entry-major (an `nnz x heads` tensor).
    PerHead(&'a DeviceTensor, usize),
}

/// One bit per element, set where the element is positive (ReLU's backward mask).
#[derive(Debug)]
pub struct DeviceBits {
    pub(crate) len: usize,
    pub(crate) words: CudaSlice<u64>,
}

pub(crate) fn act_code(act: Activation) -> (i32, f32) {
    match act {
        Activation::Identity => (0, 0.0),
        Activation::Relu => (1, 0.0),
        Activation::Elu { alpha } => (2, alpha),
        Activation::LeakyRelu { slope } => (3, slope),
    }
}

/// The counter word `layer << 16 | site` of a dropout key (as [`DropoutKey::counter`]).
pub(crate) fn layer_site(key: DropoutKey) -> u32 {
    key.counter(0, 0)[1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_every_item_and_skip_empty_work() {
        assert!(grid(0, 256).is_none());
        let g = grid(1, 256).unwrap();
        assert_eq!((g.grid_dim.0, g.block_dim.0), (1, BLOCK));
        assert_eq!(grid(257, 256).unwrap().grid_dim.0, 2);
        // Row-per-warp SpMM: 8 rows per block.
        assert_eq!(grid(17, 8).unwrap().grid_dim.0, 3);
        // Huge sizes are capped; kernels grid-stride over the rest (no u32 overflow).
        assert_eq!(
            grid(u64::MAX / 2, 256).unwrap().grid_dim.0,
            MAX_BLOCKS as u32
        );
        assert_eq!(BLOCK % 32, 0);
    }

    #[test]
    fn layer_site_is_the_counter_word() {
        let key = DropoutKey {
            seed: 1,
            epoch: 2,
            layer: 3,
            site: 4,
        };
        assert_eq!(layer_site(key), 3 << 16 | 4);
    }
}
