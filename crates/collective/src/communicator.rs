//! [`Communicator`]: the collectives, written once against a [`Transport`].

use std::ops::Range;
use std::path::PathBuf;

use half::{bf16, f16};

use crate::dtype::{DType, Element, TensorMut};
use crate::error::{Error, Result};
use crate::hierarchical::Hierarchy;
use crate::options::{Algorithm, AllReduceOptions, ReduceOp, WireCompression};
use crate::pieces;
use crate::shared_memory::NodeSegment;
use crate::stall::Operation;
use crate::transport::{LocalTransport, NodeRank, Transport};

/// Default ring pipeline segment: small enough that a received segment is still in cache
/// when it is reduced, large enough that per-message costs vanish.
pub const DEFAULT_SEGMENT_BYTES: usize = 256 * 1024;

/// The size below which [`Algorithm::Auto`] picked recursive doubling before its choice
/// was measured per rank count ([`crate::algorithm_choice`]); a rule
/// [`Communicator::set_auto_threshold_bytes`] can bring back with any size.
pub const DEFAULT_AUTO_THRESHOLD_BYTES: usize = 64 * 1024;

/// The smallest average piece [`Communicator::all_reduce_pieces`] reduces where the
/// pieces lie with a message-passing algorithm (the ring, recursive doubling,
/// halving-doubling, scatter-gather): smaller ones are copied into one buffer, since a
/// transport that sends pieces where they lie pays per piece (over MPI a datatype block,
/// packed and unpacked one by one), and a thousand pieces of 256 bytes cost more that way
/// than copying them.
/// Measured with Open MPI over shared memory at 2 and 4 ranks, where 1 KiB pieces cost
/// about the same both ways and 4 KiB pieces a quarter less in place.
pub const MIN_IN_PLACE_PIECE_BYTES: usize = 1024;

/// [`MIN_IN_PLACE_PIECE_BYTES`] of [`Algorithm::SharedMemory`], which copies the pieces
/// into its slots and out of them itself, a run at a time (no datatype, no message per
/// piece): at 256 B a piece costs less that way than copied into one buffer and back out,
/// at 64 B more (`cargo bench -p ringtrain --bench collective`, its `pieces` rows and
/// summary, measure both ways on the machine at hand).
pub const MIN_SHARED_MEMORY_PIECE_BYTES: usize = 256;

/// The smallest average piece [`Communicator::all_reduce_pieces`] reduces where the pieces
/// lie with `algorithm` (resolved), or `None` where it always works on one buffer.
pub fn min_in_place_piece_bytes(algorithm: Algorithm) -> Option<usize> {
    match algorithm {
        Algorithm::SharedMemory => Some(MIN_SHARED_MEMORY_PIECE_BYTES),
        Algorithm::Ring
        | Algorithm::RecursiveDoubling
        | Algorithm::HalvingDoubling
        | Algorithm::ScatterGather
        | Algorithm::Hierarchical => Some(MIN_IN_PLACE_PIECE_BYTES),
        Algorithm::Auto | Algorithm::Direct | Algorithm::Mpi => None,
    }
}

/// Element range of chunk `chunk` when `len` elements are split over `size` ranks:
/// the first `len % size` chunks are one element longer.
pub fn ring_chunk_range(len: usize, size: usize, chunk: usize) -> Range<usize> {
    let size = size.max(1);
    let base = len / size;
    let extra = len % size;
    let start = chunk * base + chunk.min(extra);
    let end = start + base + usize::from(chunk < extra);
    start..end
}

/// Whether the ranks share a segment for [`Algorithm::SharedMemory`].
#[derive(Debug)]
enum SegmentState {
    /// Not tried yet: `auto` counts on one.
    Untried,
    /// Mapped by every rank.
    Mapped(Box<NodeSegment>),
    /// Some rank could not map it (why): `auto` chooses among the others from now on.
    Unavailable(String),
}

/// A group of ranks and the collectives between them.
///
/// Holds the transport and reusable scratch buffers, so repeated calls do not allocate.
/// Every rank must call the same collectives in the same order with the same lengths
/// (except [`Communicator::all_gather`], whose lengths may differ per rank).
pub struct Communicator {
    transport: Box<dyn Transport>,
    rank: usize,
    size: usize,
    segment_bytes: usize,
    /// Set by [`Communicator::set_auto_threshold_bytes`]: replaces the measured choice.
    auto_threshold_bytes: Option<usize>,
    /// Set by [`Communicator::set_min_in_place_piece_bytes`]: replaces
    /// [`min_in_place_piece_bytes`] for every algorithm that reduces pieces in place.
    min_in_place_piece_bytes: Option<usize>,
    /// Receive buffer, `u64`-backed so that any element type can view it aligned.
    scratch: Vec<u64>,
    /// One buffer for a message in pieces where an algorithm needs one
    /// ([`Communicator::all_reduce_pieces`]), `u64`-backed like `scratch`.
    staging: Vec<u64>,
    /// Narrow copies of f32 data for wire compression.
    wire_f16: Vec<f16>,
    wire_bf16: Vec<bf16>,
    /// The segment of [`Algorithm::SharedMemory`], made by its first call.
    node_segment: SegmentState,
    /// Where that segment is made; `None`: shared memory is off.
    shared_memory_dir: Option<PathBuf>,
    /// The nodes and the communicators of [`Algorithm::Hierarchical`], made by its first
    /// call.
    pub(crate) hierarchy: Option<Box<Hierarchy>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("transport", &self.transport.name())
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("segment_bytes", &self.segment_bytes)
            .field("auto_threshold_bytes", &self.auto_threshold_bytes)
            .field("min_in_place_piece_bytes", &self.min_in_place_piece_bytes)
            .finish()
    }
}

/// Grows `buf` to at least `bytes` bytes and returns exactly that many as a byte slice.
fn scratch_bytes(buf: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = bytes.div_ceil(8);
    if buf.len() < words {
        buf.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buf[..words])[..bytes]
}

/// Views received bytes as elements (the buffers are 8-byte aligned and whole elements).
fn elements<T: Element>(bytes: &[u8], rank: usize) -> Result<&[T]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| Error::Transport {
        rank,
        detail: format!(
            "received {} bytes that are not whole aligned {} elements: {e}",
            bytes.len(),
            T::DTYPE
        ),
    })
}

fn elements_mut<T: Element>(bytes: &mut [u8], rank: usize) -> Result<&mut [T]> {
    let len = bytes.len();
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| Error::Transport {
        rank,
        detail: format!(
            "scratch of {len} bytes cannot hold {} elements: {e}",
            T::DTYPE
        ),
    })
}

/// `acc[i] = acc[i] (op) src[i]` through the kernels.
pub(crate) fn reduce_into<T: Element>(op: ReduceOp, acc: &mut [T], src: &[T]) -> Result<()> {
    match op {
        ReduceOp::Sum | ReduceOp::Average => T::sum_into(acc, src)?,
        ReduceOp::Min => T::min_into(acc, src)?,
        ReduceOp::Max => T::max_into(acc, src)?,
    }
    Ok(())
}

fn bytes_of<T: bytemuck::Pod>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_of_mut<T: bytemuck::Pod>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    /// Wraps a transport.
    pub fn new(transport: impl Transport + 'static) -> Self {
        Self::boxed(Box::new(transport))
    }

    fn boxed(transport: Box<dyn Transport>) -> Self {
        let rank = transport.rank();
        let size = transport.size();
        Communicator {
            transport,
            rank,
            size,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            auto_threshold_bytes: None,
            min_in_place_piece_bytes: None,
            scratch: Vec::new(),
            staging: Vec::new(),
            wire_f16: Vec::new(),
            wire_bf16: Vec::new(),
            node_segment: SegmentState::Untried,
            shared_memory_dir: Some(PathBuf::from(crate::shared_memory::DEFAULT_SEGMENT_DIR)),
            hierarchy: None,
        }
    }

    /// `n` communicators over a [`LocalTransport`], rank `i` at index `i`; move each into
    /// its own thread.
    pub fn local(n: usize) -> Result<Vec<Communicator>> {
        Self::local_on_nodes(&[n])
    }

    /// [`Communicator::local`] with the ranks laid out on nodes as
    /// [`LocalTransport::create_on_nodes`] does: `ranks_per_node[j]` ranks on node `j`.
    pub fn local_on_nodes(ranks_per_node: &[usize]) -> Result<Vec<Communicator>> {
        Ok(LocalTransport::create_on_nodes(ranks_per_node)?
            .into_iter()
            .map(Communicator::new)
            .collect())
    }

    /// Initialises MPI (once per process) and returns the world communicator.
    #[cfg(feature = "mpi")]
    pub fn mpi() -> Result<Communicator> {
        Ok(Communicator::new(
            crate::mpi_transport::MpiTransport::init()?
        ))
    }

    /// Runs `f` on `n` threads, each with its own rank of a local communicator, and returns
    /// the results in rank order. A panic in any rank is re-raised here.
    pub fn run_local<R, F>(n: usize, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(Communicator) -> R + Sync,
    {
        Self::run_local_on_nodes(&[n], f)
    }

    /// [`Communicator::run_local`] with the ranks laid out on nodes as
    /// [`Communicator::local_on_nodes`] does.
    pub fn run_local_on_nodes<R, F>(ranks_per_node: &[usize], f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(Communicator) -> R + Sync,
    {
        let comms = Communicator::local_on_nodes(ranks_per_node)?;
        let n = comms.len();
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| scope.spawn(move || f(comm)))
                .collect();
            let mut out = Vec::with_capacity(n);
            for h in handles {
                match h.join() {
                    Ok(r) => out.push(r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            Ok(out)
        })
    }

    /// A communicator over the same ranks whose messages never mix with this one's
    /// (`MPI_Comm_dup`), with the same settings. The two may be used from different
    /// threads at once: a trainer reduces gradients on one (inside a [`crate::FusionEngine`])
    /// and exchanges control messages (agreements, summaries) on the other. Collective:
    /// every rank calls it, in the same order.
    pub fn duplicate(&self) -> Result<Communicator> {
        Ok(Communicator::boxed(self.transport.duplicate()?).with_settings_of(self))
    }

    /// This communicator with `other`'s settings (segment size, `auto`'s rule, pieces
    /// reduced in place, shared-memory directory).
    fn with_settings_of(mut self, other: &Communicator) -> Communicator {
        self.adopt_settings_of(other);
        self
    }

    /// Takes `other`'s settings (see [`Communicator::with_settings_of`]); a changed
    /// shared-memory directory as [`Communicator::set_shared_memory_dir`] does.
    pub(crate) fn adopt_settings_of(&mut self, other: &Communicator) {
        self.segment_bytes = other.segment_bytes;
        self.auto_threshold_bytes = other.auto_threshold_bytes;
        self.min_in_place_piece_bytes = other.min_in_place_piece_bytes;
        if self.shared_memory_dir != other.shared_memory_dir {
            self.set_shared_memory_dir(other.shared_memory_dir.clone());
        }
    }

    /// The ranks `members` (ascending, this rank among them) as a communicator of their
    /// own, ranks `0..members.len()` (`MPI_Comm_split`): e.g. the same pipeline stage of
    /// every replica. Its messages never mix with this communicator's. Collective over
    /// THIS communicator: every rank calls it at the same point, each with its group.
    ///
    /// # Errors
    /// [`Error::Transport`] for a bad member list; the duplicate's errors.
    pub fn subgroup(&self, members: &[usize]) -> Result<Communicator> {
        let inner = self.transport.duplicate()?;
        let sub = crate::subgroup::SubgroupTransport::new(inner, members.to_vec())?;
        Ok(Communicator::boxed(Box::new(sub)).with_settings_of(self))
    }

    /// This rank's index among the ranks on its node and their number (one rank per GPU:
    /// the node rank picks the device). Collective: every rank calls it. On a
    /// [`Communicator::subgroup`], the members count among themselves, by their node keys
    /// (the grouping of [`Communicator::nodes`]).
    pub fn node_rank(&self) -> Result<NodeRank> {
        self.transport.node_rank()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The transport's name (`local`, `mpi`).
    pub fn transport_name(&self) -> &'static str {
        self.transport.name()
    }

    /// Sets how long a collective may wait on other ranks without progress before it
    /// fails (`None`: wait for ever); see [`crate::stall`]. The default is
    /// [`crate::DEFAULT_STALL_TIMEOUT`]. Applies to this communicator and every duplicate
    /// made of it, before or after.
    pub fn set_stall_timeout(&self, timeout: Option<std::time::Duration>) {
        self.transport.stall_watch().set_timeout(timeout);
    }

    /// The stall timeout (`None`: off).
    pub fn stall_timeout(&self) -> Option<std::time::Duration> {
        self.transport.stall_watch().timeout()
    }

    /// Says what the program is doing (for example `training step 12`), for stall
    /// warnings and errors. Shared with every duplicate.
    pub fn set_stall_context(&self, context: impl Into<String>) {
        self.transport.stall_watch().set_context(context.into());
    }

    pub(crate) fn begin(&self, name: &'static str, dtype: Option<DType>, bytes: usize) {
        self.transport
            .stall_watch()
            .begin(Operation { name, dtype, bytes });
    }

    /// One negotiation round of the fusion engine: [`Communicator::all_gather_bytes`],
    /// named as such in stall messages.
    pub(crate) fn negotiate(&mut self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.begin("fusion negotiation", None, send.len());
        self.transport.exchange_all(send)
    }

    /// Sets the ring pipeline segment size (rounded up to a multiple of 8 bytes).
    pub fn set_segment_bytes(&mut self, bytes: usize) {
        self.segment_bytes = bytes.max(8).div_ceil(8) * 8;
    }

    /// The ring pipeline segment size in bytes.
    pub fn segment_bytes(&self) -> usize {
        self.segment_bytes
    }

    /// Where [`Algorithm::SharedMemory`] makes the segment the ranks share (default
    /// [`crate::shared_memory::DEFAULT_SEGMENT_DIR`], `/dev/shm`): a directory in memory
    /// of this node. `None` turns shared memory off on this rank: the first all-reduce
    /// that would use it finds that out on every rank at once, an explicit
    /// shared-memory all-reduce then fails on every rank, and [`Algorithm::Auto`]
    /// chooses among the other algorithms from then on. Rank 0's directory is the one
    /// used. Forgets a segment made before, and whether one could be made: the next
    /// shared-memory all-reduce tries again (collective: call it on every rank).
    pub fn set_shared_memory_dir(&mut self, dir: Option<PathBuf>) {
        self.shared_memory_dir = dir;
        self.node_segment = SegmentState::Untried;
    }

    /// Replaces the measured choice of [`Algorithm::Auto`] with a fixed rule: recursive
    /// doubling below `bytes`, ring from `bytes` up.
    pub fn set_auto_threshold_bytes(&mut self, bytes: usize) {
        self.auto_threshold_bytes = Some(bytes);
    }

    /// Replaces the smallest average piece that [`Communicator::all_reduce_pieces`]
    /// reduces where the pieces lie ([`min_in_place_piece_bytes`] of each algorithm that
    /// can) with `bytes` for all of them; `None` restores the measured defaults. For
    /// tuning on another machine: `benches/collective.rs` measures both ways. Set the same
    /// value on every rank, as with [`Communicator::set_auto_threshold_bytes`]: the fusion
    /// engine's armed groups choose how to vote by it (its start checks that the ranks
    /// agree, [`Communicator::shared_settings`]).
    pub fn set_min_in_place_piece_bytes(&mut self, bytes: Option<usize>) {
        self.min_in_place_piece_bytes = bytes;
    }

    /// The settings of this communicator that decide how a reduction is carved into
    /// messages, which every rank must share: the ring's segment size, the fixed rule
    /// that replaces [`crate::Algorithm::Auto`]'s choice, and the smallest piece reduced
    /// where it lies, as `(name, value)` pairs for [`Communicator::check_same_values`]
    /// (which [`crate::FusionEngine::start`] calls with them).
    pub fn shared_settings(&self) -> Vec<(String, String)> {
        let optional =
            |v: Option<usize>| v.map_or_else(|| "measured".to_string(), |b| b.to_string());
        crate::agreement::named([
            ("segment_bytes", self.segment_bytes.to_string()),
            ("auto_threshold_bytes", optional(self.auto_threshold_bytes)),
            (
                "min_in_place_piece_bytes",
                optional(self.min_in_place_piece_bytes),
            ),
        ])
    }

    /// The algorithm [`Algorithm::Auto`] resolves to for a message of `bytes` bytes:
    /// the fastest of ours as measured for this rank count and size
    /// ([`crate::algorithm_choice`]).
    pub fn resolve_algorithm(&self, algorithm: Algorithm, bytes: usize) -> Algorithm {
        match (algorithm, self.auto_threshold_bytes) {
            (Algorithm::Auto, Some(threshold)) if bytes < threshold => Algorithm::RecursiveDoubling,
            (Algorithm::Auto, Some(_)) => Algorithm::Ring,
            (Algorithm::Auto, None)
                if !matches!(self.node_segment, SegmentState::Unavailable(_))
                    && bytes >= crate::algorithm_choice::shared_memory_from(self.size) =>
            {
                Algorithm::SharedMemory
            }
            (Algorithm::Auto, None) => crate::algorithm_choice::measured_choice(self.size, bytes),
            (other, _) => other,
        }
    }

    /// The underlying transport.
    pub fn transport(&self) -> &dyn Transport {
        self.transport.as_ref()
    }

    /// All-reduces `buf` in place: every rank ends with the same bits.
    ///
    /// Any length works, including 0 and lengths below the rank count.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], opts: &AllReduceOptions) -> Result<()> {
        self.all_reduce_pieces(&mut [buf], opts)
    }

    /// All-reduces the message that `pieces` make up (their concatenation, in order) in
    /// place, where they lie: the bits [`Communicator::all_reduce`] gives the concatenation.
    ///
    /// A group of tensors is reduced this way without copying it into one buffer and back.
    /// The ring, recursive doubling, halving-doubling and scatter-gather send from and
    /// reduce into the pieces themselves (over MPI, several pieces go as one message
    /// through a derived datatype), and shared memory copies them into its slots and out
    /// of them; direct, `MPI_Allreduce` and wire compression work on one buffer, and get
    /// the pieces copied into one, as do pieces smaller than
    /// [`min_in_place_piece_bytes`] on average ([`Communicator::reduces_in_place`]).
    ///
    /// ```
    /// use ringtrain_collective::{AllReduceOptions, Communicator};
    ///
    /// let sums = Communicator::run_local(2, |mut comm| {
    ///     let r = comm.rank() as f32;
    ///     let (mut a, mut b) = (vec![r; 3], vec![10.0 * r; 2]);
    ///     let opts = AllReduceOptions::default();
    ///     comm.all_reduce_pieces(&mut [&mut a[..], &mut b[..]], &opts).unwrap();
    ///     (a, b)
    /// })
    /// .unwrap();
    /// assert_eq!(sums[1], (vec![1.0; 3], vec![10.0; 2]));
    /// ```
    pub fn all_reduce_pieces<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        opts: &AllReduceOptions,
    ) -> Result<()> {
        opts.validate()?;
        let bytes = pieces::total(pieces) * T::BYTES;
        if pieces.len() > 1 && !self.reduces_in_place(T::DTYPE, opts, pieces.len(), bytes) {
            return self.through_one_buffer(pieces, |comm, buf| comm.all_reduce(buf, opts));
        }
        if T::DTYPE == DType::F32 && opts.compression != WireCompression::None {
            return self.through_one_buffer(pieces, |comm, buf| {
                comm.all_reduce_compressed(bytemuck::cast_slice_mut(buf), opts)
            });
        }
        if opts.prescale != 1.0 {
            for piece in pieces.iter_mut() {
                T::scale(piece, opts.prescale);
            }
        }
        if self.size > 1 && bytes > 0 {
            let mut algorithm = self.resolve_algorithm(opts.algorithm, bytes);
            if algorithm == Algorithm::SharedMemory && !self.map_segment()? {
                if opts.algorithm != Algorithm::Auto {
                    return Err(self.no_segment());
                }
                // `auto` counted on the segment: it now chooses among the others.
                algorithm = self.resolve_algorithm(opts.algorithm, bytes);
            }
            let name = match algorithm {
                Algorithm::Ring | Algorithm::Auto => "ring all-reduce",
                Algorithm::RecursiveDoubling => "recursive-doubling all-reduce",
                Algorithm::HalvingDoubling => "halving-doubling all-reduce",
                Algorithm::Direct => "direct all-reduce",
                Algorithm::ScatterGather => "scatter-gather all-reduce",
                Algorithm::SharedMemory => "shared-memory all-reduce",
                Algorithm::Hierarchical => "hierarchical all-reduce",
                Algorithm::Mpi => "MPI_Allreduce",
            };
            self.begin(name, Some(T::DTYPE), bytes);
            let op = opts.op;
            match algorithm {
                // resolve_algorithm turns Auto into one of the others.
                Algorithm::Ring | Algorithm::Auto => self.ring_all_reduce(pieces, op)?,
                Algorithm::RecursiveDoubling => self.recursive_doubling_all_reduce(pieces, op)?,
                Algorithm::HalvingDoubling => self.halving_doubling_all_reduce(pieces, op)?,
                Algorithm::Direct => {
                    self.through_one_buffer(pieces, |comm, buf| comm.direct_all_reduce(buf, op))?
                }
                Algorithm::ScatterGather => self.scatter_gather_all_reduce(pieces, op)?,
                Algorithm::SharedMemory => self.shared_memory_all_reduce(pieces, op)?,
                Algorithm::Hierarchical => self.hierarchical_all_reduce(pieces, op)?,
                Algorithm::Mpi => self.through_one_buffer(pieces, |comm, buf| {
                    comm.mpi_all_reduce_in_place(buf, op)
                })?,
            }
        } else if self.size > 1 && opts.algorithm == Algorithm::Mpi {
            // Still check that the algorithm exists, so that a bad choice fails on every rank.
            self.mpi_all_reduce_in_place::<T>(&mut [], opts.op)?;
        }
        let post = opts.effective_postscale(self.size);
        if post != 1.0 {
            for piece in pieces.iter_mut() {
                T::scale(piece, post);
            }
        }
        Ok(())
    }

    /// Whether [`Communicator::all_reduce_pieces`] reduces a message of `bytes` bytes of
    /// `dtype` in `pieces` pieces where they lie, rather than copying them into one buffer
    /// and back: the ring, recursive doubling, halving-doubling, scatter-gather and shared
    /// memory, without wire compression, with pieces of at least
    /// [`min_in_place_piece_bytes`] on average.
    pub fn reduces_in_place(
        &self,
        dtype: DType,
        opts: &AllReduceOptions,
        pieces: usize,
        bytes: usize,
    ) -> bool {
        let compressed = dtype == DType::F32 && opts.compression != WireCompression::None;
        !compressed
            && min_in_place_piece_bytes(self.resolve_algorithm(opts.algorithm, bytes))
                .map(|least| self.min_in_place_piece_bytes.unwrap_or(least))
                .is_some_and(|least| bytes >= pieces.saturating_mul(least))
    }

    /// Runs `f` on the message `pieces` make up: on the piece itself when there is one,
    /// else on a copy in one buffer, copied back afterwards.
    pub(crate) fn through_one_buffer<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        f: impl FnOnce(&mut Self, &mut [T]) -> Result<()>,
    ) -> Result<()> {
        if let [one] = pieces {
            return f(self, one);
        }
        let mut staging = std::mem::take(&mut self.staging);
        let len = pieces::total(pieces);
        let buf = elements_mut::<T>(scratch_bytes(&mut staging, len * T::BYTES), self.rank)?;
        pieces::copy_from_pieces(buf, pieces);
        let result = f(self, buf);
        if result.is_ok() {
            pieces::copy_to_pieces(pieces, 0, buf);
        }
        self.staging = staging;
        result
    }

    /// [`Communicator::all_reduce`] on a tensor of any element type.
    pub fn all_reduce_tensor(
        &mut self,
        tensor: TensorMut<'_>,
        opts: &AllReduceOptions,
    ) -> Result<()> {
        match tensor {
            TensorMut::F32(t) => self.all_reduce(t, opts),
            TensorMut::F64(t) => self.all_reduce(t, opts),
            TensorMut::F16(t) => self.all_reduce(t, opts),
            TensorMut::BF16(t) => self.all_reduce(t, opts),
        }
    }

    /// f32 data cast to f16/bf16 (with the prescale folded into the cast), reduced, cast
    /// back (with the postscale folded in).
    fn all_reduce_compressed(&mut self, data: &mut [f32], opts: &AllReduceOptions) -> Result<()> {
        let inner = AllReduceOptions {
            prescale: 1.0,
            postscale: 1.0,
            compression: WireCompression::None,
            op: match opts.op {
                ReduceOp::Average => ReduceOp::Sum,
                other => other,
            },
            algorithm: opts.algorithm,
        };
        let pre = opts.prescale as f32;
        let post = opts.effective_postscale(self.size) as f32;
        match opts.compression {
            WireCompression::F16 => {
                let mut wire = std::mem::take(&mut self.wire_f16);
                wire.resize(data.len(), f16::ZERO);
                let result = ringtrain_kernels::f32_to_f16_scaled(data, pre, &mut wire)
                    .map_err(Error::from)
                    .and_then(|_| self.all_reduce(&mut wire, &inner))
                    .and_then(|_| Ok(ringtrain_kernels::f16_to_f32_unscaled(&wire, post, data)?));
                self.wire_f16 = wire;
                result
            }
            WireCompression::Bf16 => {
                let mut wire = std::mem::take(&mut self.wire_bf16);
                wire.resize(data.len(), bf16::ZERO);
                let result = ringtrain_kernels::f32_to_bf16_scaled(data, pre, &mut wire)
                    .map_err(Error::from)
                    .and_then(|_| self.all_reduce(&mut wire, &inner))
                    .and_then(|_| Ok(ringtrain_kernels::bf16_to_f32_unscaled(&wire, post, data)?));
                self.wire_bf16 = wire;
                result
            }
            WireCompression::None => {
                let plain = AllReduceOptions {
                    compression: WireCompression::None,
                    ..*opts
                };
                self.all_reduce(data, &plain)
            }
        }
    }

    /// Ring all-reduce without scaling: reduce-scatter, then all-gather.
    fn ring_all_reduce<T: Element>(&mut self, pieces: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        self.ring_reduce_scatter(pieces, op)?;
        self.ring_all_gather_chunks(pieces)
    }

    /// After this, rank r holds chunk r fully reduced.
    ///
    /// Step i: rank r sends chunk (r - i - 1) to r + 1 and reduces chunk (r - i - 2),
    /// received from r - 1, into its own copy, segment by segment as they arrive.
    pub(crate) fn ring_reduce_scatter<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        if n == 1 {
            return Ok(());
        }
        let right = (r + 1) % n;
        let left = (r + n - 1) % n;
        let len = pieces::total(pieces);
        let segment = self.segment_bytes;
        let Communicator {
            transport, scratch, ..
        } = self;
        for i in 0..n - 1 {
            let send_chunk = (r + 2 * n - i - 1) % n;
            let recv_chunk = (r + 2 * n - i - 2) % n;
            let s = ring_chunk_range(len, n, send_chunk);
            let a = ring_chunk_range(len, n, recv_chunk);
            let recv = scratch_bytes(scratch, a.len() * T::BYTES);
            let [send, mut acc] = pieces::carve(pieces, [s, a]);
            transport.sendrecv_pipelined(
                right,
                &pieces::as_bytes(&send),
                left,
                recv,
                segment,
                &mut |offset, bytes| {
                    let src = elements::<T>(bytes, r)?;
                    pieces::reduce_into_pieces(op, &mut acc, offset / T::BYTES, src)
                },
            )?;
        }
        Ok(())
    }

    /// Passes the reduced chunks around the ring: rank r starts with chunk r complete.
    pub(crate) fn ring_all_gather_chunks<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let right = (r + 1) % n;
        let left = (r + n - 1) % n;
        let len = pieces::total(pieces);
        for i in 0..n - 1 {
            let s = ring_chunk_range(len, n, (r + n - i) % n);
            let d = ring_chunk_range(len, n, (r + 2 * n - i - 1) % n);
            let [send, mut recv] = pieces::carve(pieces, [s, d]);
            self.transport.sendrecv_pieces(
                right,
                &pieces::as_bytes(&send),
                left,
                &mut pieces::as_bytes_mut(&mut recv),
            )?;
        }
        Ok(())
    }

    /// Runs `within` over the largest power of two `p` of ranks after ranks `p..n` have
    /// folded their data into rank `r - p` (whose data is the accumulator); they get the
    /// result back at the end. `within` gets the transport, this rank's data, a scratch
    /// buffer as long, and `p`.
    fn with_fold_in<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
        within: impl FnOnce(&mut dyn Transport, &mut [&mut [T]], &mut [T], usize) -> Result<()>,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let extra = n - p;
        let len = pieces::total(pieces);
        let Communicator {
            transport, scratch, ..
        } = self;
        if r >= p {
            transport.send_pieces(r - p, &pieces::as_bytes(pieces))?;
            return transport.recv_pieces(r - p, &mut pieces::as_bytes_mut(pieces));
        }
        let tmp = elements_mut::<T>(scratch_bytes(scratch, len * T::BYTES), r)?;
        if r < extra {
            transport.recv(r + p, bytes_of_mut(tmp))?;
            pieces::reduce_into_pieces(op, pieces, 0, tmp)?;
        }
        within(transport.as_mut(), pieces, tmp, p)?;
        if r < extra {
            transport.send_pieces(r + p, &pieces::as_bytes(pieces))?;
        }
        Ok(())
    }

    /// Recursive doubling over the folded-in ranks ([`Communicator::with_fold_in`]). In
    /// every exchange the lower rank's data is the accumulator, so both partners compute
    /// the same expression and every rank ends with identical bits.
    fn recursive_doubling_all_reduce<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let r = self.rank;
        self.with_fold_in(pieces, op, |transport, pieces, tmp, p| {
            let mut mask = 1;
            while mask < p {
                let partner = r ^ mask;
                transport.sendrecv_pieces(
                    partner,
                    &pieces::as_bytes(pieces),
                    partner,
                    &mut [bytes_of_mut(tmp)],
                )?;
                if r < partner {
                    pieces::reduce_into_pieces(op, pieces, 0, tmp)?;
                } else {
                    pieces::reduce_pieces_into(op, tmp, pieces)?;
                    pieces::copy_to_pieces(pieces, 0, tmp);
                }
                mask <<= 1;
            }
            Ok(())
        })
    }

    /// Rabenseifner's halving-doubling over the folded-in ranks
    /// ([`Communicator::with_fold_in`]). For `mask = p/2, p/4, .., 1`, a rank and
    /// `r ^ mask` split the window they share in halves: the lower rank keeps (and reduces
    /// into) the lower half, the other the upper, each sending the other half. Each rank
    /// ends owning one window of about `len / p` elements fully reduced; the all-gather
    /// retraces the steps in reverse, exchanging whole windows. Every element is reduced
    /// at one rank and copied to the others, so every rank ends with identical bits.
    fn halving_doubling_all_reduce<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let r = self.rank;
        self.with_fold_in(pieces, op, |transport, pieces, tmp, p| {
            // Reduce-scatter by recursive halving; `steps` records (partner, kept, given).
            let mut window = 0..pieces::total(pieces);
            let mut steps: Vec<(usize, Range<usize>, Range<usize>)> = Vec::new();
            let mut mask = p / 2;
            while mask > 0 {
                let partner = r ^ mask;
                let mid = window.start + window.len() / 2;
                let (lower, upper) = (window.start..mid, mid..window.end);
                let (keep, give) = if r < partner {
                    (lower, upper)
                } else {
                    (upper, lower)
                };
                let [send, mut acc] = pieces::carve(pieces, [give.clone(), keep.clone()]);
                let recv = &mut tmp[..keep.len()];
                transport.sendrecv_pieces(
                    partner,
                    &pieces::as_bytes(&send),
                    partner,
                    &mut [bytes_of_mut(recv)],
                )?;
                pieces::reduce_into_pieces(op, &mut acc, 0, recv)?;
                steps.push((partner, keep.clone(), give));
                window = keep;
                mask /= 2;
            }
            // All-gather by recursive doubling: send the window owned, receive the
            // partner's.
            for (partner, keep, give) in steps.into_iter().rev() {
                let [send, mut recv] = pieces::carve(pieces, [keep, give]);
                transport.sendrecv_pieces(
                    partner,
                    &pieces::as_bytes(&send),
                    partner,
                    &mut pieces::as_bytes_mut(&mut recv),
                )?;
            }
            Ok(())
        })
    }

    /// Every rank sends its whole buffer to every other rank in one message step
    /// ([`Transport::exchange_all_into`]) and reduces the N contributions in rank order,
    /// `((x0 op x1) op x2) ...`: the same operands in the same order on every rank, so
    /// every rank ends with identical bits. Holds the N contributions in the scratch
    /// buffer (N times the message), which suits the small messages it is for.
    fn direct_all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let bytes = std::mem::size_of_val(buf);
        let total = n.checked_mul(bytes).ok_or_else(|| {
            Error::invalid(
                "message size for the direct all-reduce",
                bytes,
                "use the ring or halving-doubling for messages this large",
            )
        })?;
        let Communicator {
            transport, scratch, ..
        } = self;
        let all = scratch_bytes(scratch, total);
        transport.exchange_all_into(bytes_of(buf), all)?;
        let all = elements::<T>(all, r)?;
        let len = buf.len();
        if len == 0 {
            return Ok(());
        }
        if r != 0 {
            buf.copy_from_slice(&all[..len]);
        }
        for contribution in all.chunks_exact(len).skip(1) {
            reduce_into(op, buf, contribution)?;
        }
        Ok(())
    }

    /// A direct reduce-scatter, then a direct all-gather, over the chunks of
    /// [`ring_chunk_range`]. Step one: every rank sends chunk `p` to rank `p` and receives
    /// its own chunk from every other rank, all at once ([`Transport::all_to_all_into`]),
    /// and reduces the N copies of its chunk in rank order, `((x0 op x1) op x2) ...`.
    /// Step two: every rank sends its reduced chunk to every other rank and receives
    /// theirs. Two message steps however many ranks, each moving (N − 1)/N of the message
    /// per rank: the ring's bytes in 2 steps instead of 2(N − 1). Every element is reduced
    /// at one rank in rank order and copied to the others, so every rank ends with the
    /// same bits, those of [`Algorithm::Direct`]. Holds N copies of one chunk (about the
    /// message) in the scratch buffer.
    fn scatter_gather_all_reduce<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let len = pieces::total(pieces);
        let chunks: Vec<Range<usize>> = (0..n).map(|p| ring_chunk_range(len, n, p)).collect();
        let own = chunks[r].clone();
        let chunk_bytes = own.len() * T::BYTES;
        let Communicator {
            transport, scratch, ..
        } = self;
        // Slot p receives rank p's copy of this rank's chunk; slot r gets this rank's own.
        let copies = scratch_bytes(scratch, n * chunk_bytes);
        let mut slots: Vec<&mut [u8]> = if chunk_bytes == 0 {
            (0..n).map(|_| <&mut [u8]>::default()).collect()
        } else {
            copies.chunks_mut(chunk_bytes).collect()
        };
        {
            let carved = pieces::carve_many(pieces, &chunks);
            let sends: Vec<pieces::Bytes> = carved.iter().map(|c| pieces::as_bytes(c)).collect();
            let sends: Vec<&[&[u8]]> = sends.iter().map(|s| s.as_slice()).collect();
            let mut recvs: Vec<[&mut [u8]; 1]> = slots.iter_mut().map(|s| [&mut **s]).collect();
            let mut recvs: Vec<&mut [&mut [u8]]> =
                recvs.iter_mut().map(|s| s.as_mut_slice()).collect();
            transport.all_to_all_pieces(&sends, &mut recvs)?;
        }
        if chunk_bytes > 0 {
            let [mut mine] = pieces::carve(pieces, [own]);
            // Rank order: rank 0's copy is the accumulator, whichever rank reduces.
            if r != 0 {
                pieces::copy_from_pieces(elements_mut::<T>(slots[r], r)?, &mine);
                pieces::copy_to_pieces(&mut mine, 0, elements::<T>(slots[0], r)?);
            }
            for slot in &slots[1..] {
                pieces::reduce_into_pieces(op, &mut mine, 0, elements::<T>(slot, r)?)?;
            }
        }
        // Every chunk in its place; this rank's reduced chunk goes to every other rank.
        let mut carved = pieces::carve_many(pieces, &chunks);
        let mine = std::mem::take(&mut carved[r]);
        let reduced = pieces::as_bytes(&mine);
        let sends = vec![reduced.as_slice(); n];
        let mut recvs: Vec<pieces::BytesMut> =
            carved.iter_mut().map(|c| pieces::as_bytes_mut(c)).collect();
        let mut recvs: Vec<&mut [&mut [u8]]> = recvs.iter_mut().map(|s| s.as_mut_slice()).collect();
        transport.all_to_all_pieces(&sends, &mut recvs)
    }

    /// Maps the segment of [`Algorithm::SharedMemory`] on every rank unless it is mapped
    /// at the segment size already or known to be out of reach: whether it is mapped now.
    /// Collective where it tries.
    fn map_segment(&mut self) -> Result<bool> {
        match &self.node_segment {
            SegmentState::Mapped(segment) if segment.slot_bytes() == self.segment_bytes => {
                return Ok(true)
            }
            SegmentState::Unavailable(_) => return Ok(false),
            _ => {}
        }
        self.begin(
            "shared-memory all-reduce (mapping its segment)",
            None,
            self.segment_bytes,
        );
        let dir = self.shared_memory_dir.as_deref();
        self.node_segment =
            match NodeSegment::create(self.transport.as_ref(), self.segment_bytes, dir)? {
                Ok(segment) => SegmentState::Mapped(Box::new(segment)),
                Err(why) => SegmentState::Unavailable(why),
            };
        Ok(matches!(self.node_segment, SegmentState::Mapped(_)))
    }

    /// Why the segment could not be mapped ([`Communicator::map_segment`] said so), as the
    /// error of a shared-memory all-reduce: the same on every rank.
    fn no_segment(&self) -> Error {
        let SegmentState::Unavailable(why) = &self.node_segment else {
            unreachable!("map_segment says why it failed");
        };
        Error::Transport {
            rank: self.rank,
            detail: why.clone(),
        }
    }

    /// [`Algorithm::SharedMemory`] through the mapped segment, in pieces of the segment
    /// size ([`crate::shared_memory`]).
    fn shared_memory_all_reduce<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let SegmentState::Mapped(segment) = &mut self.node_segment else {
            unreachable!("all_reduce_pieces maps the segment first");
        };
        segment.all_reduce(self.transport.as_ref(), pieces, op)
    }

    /// Whether this communicator's ranks share a mapped segment for
    /// [`Algorithm::SharedMemory`] (mapping it first where it is not yet, collectively),
    /// and the settings it was mapped with: the segment size and directory.
    pub(crate) fn shares_memory(&mut self) -> Result<(bool, (usize, Option<PathBuf>))> {
        let mapped = self.shared_memory_dir.is_some() && self.map_segment()?;
        Ok((mapped, (self.segment_bytes, self.shared_memory_dir.clone())))
    }

    /// The transport and the mapped segment ([`Communicator::shares_memory`] said so).
    fn mapped_segment(&mut self) -> Result<(&dyn Transport, &mut NodeSegment)> {
        match &mut self.node_segment {
            SegmentState::Mapped(segment) => Ok((self.transport.as_ref(), segment)),
            _ => Err(Error::Transport {
                rank: self.rank,
                detail: "internal: no shared-memory segment is mapped".into(),
            }),
        }
    }

    /// The reduce-scatter half of [`Algorithm::SharedMemory`] through the mapped segment:
    /// returns the element ranges this rank holds reduced (its chunk of every piece of
    /// the segment). Collective.
    pub(crate) fn shared_memory_reduce_scatter<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<Vec<Range<usize>>> {
        let bytes = pieces::total(pieces) * T::BYTES;
        self.begin("shared-memory reduce-scatter", Some(T::DTYPE), bytes);
        let (transport, segment) = self.mapped_segment()?;
        segment.reduce_scatter(transport, pieces, op)?;
        Ok(segment.own_ranges::<T>(pieces::total(pieces)))
    }

    /// The all-gather half of [`Algorithm::SharedMemory`]: every rank's ranges that
    /// [`Communicator::shared_memory_reduce_scatter`] returned, to every rank. Collective.
    pub(crate) fn shared_memory_all_gather<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
    ) -> Result<()> {
        let bytes = pieces::total(pieces) * T::BYTES;
        self.begin("shared-memory all-gather", Some(T::DTYPE), bytes);
        let (transport, segment) = self.mapped_segment()?;
        segment.all_gather(transport, pieces)
    }

    /// [`Algorithm::SharedMemory`] of the message `pieces` make up when every rank votes
    /// for it: `Some` (the same non-empty message on every rank that votes for it) for,
    /// `None` against; true when every rank voted for it (the reduced, post-scaled values
    /// are in the pieces), false when any voted against (nothing was written). The votes
    /// travel with the reduction's own flags (`NodeSegment::all_reduce_if`): no round of
    /// their own. Collective.
    ///
    /// # Errors
    /// Options that change the values before the reduction (a prescale, wire
    /// compression), which a vote against could not undo; where the ranks cannot share a
    /// segment, the reason, on every rank alike; a stall.
    pub(crate) fn shared_memory_all_reduce_if<T: Element>(
        &mut self,
        mut pieces: Option<&mut [&mut [T]]>,
        opts: &AllReduceOptions,
    ) -> Result<bool> {
        opts.validate()?;
        if opts.prescale != 1.0 || opts.compression != WireCompression::None {
            return Err(Error::invalid(
                "options of a voted shared-memory all-reduce",
                format!("{opts:?}"),
                "internal: a vote needs the values untouched until every rank has voted",
            ));
        }
        if !self.map_segment()? {
            return Err(self.no_segment());
        }
        let bytes = pieces.as_deref().map_or(0, pieces::total) * T::BYTES;
        self.begin("shared-memory all-reduce", Some(T::DTYPE), bytes);
        let SegmentState::Mapped(segment) = &mut self.node_segment else {
            unreachable!("map_segment mapped it");
        };
        let agreed =
            segment.all_reduce_if(self.transport.as_ref(), pieces.as_deref_mut(), opts.op)?;
        let post = opts.effective_postscale(self.size);
        if let (true, Some(pieces)) = (agreed && post != 1.0, pieces) {
            for piece in pieces.iter_mut() {
                T::scale(piece, post);
            }
        }
        Ok(agreed)
    }

    fn mpi_all_reduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let bytes = std::mem::size_of_val(buf);
        let Communicator {
            transport, scratch, ..
        } = self;
        let send = scratch_bytes(scratch, bytes);
        send.copy_from_slice(bytes_of(buf));
        transport.native_all_reduce(send, bytes_of_mut(buf), T::DTYPE, op)
    }

    /// The transport's own all-reduce (`MPI_Allreduce`), out of place: the baseline the
    /// benchmarks compare with. `Average` divides by the rank count afterwards.
    pub fn native_all_reduce_into<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() != recv.len() {
            return Err(Error::invalid(
                "receive buffer length",
                recv.len(),
                "pass a receive buffer as long as the send buffer",
            ));
        }
        self.begin("MPI_Allreduce", Some(T::DTYPE), std::mem::size_of_val(send));
        self.transport
            .native_all_reduce(bytes_of(send), bytes_of_mut(recv), T::DTYPE, op)?;
        if op == ReduceOp::Average {
            T::scale(recv, 1.0 / self.size as f64);
        }
        Ok(())
    }

    /// Reduce-scatter in place: afterwards `buf[range]` holds this rank's chunk (chunk
    /// `rank` of [`ring_chunk_range`]) fully reduced and scaled; the rest of `buf` holds
    /// partial sums. Returns that range. Wire compression is not applied here.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        buf: &mut [T],
        opts: &AllReduceOptions,
    ) -> Result<Range<usize>> {
        opts.validate()?;
        if opts.compression != WireCompression::None {
            return Err(Error::invalid(
                "compression for reduce_scatter",
                format!("{:?}", opts.compression),
                "wire compression applies to all_reduce only; pass WireCompression::None",
            ));
        }
        if opts.prescale != 1.0 {
            T::scale(buf, opts.prescale);
        }
        self.begin(
            "ring reduce-scatter",
            Some(T::DTYPE),
            std::mem::size_of_val(buf),
        );
        self.ring_reduce_scatter(&mut [&mut *buf], opts.op)?;
        let range = ring_chunk_range(buf.len(), self.size, self.rank);
        let post = opts.effective_postscale(self.size);
        if post != 1.0 {
            T::scale(&mut buf[range.clone()], post);
        }
        Ok(range)
    }

    /// Copies `buf` of rank `root` into `buf` of every other rank (binomial tree).
    pub fn broadcast<T: bytemuck::Pod>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        let n = self.size;
        if root >= n {
            return Err(Error::invalid(
                "broadcast root",
                root,
                "pick a rank below the communicator size",
            ));
        }
        self.begin("broadcast", None, std::mem::size_of_val(buf));
        let vrank = (self.rank + n - root) % n;
        let mut mask = 1;
        while mask < n {
            if vrank < mask {
                let dst = vrank + mask;
                if dst < n {
                    self.transport.send((dst + root) % n, bytes_of(buf))?;
                }
            } else if vrank < 2 * mask {
                let src = vrank - mask;
                self.transport.recv((src + root) % n, bytes_of_mut(buf))?;
            }
            mask <<= 1;
        }
        Ok(())
    }

    /// Gathers every rank's `send` (lengths may differ per rank) on every rank, in rank
    /// order. Every rank sends its data straight to every other rank: one message step,
    /// which suits the small, latency-bound gathers (negotiation, metadata) it serves.
    pub fn all_gather<T: bytemuck::Pod>(&mut self, send: &[T]) -> Result<Vec<Vec<T>>> {
        self.begin("all-gather", None, std::mem::size_of_val(send));
        let gathered = self.transport.exchange_all(bytes_of(send))?;
        let rank = self.rank;
        gathered
            .into_iter()
            .enumerate()
            .map(|(src, bytes)| {
                if bytes.len() % std::mem::size_of::<T>().max(1) != 0 {
                    return Err(Error::Transport {
                        rank,
                        detail: format!(
                            "all_gather: rank {src} sent {} bytes, not a whole number of {}-byte elements: the ranks gathered different types",
                            bytes.len(),
                            std::mem::size_of::<T>()
                        ),
                    });
                }
                let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>().max(1)];
                bytes_of_mut(&mut v).copy_from_slice(&bytes);
                Ok(v)
            })
            .collect()
    }

    /// The raw bytes every rank contributed, in rank order (no copies into typed vectors).
    pub fn all_gather_bytes(&mut self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.begin("all-gather", None, send.len());
        self.transport.exchange_all(send)
    }

    /// Returns once every rank has entered the barrier (dissemination algorithm).
    pub fn barrier(&mut self) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        self.begin("barrier", None, 0);
        let mut token = [0u8; 1];
        let mut dist = 1;
        while dist < n {
            self.transport
                .sendrecv((r + dist) % n, &[1u8], (r + n - dist) % n, &mut token)?;
            dist <<= 1;
        }
        Ok(())
    }
}
