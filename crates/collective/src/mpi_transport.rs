//! [`MpiTransport`]: rsmpi point-to-point over `MPI_COMM_WORLD` or a duplicate of it
//! (feature `mpi`).

use std::sync::Arc;

use half::{bf16, f16};
use std::ffi::{c_int, c_void};

use mpi::collective::{CommunicatorCollectives as _, SystemOperation, UnsafeUserOperation};
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec as _, Source, Status};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::Threading;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::ReduceOp;
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
        let mut pending: Vec<(usize, Option<Request<'a, D, S>>)> =
            requests.into_iter().map(|(p, r)| (p, Some(r))).collect();
        let mut statuses: Vec<Option<Status>> = vec![None; pending.len()];
        let mut wait = Wait::new(&self.watch, self.rank);
        loop {
            let mut open = 0;
            for (k, (_, slot)) in pending.iter_mut().enumerate() {
                if let Some(req) = slot.take() {
                    match req.test() {
                        Ok(status) => statuses[k] = Some(status),
                        Err(req) => {
                            *slot = Some(req);
                            open += 1;
                        }
                    }
                }
            }
            if open == 0 {
                return statuses.into_iter().flatten().collect();
            }
            let peers = || {
                pending
                    .iter()
                    .filter(|(p, r)| r.is_some() && *p != usize::MAX)
                    .map(|(p, _)| *p)
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

    fn duplicate(&self) -> Result<Box<dyn Transport>> {
        Ok(Box::new(Self::over(
            self.world().duplicate(),
            Arc::clone(&self.universe),
            self.watch.duplicate(),
        )))
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
    /// handed to `on_segment`.
    fn sendrecv_pipelined(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        segment_bytes: usize,
        on_segment: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        self.check(to, send.len())?;
        self.check(from, recv.len())?;
        let world = self.world();
        let dst = world.process_at_rank(to as i32);
        let src = world.process_at_rank(from as i32);
        let sends = segment_count(send.len(), segment_bytes);
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
            let outgoing = if k < sends {
                Some(&send[segment_range(send.len(), segment_bytes, k)])
            } else {
                None
            };
            let result = mpi::request::scope(|scope| {
                let rreq = (k < recvs).then(|| src.immediate_receive_into(scope, &mut *incoming));
                let sreq = outgoing.map(|o| dst.immediate_send(scope, o));
                let processed = match previous.take() {
                    Some(p) => on_segment(p.start, &done[p]),
                    None => Ok(()),
                };
                let mut requests = Vec::with_capacity(2);
                let has_recv = rreq.is_some();
                if let Some(q) = rreq {
                    requests.push((from, q));
                }
                if let Some(q) = sreq {
                    requests.push((to, q));
                }
                let statuses = self.complete(requests);
                let status = has_recv.then(|| statuses[0]);
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
