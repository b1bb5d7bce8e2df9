//! Where a batch stream stands, so that a resumed run reads on from the batch after the
//! last one it trained on.
//!
//! Every stream of this crate is a pure function of its configuration and of its
//! position: the corpus batchers ([`NmtStream`](crate::NmtStream),
//! [`LmStream`](crate::LmStream)) of the epoch and the batches of it already handed out
//! (the epoch's shuffles are drawn from `(seed, epoch)` and need no other state), the
//! synthetic generators of their ChaCha8 generator's word position. A stream rebuilt with
//! the same configuration and moved to a saved position hands out the same batches as the
//! stream that saved it would have.

use serde::{Deserialize, Serialize};

/// A position in a stream of epochs: epoch `epoch`, of which `batch` batches were handed
/// out (`batch` equal to the epoch's length is the same place as the next epoch's start).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochPosition {
    /// The epoch (0-based).
    pub epoch: u64,
    /// Batches of that epoch already handed out.
    pub batch: u64,
}

/// A position in a synthetic stream: its generator's state after `batches` batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyntheticPosition {
    /// Batches handed out.
    pub batches: u64,
    /// Word position of the rank's ChaCha8 generator (seeded with `seed + rank`, stream 0).
    pub word_pos: u128,
}
