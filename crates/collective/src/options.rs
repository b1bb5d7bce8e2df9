//! What to reduce and how: operation, algorithm, scaling and wire compression.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The reduction applied element-wise across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks, then multiplied by `1 / size` (as a postscale factor).
    Average,
    /// Minimum over ranks (NaN propagates).
    Min,
    /// Maximum over ranks (NaN propagates).
    Max,
}

impl ReduceOp {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Average => "average",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "average" | "avg" | "mean" => Ok(ReduceOp::Average),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            _ => Err(Error::invalid(
                "reduce op",
                s,
                "use one of sum, average, min, max",
            )),
        }
    }
}

/// Which all-reduce algorithm runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring reduce-scatter + all-gather, pipelined in segments (bandwidth-optimal).
    Ring,
    /// The transport's own all-reduce (`MPI_Allreduce`): the baseline.
    Mpi,
    /// Recursive doubling with a fold-in step for ranks beyond the largest power of two
    /// (latency-optimal; for small messages).
    RecursiveDoubling,
    /// Rabenseifner's halving-doubling: reduce-scatter by recursive halving, all-gather by
    /// recursive doubling, with the same fold-in step as recursive doubling (bandwidth of
    /// the ring in log₂ steps instead of N − 1; for mid-sized messages).
    HalvingDoubling,
    /// Every rank sends its whole message to every other rank at once and sums the N
    /// contributions locally in rank order (one message step however many ranks, at
    /// N − 1 times the message's bytes sent and held by each rank; for small messages).
    Direct,
    /// A direct reduce-scatter, then a direct all-gather: every rank sends chunk p of
    /// its message to rank p and reduces the N copies of its own chunk in rank order,
    /// then sends its reduced chunk to every other rank (two message steps however many
    /// ranks, moving the ring's bytes; for mid-sized messages at few ranks).
    ScatterGather,
    /// Scatter-gather through a memory segment that every rank maps, instead of messages:
    /// every rank copies its message into its slot, reduces its chunk from every rank's
    /// slot in rank order and copies the other ranks' reduced chunks out of theirs
    /// ([`crate::shared_memory`]). Every rank must be on one node. The bits of
    /// [`Algorithm::Direct`].
    SharedMemory,
    /// For ranks on several nodes: within each node a reduce-scatter (through shared
    /// memory, or a ring), then across nodes an all-reduce of each share among the ranks
    /// holding it, then within each node an all-gather; a layout with different rank
    /// counts per node reduces within each node, across nodes among the first ranks, and
    /// broadcasts within each node ([`crate::hierarchical`]). Chosen by name only:
    /// [`Algorithm::Auto`] never takes it.
    Hierarchical,
    /// The fastest of direct, scatter-gather, recursive doubling, halving-doubling, the ring
    /// and shared memory as measured for the rank count and message size
    /// ([`crate::algorithm_choice`]); shared memory only while every rank can map its
    /// segment.
    Auto,
}

impl Algorithm {
    /// Lower-case name as accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Mpi => "mpi",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::HalvingDoubling => "hd",
            Algorithm::Direct => "direct",
            Algorithm::ScatterGather => "sg",
            Algorithm::SharedMemory => "shm",
            Algorithm::Hierarchical => "hier",
            Algorithm::Auto => "auto",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "ring" | "xring" => Ok(Algorithm::Ring),
            "mpi" => Ok(Algorithm::Mpi),
            "rd" | "recursive-doubling" | "recursive_doubling" => Ok(Algorithm::RecursiveDoubling),
            "hd" | "halving-doubling" | "halving_doubling" => Ok(Algorithm::HalvingDoubling),
            "direct" => Ok(Algorithm::Direct),
            "sg" | "scatter-gather" | "scatter_gather" => Ok(Algorithm::ScatterGather),
            "shm" | "shared-memory" | "shared_memory" => Ok(Algorithm::SharedMemory),
            "hier" | "hierarchical" => Ok(Algorithm::Hierarchical),
            "auto" => Ok(Algorithm::Auto),
            _ => Err(Error::invalid(
                "all-reduce algorithm",
                s,
                "use one of ring, mpi, rd (recursive doubling), hd (halving-doubling), direct, sg (scatter-gather), shm (shared memory, one node), hier (hierarchical, several nodes), auto",
            )),
        }
    }
}

/// Written as its name ([`Algorithm::name`]), as a configuration file holds it.
impl serde::Serialize for Algorithm {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// Read from any spelling [`FromStr`] accepts.
impl<'de> serde::Deserialize<'de> for Algorithm {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// Narrower element type used on the wire for f32 tensors (cast, reduce, cast back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WireCompression {
    /// Send f32 as is.
    #[default]
    None,
    /// Send f32 tensors as IEEE half.
    F16,
    /// Send f32 tensors as bfloat16.
    Bf16,
}

impl WireCompression {
    /// Lower-case name as accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            WireCompression::None => "none",
            WireCompression::F16 => "f16",
            WireCompression::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for WireCompression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WireCompression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "off" => Ok(WireCompression::None),
            "f16" | "fp16" | "half" => Ok(WireCompression::F16),
            "bf16" | "bfloat16" => Ok(WireCompression::Bf16),
            _ => Err(Error::invalid(
                "wire compression",
                s,
                "use one of none, f16, bf16",
            )),
        }
    }
}

/// Options of one all-reduce.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AllReduceOptions {
    /// Element-wise reduction.
    pub op: ReduceOp,
    /// Algorithm to run.
    pub algorithm: Algorithm,
    /// Every rank's input is multiplied by this before reducing (skipped when 1).
    pub prescale: f64,
    /// The result is multiplied by this after reducing (times `1 / size` for Average).
    pub postscale: f64,
    /// Wire type for f32 tensors.
    pub compression: WireCompression,
}

impl Default for AllReduceOptions {
    fn default() -> Self {
        AllReduceOptions {
            op: ReduceOp::Sum,
            algorithm: Algorithm::Auto,
            prescale: 1.0,
            postscale: 1.0,
            compression: WireCompression::None,
        }
    }
}

impl AllReduceOptions {
    /// Sum with the automatic algorithm choice.
    pub fn sum() -> Self {
        Self::default()
    }

    /// Average with the automatic algorithm choice.
    pub fn average() -> Self {
        Self::with_op(ReduceOp::Average)
    }

    /// The given operation, other fields default.
    pub fn with_op(op: ReduceOp) -> Self {
        AllReduceOptions {
            op,
            ..Self::default()
        }
    }

    /// The same options with another algorithm.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The options as `(name, value)` pairs for
    /// [`crate::Communicator::check_same_values`]: every rank must reduce with the same
    /// ones (a different algorithm or wire type sends messages the others do not expect,
    /// a different operation or scale gives different sums).
    pub fn shared_settings(&self) -> Vec<(String, String)> {
        crate::agreement::named([
            ("op", self.op.to_string()),
            ("algorithm", self.algorithm.to_string()),
            ("prescale", self.prescale.to_string()),
            ("postscale", self.postscale.to_string()),
            ("compression", self.compression.to_string()),
        ])
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if !self.prescale.is_finite() {
            return Err(Error::invalid(
                "prescale",
                self.prescale,
                "use a finite factor (1.0 for none)",
            ));
        }
        if !self.postscale.is_finite() {
            return Err(Error::invalid(
                "postscale",
                self.postscale,
                "use a finite factor (1.0 for none)",
            ));
        }
        Ok(())
    }

    /// The factor applied after the reduction on `size` ranks.
    pub(crate) fn effective_postscale(&self, size: usize) -> f64 {
        match self.op {
            ReduceOp::Average => self.postscale / size as f64,
            _ => self.postscale,
        }
    }
}
