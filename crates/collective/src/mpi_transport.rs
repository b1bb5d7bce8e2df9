//! [`MpiTransport`]: rsmpi point-to-point over `MPI_COMM_WORLD` or a duplicate of it
//! (feature `mpi`).

use std::sync::Arc;

use half::{bf16, f16};
use std::ffi::{c_int, c_void};

use mpi::collective::{CommunicatorCollectives as _, SystemOperation, UnsafeUserOperation};
use mpi::datatype::{MutView, UserDatatype, View};
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec as _, Source, Status};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::{Address, Count, Threading};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::ReduceOp;
use crate::pieces;
use crate::stall::{StallWatch, Wait, STALL_EXIT_CODE};
use crate::transport::{check_all_to_all_len, segment_count, segment_range, NodeRank, Transport};

/// An MPI communicator handle that may move to another thread.
struct Comm(SimpleCommunicator);

// SAFETY: an MPI communicator handle is an opaque reference into the MPI library, valid
// on every thread of the process. MPI is initialised with `MPI_THREAD_MULTIPLE`
// (`MpiTransport::init` refuses less), which allows any thread to call MPI on it.
unsafe impl Send for Comm {}

/// The MPI world, or a duplicate of it, as a [`Transport`].
///
/// MPI is initialised by [`MpiTransport::init`] (once per process) and finalised when the
/// world transport and all its duplicates have been dropped. It asks for
/// `MPI_THREAD_MULTIPLE`: the fusion engine's background thread reduces on one
/// communicator while the trainer's control messages use a duplicate
/// ([`Transport::duplicate`]). Started without mpirun, the world has one rank.
pub struct MpiTransport {
    // Declared before `universe` so that the communicator and the operations are freed
    // before MPI_Finalize.
    comm: Comm,
    nan_ops: NanOps,
    layouts: LayoutCache,
    watch: StallWatch,
    universe: Arc<Universe>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// MPI counts are C ints: one message carries at most this many bytes.
const MAX_MESSAGE_BYTES: usize = i32::MAX as usize;

impl MpiTransport {
    /// Initialises MPI and wraps `MPI_COMM_WORLD`.
    pub fn init() -> Result<MpiTransport> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Transport {
                rank: 0,
                detail: "MPI is already initialised in this process: create the MPI transport once and share the Communicator".into(),
            })?;
        if provided < Threading::Multiple {
            return Err(Error::Transport {
                rank: 0,
                detail: format!(
                    "the MPI library grants thread level {provided:?}, ringtrain needs Multiple \
                     (the fusion thread and the control messages use MPI at once): use an MPI \
                     built with thread support (Open MPI 3 and later are by default; check \
                     `ompi_info | grep -i thread`)"
                ),
            });
        }
        Ok(Self::over(
            universe.world(),
            Arc::new(universe),
            StallWatch::default(),
        ))
    }

    fn over(comm: SimpleCommunicator, universe: Arc<Universe>, watch: StallWatch) -> MpiTransport {
        let rank = usize::try_from(comm.rank()).unwrap_or(0);
        let size = usize::try_from(comm.size()).unwrap_or(1);
        MpiTransport {
            comm: Comm(comm),
            nan_ops: NanOps::create(),
            layouts: LayoutCache::default(),
            watch,
            universe,
            rank,
            size,
        }
    }

    fn world(&self) -> &SimpleCommunicator {
        &self.comm.0
    }

    /// Prints the stall and aborts the job: a blocked MPI call cannot be cancelled, and
    /// the other ranks would wait for this one next.
    fn abort_stalled(&self, error: Error) -> ! {
        eprintln!("ringtrain-collective: ERROR: {error}; aborting the job (MPI_Abort)");
        // Let the other waiting ranks print their own view before MPI_Abort ends them.
        std::thread::sleep(std::time::Duration::from_secs(1));
        self.world().abort(STALL_EXIT_CODE)
    }

    /// Polls `requests` (each with the peer it waits for, `usize::MAX` when unknown)
    /// until all complete; returns their statuses in order. Aborts the job when the
    /// stall timeout runs out.
    fn complete<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        requests: Vec<(usize, Request<'a, D, S>)>,
    ) -> Vec<Status> {
        let mut slots: Vec<(usize, Option<Request<'a, D, S>>)> =
            requests.into_iter().map(|(p, r)| (p, Some(r))).collect();
        let mut pending: Vec<(usize, &mut dyn Pending)> = slots
            .iter_mut()
            .map(|(p, r)| (*p, r as &mut dyn Pending))
            .collect();
        self.complete_any(&mut pending)
    }

    /// [`MpiTransport::complete`] for requests of different buffer types (a message in
    /// pieces goes through a datatype view, one piece as its bytes).
    fn complete_any<'p>(&self, requests: &mut [(usize, &mut (dyn Pending + 'p))]) -> Vec<Status> {
        let mut statuses: Vec<Option<Status>> = vec![None; requests.len()];
        let mut wait = Wait::new(&self.watch, self.rank);
        loop {
            let mut open = 0;
            for ((_, request), status) in requests.iter_mut().zip(&mut statuses) {
                if status.is_none() {
                    *status = request.poll();
                    open += usize::from(status.is_none());
                }
            }
            if open == 0 {
                return statuses.into_iter().flatten().collect();
            }
            let peers = || {
                requests
                    .iter()
                    .zip(&statuses)
                    .filter(|((p, _), s)| s.is_none() && *p != usize::MAX)
                    .map(|((p, _), _)| *p)
                    .collect()
            };
            if let Err(e) = wait.pause(peers) {
                self.abort_stalled(e);
            }
        }
    }

    /// Receives the next message from `peer`, of any length, within the stall timeout.
    fn receive_any_length(&self, peer: usize) -> Vec<u8> {
        let source = self.world().process_at_rank(peer as i32);
        let mut wait = Wait::new(&self.watch, self.rank);
        loop {
            if let Some(probed) = source.immediate_matched_probe() {
                return probed.matched_receive_vec::<u8>().0;
            }
            if let Err(e) = wait.pause(|| vec![peer]) {
                self.abort_stalled(e);
            }
        }
    }

    fn check(&self, peer: usize, bytes: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!("peer rank {peer} does not exist (size {})", self.size),
            });
        }
        if bytes > MAX_MESSAGE_BYTES {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!(
                    "message of {bytes} bytes exceeds MPI's limit of {MAX_MESSAGE_BYTES}: split the tensor (gradient_repacking does)"
                ),
            });
        }
        Ok(())
    }

    fn check_status(
        &self,
        status: mpi::point_to_point::Status,
        peer: usize,
        expected: usize,
    ) -> Result<()> {
        let got = status.count(u8::equivalent_datatype()) as usize;
        if got != expected {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!(
                    "message from rank {peer} has {got} bytes, expected {expected}: the ranks called different collectives or lengths"
                ),
            });
        }
        Ok(())
    }
}

use mpi::datatype::Equivalence;

/// A request still to be completed, whatever its buffer's type.
trait Pending {
    /// The request's status once it has completed.
    fn poll(&mut self) -> Option<Status>;
}

impl<'a, D: ?Sized, S: Scope<'a>> Pending for Option<Request<'a, D, S>> {
    fn poll(&mut self) -> Option<Status> {
        match self.take()?.test() {
            Ok(status) => Some(status),
            Err(request) => {
                *self = Some(request);
                None
            }
        }
    }
}

/// A committed MPI datatype shared by the layout cache and the messages in flight.
struct SharedDatatype(UserDatatype);

// SAFETY: an MPI datatype handle is an opaque reference into the MPI library, valid on
// every thread of the process (MPI is initialised with `MPI_THREAD_MULTIPLE`). After its
// commit it is only read (concurrent messages may use one datatype), and it is freed once,
// when the last `Arc` of it is dropped.
unsafe impl Send for SharedDatatype {}
// SAFETY: as for `Send`: nothing mutates a committed datatype until it is freed.
unsafe impl Sync for SharedDatatype {}

/// A message's pieces as MPI sees them: each piece's displacement from the first piece
/// and its length in bytes.
type Layout = Vec<(Address, Count)>;

/// The datatypes of the last layouts sent or received in pieces, most recent first: a
/// group reduced step after step moves the same layouts every step, and building and
/// committing a datatype of a thousand blocks costs more than moving their bytes.
#[derive(Default)]
struct LayoutCache(std::sync::Mutex<std::collections::VecDeque<(Layout, Arc<SharedDatatype>)>>);

/// At most this many layouts are kept ([`LayoutCache`]): a ring step of a large group
/// sends one per pipeline segment.
const LAYOUT_CACHE_ENTRIES: usize = 64;

/// At most this many blocks in all the layouts kept (each costs MPI a few dozen bytes).
const LAYOUT_CACHE_BLOCKS: usize = 1 << 20;

impl LayoutCache {
    /// The datatype that makes the byte pieces at `pieces` (address, length; none empty)
    /// one MPI message: `None` for no piece or one (sent as its bytes), else their blocks
    /// at their addresses relative to the first piece's (`MPI_Type_create_hindexed` of
    /// `MPI_BYTE`), committed, or the one committed for the same layout before.
    fn datatype(
        &self,
        rank: usize,
        pieces: impl ExactSizeIterator<Item = (*const u8, usize)>,
    ) -> Result<Option<Arc<SharedDatatype>>> {
        if pieces.len() < 2 {
            return Ok(None);
        }
        let mut layout = Layout::with_capacity(pieces.len());
        let mut base = None;
        for (at, len) in pieces {
            let at = at as Address;
            let base = *base.get_or_insert(at);
            let len = Count::try_from(len).map_err(|_| Error::Transport {
                rank,
                detail: format!(
                    "a message piece of {len} bytes exceeds MPI's limit of {MAX_MESSAGE_BYTES}: split the tensor (gradient_repacking does)"
                ),
            })?;
            layout.push((at.wrapping_sub(base), len));
        }
        let mut cache = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = cache.iter().position(|(kept, _)| *kept == layout) {
            let hit = cache.remove(k).expect("the position is in the cache");
            let datatype = Arc::clone(&hit.1);
            cache.push_front(hit);
            return Ok(Some(datatype));
        }
        let (lengths, displacements): (Vec<Count>, Vec<Address>) =
            layout.iter().map(|&(at, len)| (len, at)).unzip();
        let datatype = Arc::new(SharedDatatype(UserDatatype::heterogeneous_indexed(
            &lengths,
            &displacements,
            &u8::equivalent_datatype(),
        )));
        cache.push_front((layout, Arc::clone(&datatype)));
        let mut blocks: usize = cache.iter().map(|(l, _)| l.len()).sum();
        while cache.len() > LAYOUT_CACHE_ENTRIES
            || (blocks > LAYOUT_CACHE_BLOCKS && cache.len() > 1)
        {
            if let Some((dropped, _)) = cache.pop_back() {
                blocks -= dropped.len();
            }
        }
        Ok(Some(datatype))
    }
}

/// A message to send as MPI is handed it: its bytes, or a datatype view over its pieces.
enum Outgoing<'d, 'b> {
    Bytes(&'b [u8]),
    Pieces(View<'d, 'b, UserDatatype, [u8]>),
}

impl<'d, 'b> Outgoing<'d, 'b> {
    /// `pieces` (none empty) under the datatype [`LayoutCache::datatype`] made of them.
    fn new(pieces: &[&'b [u8]], datatype: Option<&'d UserDatatype>) -> Self {
        match datatype {
            // SAFETY: the datatype's blocks are exactly the bytes of `pieces`, at their
            // addresses relative to the first piece's; every piece is borrowed for 'b, as
            // long as the view, and a send only reads them.
            Some(datatype) => {
                Outgoing::Pieces(unsafe { View::with_count_and_datatype(pieces[0], 1, datatype) })
            }
            None => Outgoing::Bytes(pieces.first().copied().unwrap_or(&[])),
        }
    }

    fn post<'a: 's, 's, Sc: Scope<'a> + 's>(
        &'a self,
        dst: &impl Destination,
        scope: Sc,
    ) -> Box<dyn Pending + 's> {
        match self {
            Outgoing::Bytes(bytes) => Box::new(Some(dst.immediate_send(scope, *bytes))),
            Outgoing::Pieces(view) => Box::new(Some(dst.immediate_send(scope, view))),
        }
    }
}

/// A message to receive as MPI is handed it: its bytes, or a datatype view over its
/// pieces.
enum Incoming<'d, 'b> {
    Bytes(&'b mut [u8]),
    Pieces(MutView<'d, 'b, UserDatatype, [u8]>),
}

impl<'d, 'b> Incoming<'d, 'b> {
    /// `pieces` (none empty) under the datatype [`LayoutCache::datatype`] made of them.
    fn new(pieces: &'b mut [&mut [u8]], datatype: Option<&'d UserDatatype>) -> Self {
        match (datatype, pieces) {
            // SAFETY: the datatype's blocks are exactly the bytes of `pieces`, at their
            // addresses relative to the first piece's; every piece is borrowed mutably
            // for 'b, as long as the view, so nothing else reads or writes them while the
            // receive does.
            (Some(datatype), [first, ..]) => Incoming::Pieces(unsafe {
                MutView::with_count_and_datatype(&mut **first, 1, datatype)
            }),
            (_, [first, ..]) => Incoming::Bytes(first),
            (_, []) => Incoming::Bytes(&mut []),
        }
    }

    fn post<'a: 's, 's, Sc: Scope<'a> + 's>(
        &'a mut self,
        src: &impl Source,
        scope: Sc,
    ) -> Box<dyn Pending + 's> {
        match self {
            Incoming::Bytes(bytes) => {
                Box::new(Some(src.immediate_receive_into(scope, &mut **bytes)))
            }
            Incoming::Pieces(view) => Box::new(Some(src.immediate_receive_into(scope, view))),
        }
    }
}

/// The pieces of `pieces` with bytes in them.
fn nonempty<'b>(pieces: &[&'b [u8]]) -> pieces::Bytes<'b> {
    pieces.iter().copied().filter(|p| !p.is_empty()).collect()
}

/// The pieces of `pieces` with bytes in them, to write.
fn nonempty_mut<'b>(pieces: &'b mut [&mut [u8]]) -> pieces::BytesMut<'b> {
    pieces
        .iter_mut()
        .map(|p| &mut **p)
        .filter(|p| !p.is_empty())
        .collect()
}

fn addresses<P: AsRef<[u8]>>(
    pieces: &[P],
) -> impl ExactSizeIterator<Item = (*const u8, usize)> + '_ {
    pieces
        .iter()
        .map(|p| (p.as_ref().as_ptr(), p.as_ref().len()))
}

/// Min and max as user-defined MPI operations that propagate NaN like the other
/// algorithms do (`MPI_MIN` and `MPI_MAX` are C comparisons, which drop a NaN whenever
/// it is compared second). Each calls the same kernel the ring and recursive doubling
/// reduce with, so every algorithm gives the same answer for NaN and infinities.
struct NanOps {
    min_f32: UnsafeUserOperation,
    max_f32: UnsafeUserOperation,
    min_f64: UnsafeUserOperation,
    max_f64: UnsafeUserOperation,
}

// SAFETY: an `MPI_Op` handle is an opaque reference into the MPI library, valid on every
// thread under `MPI_THREAD_MULTIPLE` (see `Comm`); the operations are only read.
unsafe impl Send for NanOps {}

/// The body of an `MPI_User_function`: `inoutvec[i] = op(inoutvec[i], invec[i])`.
///
/// # Safety
/// `invec` and `inoutvec` point to `*len` valid, distinct elements of `T` (MPI calls it
/// only with the datatype the operation was used with, which the caller fixes per `T`).
unsafe fn combine<T: ringtrain_kernels::ReduceElement>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    pick: fn(&mut [T], &[T]) -> ringtrain_kernels::Result<()>,
) {
    let n = usize::try_from(*len).unwrap_or(0);
    if n == 0 || invec.is_null() || inoutvec.is_null() {
        return;
    }
    let src = std::slice::from_raw_parts(invec as *const T, n);
    let acc = std::slice::from_raw_parts_mut(inoutvec as *mut T, n);
    // The lengths are equal by construction, so the kernel cannot fail; a user function
    // must not unwind into MPI either way.
    let _ = pick(acc, src);
}

macro_rules! nan_op {
    ($name:ident, $t:ty, $method:ident) => {
        unsafe extern "C" fn $name(
            invec: *mut c_void,
            inoutvec: *mut c_void,
            len: *mut c_int,
            _datatype: *mut mpi::ffi::MPI_Datatype,
        ) {
            // SAFETY: MPI passes `*len` elements of the datatype this operation is used
            // with, which `native_all_reduce` fixes to `$t`.
            unsafe {
                combine::<$t>(
                    invec,
                    inoutvec,
                    len,
                    <$t as ringtrain_kernels::ReduceElement>::$method,
                )
            }
        }
    };
}

nan_op!(nan_min_f32, f32, min_into);
nan_op!(nan_max_f32, f32, max_into);
nan_op!(nan_min_f64, f64, min_into);
nan_op!(nan_max_f64, f64, max_into);

impl NanOps {
    fn create() -> NanOps {
        // SAFETY: each function reads and writes exactly the `*len` elements MPI passes,
        // of the type it is used with below (f32 operations only on f32 buffers, f64 on
        // f64), and never unwinds.
        unsafe {
            NanOps {
                min_f32: UnsafeUserOperation::commutative(nan_min_f32),
                max_f32: UnsafeUserOperation::commutative(nan_max_f32),
                min_f64: UnsafeUserOperation::commutative(nan_min_f64),
                max_f64: UnsafeUserOperation::commutative(nan_max_f64),
            }
        }
    }
}

impl MpiTransport {
    /// `MPI_Iallreduce`, polled within the stall timeout, with the sum or with this
    /// transport's NaN-propagating min/max.
    fn all_reduce_with<T>(
        &self,
        ops: (&UnsafeUserOperation, &UnsafeUserOperation),
        op: ReduceOp,
        send: &[T],
        recv: &mut [T],
    ) where
        T: Equivalence,
    {
        let world = self.world();
        mpi::request::scope(|scope| {
            let request = match op {
                ReduceOp::Sum | ReduceOp::Average => {
                    world.immediate_all_reduce_into(scope, send, recv, SystemOperation::sum())
                }
                ReduceOp::Min => world.immediate_all_reduce_into(scope, send, recv, ops.0),
                ReduceOp::Max => world.immediate_all_reduce_into(scope, send, recv, ops.1),
            };
            // MPI does not say which ranks a collective waits for.
            self.complete(vec![(usize::MAX, request)]);
        });
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn stall_watch(&self) -> &StallWatch {
        &self.watch
    }

    fn send(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.check(peer, data.len())?;
        let dst = self.world().process_at_rank(peer as i32);
        mpi::request::scope(|scope| {
            self.complete(vec![(peer, dst.immediate_send(scope, data))]);
        });
        Ok(())
    }

    fn recv(&self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.check(peer, buf.len())?;
        let src = self.world().process_at_rank(peer as i32);
        let len = buf.len();
        let status = mpi::request::scope(|scope| {
            self.complete(vec![(peer, src.immediate_receive_into(scope, buf))])[0]
        });
        self.check_status(status, peer, len)
    }

    /// Several pieces go as one message through a datatype of their blocks, from where
    /// they lie.
    fn send_pieces(&self, peer: usize, data: &[&[u8]]) -> Result<()> {
        let data = nonempty(data);
        self.check(peer, pieces::total(&data))?;
        let datatype = self.layouts.datatype(self.rank, addresses(&data))?;
        let message = Outgoing::new(&data, datatype.as_deref().map(|d| &d.0));
        let dst = self.world().process_at_rank(peer as i32);
        mpi::request::scope(|scope| {
            self.complete_any(&mut [(peer, &mut *message.post(&dst, scope))]);
        });
        Ok(())
    }

    /// Several pieces are received as one message through a datatype of their blocks,
    /// where they lie.
    fn recv_pieces(&self, peer: usize, buf: &mut [&mut [u8]]) -> Result<()> {
        let mut buf = nonempty_mut(buf);
        let len = pieces::total(&buf);
        self.check(peer, len)?;
        let datatype = self.layouts.datatype(self.rank, addresses(&buf))?;
        let mut message = Incoming::new(&mut buf, datatype.as_deref().map(|d| &d.0));
        let src = self.world().process_at_rank(peer as i32);
        let status = mpi::request::scope(|scope| {
            self.complete_any(&mut [(peer, &mut *message.post(&src, scope))])[0]
        });
        self.check_status(status, peer, len)
    }

    /// Each direction's pieces go as one message through a datatype of their blocks,
    /// from and into where they lie.
    fn sendrecv_pieces(
        &self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        let send = nonempty(send);
        let mut recv = nonempty_mut(recv);
        let len = pieces::total(&recv);
        self.check(to, pieces::total(&send))?;
        self.check(from, len)?;
        let send_type = self.layouts.datatype(self.rank, addresses(&send))?;
        let recv_type = self.layouts.datatype(self.rank, addresses(&recv))?;
        let outgoing = Outgoing::new(&send, send_type.as_deref().map(|d| &d.0));
        let mut incoming = Incoming::new(&mut recv, recv_type.as_deref().map(|d| &d.0));
        let world = self.world();
        let (dst, src) = (
            world.process_at_rank(to as i32),
            world.process_at_rank(from as i32),
        );
        let status = mpi::request::scope(|scope| {
            let mut rreq = incoming.post(&src, scope);
            let mut sreq = outgoing.post(&dst, scope);
            self.complete_any(&mut [(from, &mut *rreq), (to, &mut *sreq)])[0]
        });
        self.check_status(status, from, len)
    }

    fn duplicate(&self) -> Result<Box<dyn Transport>> {
        Ok(Box::new(Self::over(
            self.world().duplicate(),
            Arc::clone(&self.universe),
            self.watch.duplicate(),
        )))
    }

    fn stalled(&self, error: Error) -> Error {
        self.abort_stalled(error)
    }

    fn node_rank(&self) -> Result<NodeRank> {
        let shared = self.world().split_shared(self.world().rank());
        Ok(NodeRank {
            rank: usize::try_from(shared.rank()).unwrap_or(0),
            size: usize::try_from(shared.size()).unwrap_or(1).max(1),
        })
    }

    fn recv_vec(&self, peer: usize) -> Result<Vec<u8>> {
        self.check(peer, 0)?;
        Ok(self.receive_any_length(peer))
    }

    /// Non-blocking sends to every peer, then receives of unknown length (matched probe).
    fn exchange_all(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.check(0, data.len())?;
        let (n, r) = (self.size, self.rank);
        let world = self.world();
        let mut out = vec![Vec::new(); n];
        mpi::request::scope(|scope| {
            let sends: Vec<_> = (1..n)
                .map(|k| {
                    let peer = (r + k) % n;
                    (
                        peer,
                        world
                            .process_at_rank(peer as i32)
                            .immediate_send(scope, data),
                    )
                })
                .collect();
            for k in 1..n {
                let peer = (r + n - k) % n;
                out[peer] = self.receive_any_length(peer);
            }
            self.complete(sends);
        });
        out[r] = data.to_vec();
        Ok(out)
    }

    /// Every receive and every send posted at once (non-blocking), then all completed
    /// together: one message step, the peers still pending named if it stalls.
    fn all_to_all_into(&self, sends: &[&[u8]], recvs: &mut [&mut [u8]]) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        check_all_to_all_len(r, n, sends.len(), recvs.len())?;
        for (peer, (send, recv)) in sends.iter().zip(recvs.iter()).enumerate() {
            if peer != r {
                self.check(peer, send.len().max(recv.len()))?;
            }
        }
        let expected: Vec<usize> = recvs.iter().map(|b| b.len()).collect();
        let world = self.world();
        let statuses = mpi::request::scope(|scope| {
            let mut requests = Vec::with_capacity(2 * (n - 1));
            for (peer, recv) in recvs.iter_mut().enumerate() {
                if peer != r {
                    let src = world.process_at_rank(peer as i32);
                    requests.push((peer, src.immediate_receive_into(scope, &mut **recv)));
                }
            }
            for k in 1..n {
                let peer = (r + k) % n;
                let dst = world.process_at_rank(peer as i32);
                requests.push((peer, dst.immediate_send(scope, sends[peer])));
            }
            self.complete(requests)
        });
        // The receives come first, in peer order without this rank.
        for (k, status) in statuses.into_iter().take(n - 1).enumerate() {
            let peer = if k < r { k } else { k + 1 };
            self.check_status(status, peer, expected[peer])?;
        }
        Ok(())
    }

    /// As [`MpiTransport::all_to_all_into`], each message of several pieces through a
    /// datatype of their blocks, from and into where they lie.
    fn all_to_all_pieces(&self, sends: &[&[&[u8]]], recvs: &mut [&mut [&mut [u8]]]) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        check_all_to_all_len(r, n, sends.len(), recvs.len())?;
        let sends: Vec<pieces::Bytes> = sends.iter().map(|s| nonempty(s)).collect();
        let mut recvs: Vec<pieces::BytesMut> = recvs.iter_mut().map(|p| nonempty_mut(p)).collect();
        let expected: Vec<usize> = recvs.iter().map(|p| pieces::total(p)).collect();
        for peer in (0..n).filter(|&p| p != r) {
            self.check(peer, pieces::total(&sends[peer]).max(expected[peer]))?;
        }
        let send_types = (0..n)
            .map(|p| self.layouts.datatype(self.rank, addresses(&sends[p])))
            .collect::<Result<Vec<_>>>()?;
        let recv_types = (0..n)
            .map(|p| self.layouts.datatype(self.rank, addresses(&recvs[p])))
            .collect::<Result<Vec<_>>>()?;
        let outgoing: Vec<Outgoing> = sends
            .iter()
            .zip(&send_types)
            .map(|(s, t)| Outgoing::new(s, t.as_deref().map(|d| &d.0)))
            .collect();
        let mut incoming: Vec<Incoming> = recvs
            .iter_mut()
            .zip(&recv_types)
            .map(|(p, t)| Incoming::new(p, t.as_deref().map(|d| &d.0)))
            .collect();
        let world = self.world();
        let statuses = mpi::request::scope(|scope| {
            let mut requests: Vec<(usize, Box<dyn Pending + '_>)> = Vec::with_capacity(2 * (n - 1));
            for (peer, message) in incoming.iter_mut().enumerate() {
                if peer != r {
                    let src = world.process_at_rank(peer as i32);
                    requests.push((peer, message.post(&src, scope)));
                }
            }
            for k in 1..n {
                let peer = (r + k) % n;
                let dst = world.process_at_rank(peer as i32);
                requests.push((peer, outgoing[peer].post(&dst, scope)));
            }
            let mut pending: Vec<(usize, &mut (dyn Pending + '_))> =
                requests.iter_mut().map(|(p, q)| (*p, &mut **q)).collect();
            self.complete_any(&mut pending)
        });
        // The receives come first, in peer order without this rank.
        for (k, status) in statuses.into_iter().take(n - 1).enumerate() {
            let peer = if k < r { k } else { k + 1 };
            self.check_status(status, peer, expected[peer])?;
        }
        Ok(())
    }

    /// A non-blocking send, then a receive of unknown length (matched probe).
    fn sendrecv_vec(&self, to: usize, send: &[u8], from: usize) -> Result<Vec<u8>> {
        self.check(to, send.len())?;
        self.check(from, 0)?;
        let world = self.world();
        let mut out = Vec::new();
        mpi::request::scope(|scope| {
            let sreq = world.process_at_rank(to as i32).immediate_send(scope, send);
            out = self.receive_any_length(from);
            self.complete(vec![(to, sreq)]);
        });
        Ok(out)
    }

    fn sendrecv(&self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.check(to, send.len())?;
        self.check(from, recv.len())?;
        let world = self.world();
        let len = recv.len();
        let status = mpi::request::scope(|scope| {
            let rreq = world
                .process_at_rank(from as i32)
                .immediate_receive_into(scope, recv);
            let sreq = world.process_at_rank(to as i32).immediate_send(scope, send);
            self.complete(vec![(from, rreq), (to, sreq)])[0]
        });
        self.check_status(status, from, len)
    }

    /// Non-blocking segments: segment k is received and sent while segment k - 1 is
    /// handed to `on_segment`. A segment of several pieces goes as one message through a
    /// datatype of their blocks.
    fn sendrecv_pipelined(
        &self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [u8],
        segment_bytes: usize,
        on_segment: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let send_len = pieces::total(send);
        self.check(to, send_len)?;
        self.check(from, recv.len())?;
        let world = self.world();
        let dst = world.process_at_rank(to as i32);
        let src = world.process_at_rank(from as i32);
        let sends = segment_count(send_len, segment_bytes);
        let recvs = segment_count(recv.len(), segment_bytes);
        let mut previous: Option<std::ops::Range<usize>> = None;
        for k in 0..sends.max(recvs) {
            let r = if k < recvs {
                segment_range(recv.len(), segment_bytes, k)
            } else {
                recv.len()..recv.len()
            };
            let (done, rest) = recv.split_at_mut(r.start);
            let incoming = &mut rest[..r.len()];
            let outgoing_pieces = if k < sends {
                nonempty(&pieces::window(
                    send,
                    segment_range(send_len, segment_bytes, k),
                ))
            } else {
                pieces::Bytes::new()
            };
            let outgoing_type = self
                .layouts
                .datatype(self.rank, addresses(&outgoing_pieces))?;
            let outgoing = Outgoing::new(&outgoing_pieces, outgoing_type.as_deref().map(|d| &d.0));
            let result = mpi::request::scope(|scope| {
                let mut rreq = (k < recvs).then(|| {
                    Box::new(Some(src.immediate_receive_into(scope, &mut *incoming)))
                        as Box<dyn Pending>
                });
                let mut sreq = (k < sends).then(|| outgoing.post(&dst, scope));
                let processed = match previous.take() {
                    Some(p) => on_segment(p.start, &done[p]),
                    None => Ok(()),
                };
                let mut requests: Vec<(usize, &mut dyn Pending)> = Vec::with_capacity(2);
                if let Some(q) = rreq.as_deref_mut() {
                    requests.push((from, q));
                }
                if let Some(q) = sreq.as_deref_mut() {
                    requests.push((to, q));
                }
                let statuses = self.complete_any(&mut requests);
                let status = (k < recvs).then(|| statuses[0]);
                (processed, status)
            });
            let (processed, status) = result;
            processed?;
            if let Some(status) = status {
                self.check_status(status, from, r.len())?;
                previous = Some(r);
            }
        }
        if let Some(p) = previous {
            on_segment(p.start, &recv[p])?;
        }
        Ok(())
    }

    fn native_all_reduce(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() != recv.len() {
            return Err(Error::invalid(
                "receive buffer length",
                recv.len(),
                "pass a receive buffer as long as the send buffer",
            ));
        }
        let f32_ops = (&self.nan_ops.min_f32, &self.nan_ops.max_f32);
        let f64_ops = (&self.nan_ops.min_f64, &self.nan_ops.max_f64);
        let cast_err = |e: bytemuck::PodCastError| Error::Transport {
            rank: self.rank,
            detail: format!("buffer is not whole aligned {dtype} elements: {e}"),
        };
        match dtype {
            DType::F32 => {
                let s: &[f32] = bytemuck::try_cast_slice(send).map_err(cast_err)?;
                let r: &mut [f32] = bytemuck::try_cast_slice_mut(recv).map_err(cast_err)?;
                self.all_reduce_with(f32_ops, op, s, r);
            }
            DType::F64 => {
                let s: &[f64] = bytemuck::try_cast_slice(send).map_err(cast_err)?;
                let r: &mut [f64] = bytemuck::try_cast_slice_mut(recv).map_err(cast_err)?;
                self.all_reduce_with(f64_ops, op, s, r);
            }
            // MPI has no half types: reduce in f32 and round once at the end.
            DType::F16 => {
                let s: &[f16] = bytemuck::try_cast_slice(send).map_err(cast_err)?;
                let wide: Vec<f32> = s.iter().map(|x| x.to_f32()).collect();
                let mut out = vec![0f32; wide.len()];
                self.all_reduce_with(f32_ops, op, &wide[..], &mut out[..]);
                let r: &mut [f16] = bytemuck::try_cast_slice_mut(recv).map_err(cast_err)?;
                for (d, x) in r.iter_mut().zip(out) {
                    *d = f16::from_f32(x);
                }
            }
            DType::BF16 => {
                let s: &[bf16] = bytemuck::try_cast_slice(send).map_err(cast_err)?;
                let wide: Vec<f32> = s.iter().map(|x| x.to_f32()).collect();
                let mut out = vec![0f32; wide.len()];
                self.all_reduce_with(f32_ops, op, &wide[..], &mut out[..]);
                let r: &mut [bf16] = bytemuck::try_cast_slice_mut(recv).map_err(cast_err)?;
                for (d, x) in r.iter_mut().zip(out) {
                    *d = bf16::from_f32(x);
                }
            }
        }
        Ok(())
    }
}
