//! [`SubgroupTransport`]: some of the ranks of a transport as a transport of their own,
//! the way `MPI_Comm_split` makes one (see [`crate::Communicator::subgroup`]).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::ReduceOp;
use crate::stall::StallWatch;
use crate::transport::{NodeRank, Transport};

/// The ranks `members` (ranks of `inner`, ascending) as ranks `0..members.len()`. It
/// owns a duplicate of the parent transport, so its messages never mix with the
/// parent's; every call maps ranks and goes to the duplicate.
pub struct SubgroupTransport {
    inner: Box<dyn Transport>,
    members: Vec<usize>,
    rank: usize,
}

impl SubgroupTransport {
    /// The subgroup of `inner`'s ranks `members` that holds `inner.rank()`.
    ///
    /// # Errors
    /// [`Error::Transport`] when `members` is not ascending, names a rank that does not
    /// exist, or leaves this rank out.
    pub fn new(inner: Box<dyn Transport>, members: Vec<usize>) -> Result<Self> {
        let me = inner.rank();
        let ascending = members.windows(2).all(|w| w[0] < w[1]);
        let exists = members.iter().all(|&m| m < inner.size());
        let rank = members.iter().position(|&m| m == me);
        match rank {
            Some(rank) if ascending && exists => Ok(SubgroupTransport {
                inner,
                members,
                rank,
            }),
            _ => Err(Error::Transport {
                rank: me,
                detail: format!(
                    "subgroup {members:?} of {} ranks: it must list ranks in ascending order, \
                     this rank among them",
                    inner.size()
                ),
            }),
        }
    }

    /// The parent rank of subgroup rank `peer`.
    fn parent(&self, peer: usize) -> Result<usize> {
        self.members
            .get(peer)
            .copied()
            .ok_or_else(|| Error::Transport {
                rank: self.rank,
                detail: format!(
                    "peer rank {peer} does not exist (subgroup size {})",
                    self.members.len()
                ),
            })
    }
}

impl Transport for SubgroupTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn stall_watch(&self) -> &StallWatch {
        self.inner.stall_watch()
    }
    fn send(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.inner.send(self.parent(peer)?, data)
    }
    fn recv(&self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.inner.recv(self.parent(peer)?, buf)
    }
    fn sendrecv(&self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.inner
            .sendrecv(self.parent(to)?, send, self.parent(from)?, recv)
    }
    fn recv_vec(&self, peer: usize) -> Result<Vec<u8>> {
        self.inner.recv_vec(self.parent(peer)?)
    }
    fn sendrecv_vec(&self, to: usize, send: &[u8], from: usize) -> Result<Vec<u8>> {
        self.inner
            .sendrecv_vec(self.parent(to)?, send, self.parent(from)?)
    }
    /// Collective over the PARENT's ranks: every rank of the parent makes its
    /// subgroup's duplicate at the same point.
    fn duplicate(&self) -> Result<Box<dyn Transport>> {
        Ok(Box::new(SubgroupTransport {
            inner: self.inner.duplicate()?,
            members: self.members.clone(),
            rank: self.rank,
        }))
    }
    /// This rank's place among the members on its node, by the members' node keys
    /// ([`Transport::node_key`]) gathered among the members alone: the parent's own
    /// `node_rank` is collective over all of its ranks, which the others do not call.
    fn node_rank(&self) -> Result<NodeRank> {
        let mine = self.node_key()?;
        let mut keys = Vec::with_capacity(self.size());
        for (peer, bytes) in self.exchange_all(&mine.to_le_bytes())?.iter().enumerate() {
            let key: [u8; 8] = bytes.as_slice().try_into().map_err(|_| Error::Transport {
                rank: self.rank,
                detail: format!(
                    "node key from subgroup rank {peer} has {} bytes, expected 8: the ranks called different collectives",
                    bytes.len()
                ),
            })?;
            keys.push(u64::from_le_bytes(key));
        }
        let on_node = |k: &&u64| **k == mine;
        Ok(NodeRank {
            rank: keys[..self.rank].iter().filter(on_node).count(),
            size: keys.iter().filter(on_node).count(),
        })
    }
    fn node_key(&self) -> Result<u64> {
        self.inner.node_key()
    }
    fn global_rank(&self, peer: usize) -> usize {
        self.members
            .get(peer)
            .map_or(peer, |&parent| self.inner.global_rank(parent))
    }
    fn stalled(&self, error: Error) -> Error {
        self.inner.stalled(error)
    }
    /// One shift per step: send to `rank + k`, receive from `rank - k`.
    fn exchange_all(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (n, r) = (self.size(), self.rank);
        let mut out = vec![Vec::new(); n];
        for k in 1..n {
            let from = (r + n - k) % n;
            out[from] = self.sendrecv_vec((r + k) % n, data, from)?;
        }
        out[r] = data.to_vec();
        Ok(out)
    }
    fn send_pieces(&self, peer: usize, data: &[&[u8]]) -> Result<()> {
        self.inner.send_pieces(self.parent(peer)?, data)
    }
    fn recv_pieces(&self, peer: usize, buf: &mut [&mut [u8]]) -> Result<()> {
        self.inner.recv_pieces(self.parent(peer)?, buf)
    }
    fn sendrecv_pieces(
        &self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        self.inner
            .sendrecv_pieces(self.parent(to)?, send, self.parent(from)?, recv)
    }
    fn sendrecv_pipelined(
        &self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [u8],
        segment_bytes: usize,
        on_segment: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        self.inner.sendrecv_pipelined(
            self.parent(to)?,
            send,
            self.parent(from)?,
            recv,
            segment_bytes,
            on_segment,
        )
    }
    fn native_all_reduce(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let _ = (send, recv, dtype, op);
        Err(Error::AlgorithmUnavailable {
            algorithm: "mpi",
            transport: "subgroup",
            hint: "use the ring or recursive-doubling algorithm on a subgroup",
        })
    }
}
