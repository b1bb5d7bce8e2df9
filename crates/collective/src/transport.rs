//! The byte-moving layer the collectives are written against, and the in-process
//! [`LocalTransport`].

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::ReduceOp;
use crate::pieces;
use crate::stall::{StallWatch, Wait};

/// Point-to-point byte transport between `size` ranks.
///
/// Messages between one pair of ranks arrive in the order they were sent. Receives name
/// the exact length expected; a different length is an [`Error::Transport`].
pub trait Transport: Send {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// A short name for messages (`local`, `mpi`).
    fn name(&self) -> &'static str;
    /// The stall timeout of this transport's waits and what it is doing now (see
    /// [`crate::stall`]).
    fn stall_watch(&self) -> &StallWatch;
    /// Sends `data` to `peer`.
    fn send(&self, peer: usize, data: &[u8]) -> Result<()>;
    /// Receives exactly `buf.len()` bytes from `peer`.
    fn recv(&self, peer: usize, buf: &mut [u8]) -> Result<()>;
    /// Sends `send` to `to` while receiving `recv.len()` bytes from `from`, without
    /// deadlocking when every rank calls it at once (as a ring step does).
    fn sendrecv(&self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()>;

    /// Receives one message of any length from `peer`.
    fn recv_vec(&self, peer: usize) -> Result<Vec<u8>>;

    /// [`Transport::send`] of the message `data`'s pieces make up, in order (the
    /// concatenation of the slices). This default copies several pieces into one buffer;
    /// transports that can send from the pieces where they lie override it.
    fn send_pieces(&self, peer: usize, data: &[&[u8]]) -> Result<()> {
        match data {
            [] => self.send(peer, &[]),
            [one] => self.send(peer, one),
            _ => self.send(peer, &pieces::gather(data)),
        }
    }

    /// [`Transport::recv`] into the message `buf`'s pieces make up, in order. This default
    /// receives several pieces into one buffer and copies them out.
    fn recv_pieces(&self, peer: usize, buf: &mut [&mut [u8]]) -> Result<()> {
        match buf {
            [] => self.recv(peer, &mut []),
            [one] => self.recv(peer, one),
            _ => {
                let mut all = vec![0u8; pieces::total(buf)];
                self.recv(peer, &mut all)?;
                pieces::copy_to_pieces(buf, 0, &all);
                Ok(())
            }
        }
    }

    /// [`Transport::sendrecv`] of messages laid out in pieces: `send`'s pieces go to `to`
    /// as one message, and the message from `from` fills `recv`'s pieces in order. This
    /// default goes through one buffer each way where there are several pieces.
    fn sendrecv_pieces(
        &self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        let joined;
        let send: &[u8] = match send {
            [] => &[],
            [one] => one,
            _ => {
                joined = pieces::gather(send);
                &joined
            }
        };
        match recv {
            [] => self.sendrecv(to, send, from, &mut []),
            [one] => self.sendrecv(to, send, from, one),
            _ => {
                let mut all = vec![0u8; pieces::total(recv)];
                self.sendrecv(to, send, from, &mut all)?;
                pieces::copy_to_pieces(recv, 0, &all);
                Ok(())
            }
        }
    }

    /// Sends `send` to `to` while receiving one message of any length from `from`,
    /// without deadlocking when the two ranks call it towards each other at once (a
    /// pipeline stage sends its activations on while it receives a gradient back).
    ///
    /// This default needs buffered sends (as the local transport has); transports whose
    /// sends block override it.
    fn sendrecv_vec(&self, to: usize, send: &[u8], from: usize) -> Result<Vec<u8>> {
        self.send(to, send)?;
        self.recv_vec(from)
    }

    /// A second transport over the same ranks whose messages never match this one's
    /// (`MPI_Comm_dup`), so control messages cannot be confused with data in flight here,
    /// and the two may be used from different threads at once. Collective: every rank calls
    /// it, and the k-th call on each rank returns endpoints of the same new group.
    fn duplicate(&self) -> Result<Box<dyn Transport>>;

    /// What a wait outside the transport (a flag in memory the ranks share) does when the
    /// stall timeout runs out: the local transport returns `error` to the caller; the MPI
    /// transport prints it and aborts the job, as its own waits do.
    fn stalled(&self, error: Error) -> Error {
        error
    }

    /// This rank's place among the ranks that share its node (its memory), as
    /// `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` finds them. Collective.
    fn node_rank(&self) -> Result<NodeRank>;

    /// The number rank `peer` of this transport has in the transport it was made from
    /// (`MPI_COMM_WORLD` under MPI; itself for this default): the number stall messages
    /// name a rank by, whichever subgroup waits.
    fn global_rank(&self, peer: usize) -> usize {
        peer
    }

    /// A number equal on the ranks that share this rank's node and different on other
    /// nodes' ranks: what [`crate::Communicator::nodes`] groups the ranks by. Not
    /// collective. This default is a hash of the environment variable [`NODE_ENV`] where
    /// it is set (ranks that give it the same value are on one node: containers of one
    /// host that do not share memory, each socket of a host taken as a node, a test of
    /// several nodes on one host), else of the host's name (as `gethostname` gives it),
    /// which is how MPI launchers tell nodes apart too.
    ///
    /// # Errors
    /// [`Error::Transport`] when the host's name cannot be read.
    fn node_key(&self) -> Result<u64> {
        if let Some(node) = std::env::var_os(NODE_ENV).filter(|v| !v.is_empty()) {
            return Ok(fnv1a(node.as_encoded_bytes()));
        }
        host_key().map_err(|e| Error::Transport {
            rank: self.rank(),
            detail: format!("could not read this host's name to find its node: {e}"),
        })
    }

    /// Sends `data` to every other rank and returns every rank's data, own included, in
    /// rank order: one message step, however many ranks (lengths may differ per rank).
    ///
    /// This default needs buffered sends (as the local transport has); transports whose
    /// sends block override it.
    fn exchange_all(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (n, r) = (self.size(), self.rank());
        for k in 1..n {
            self.send((r + k) % n, data)?;
        }
        let mut out = vec![Vec::new(); n];
        for k in 1..n {
            let peer = (r + n - k) % n;
            out[peer] = self.recv_vec(peer)?;
        }
        out[r] = data.to_vec();
        Ok(out)
    }

    /// Sends `data` to every other rank and receives every other rank's message of the
    /// same length into `out` (`size * data.len()` bytes): rank `p`'s data lands at
    /// `out[p * data.len()..]`, this rank's own copied to its place. One message step
    /// where the transport can keep every message in flight at once
    /// ([`Transport::all_to_all_into`]).
    fn exchange_all_into(&self, data: &[u8], out: &mut [u8]) -> Result<()> {
        let (n, r, len) = (self.size(), self.rank(), data.len());
        check_exchange_len(r, n, len, out.len())?;
        // Zero-length messages are exchanged too, so that every rank takes part.
        let mut slots: Vec<&mut [u8]> = if len == 0 {
            (0..n).map(|_| <&mut [u8]>::default()).collect()
        } else {
            out.chunks_mut(len).collect()
        };
        slots[r].copy_from_slice(data);
        self.all_to_all_into(&vec![data; n], &mut slots)
    }

    /// Sends `sends[p]` to every other rank `p` and receives rank `p`'s message for this
    /// rank into `recvs[p]`, which must be exactly as long as what `p` sends here; entry
    /// `rank` of both is left alone. Both hold one entry per rank. One message step where
    /// the transport can keep every message in flight at once; a stall names the peers
    /// still pending.
    ///
    /// This default takes `size - 1` shifts (send to `rank + k`, receive from
    /// `rank - k`) through [`Transport::sendrecv`], which works over any transport;
    /// transports with non-blocking messages override it with one step.
    fn all_to_all_into(&self, sends: &[&[u8]], recvs: &mut [&mut [u8]]) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        check_all_to_all_len(r, n, sends.len(), recvs.len())?;
        for k in 1..n {
            let (to, from) = ((r + k) % n, (r + n - k) % n);
            self.sendrecv(to, sends[to], from, recvs[from])?;
        }
        Ok(())
    }

    /// [`Transport::all_to_all_into`] of messages laid out in pieces: `sends[p]`'s pieces
    /// go to rank `p` as one message, and the message from `p` fills `recvs[p]`'s pieces
    /// in order. This default goes through one buffer per message of several pieces.
    fn all_to_all_pieces(&self, sends: &[&[&[u8]]], recvs: &mut [&mut [&mut [u8]]]) -> Result<()> {
        let joined: Vec<std::borrow::Cow<'_, [u8]>> = sends
            .iter()
            .map(|s| match s {
                [] => std::borrow::Cow::Borrowed(&[][..]),
                [one] => std::borrow::Cow::Borrowed(*one),
                _ => std::borrow::Cow::Owned(pieces::gather(s)),
            })
            .collect();
        let mut staged: Vec<Vec<u8>> = recvs
            .iter()
            .map(|r| {
                if r.len() > 1 {
                    vec![0u8; pieces::total(r)]
                } else {
                    Vec::new()
                }
            })
            .collect();
        let send_refs: Vec<&[u8]> = joined.iter().map(|s| &**s).collect();
        let mut recv_refs: Vec<&mut [u8]> = recvs
            .iter_mut()
            .zip(&mut staged)
            .map(|(r, staged)| match r {
                [] => &mut [][..],
                [one] => &mut **one,
                _ => staged.as_mut_slice(),
            })
            .collect();
        self.all_to_all_into(&send_refs, &mut recv_refs)?;
        for (r, staged) in recvs.iter_mut().zip(&staged) {
            if r.len() > 1 {
                pieces::copy_to_pieces(r, 0, staged);
            }
        }
        Ok(())
    }

    /// Like [`Transport::sendrecv_pieces`] with one piece to receive into, but moves the
    /// data in segments of `segment_bytes` and calls `on_segment(byte_offset, bytes)` for
    /// every received segment, in order, while later segments are still in flight where
    /// the transport allows it.
    fn sendrecv_pipelined(
        &self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [u8],
        segment_bytes: usize,
        on_segment: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        // The number of messages each way depends only on that direction's length, so
        // both ends of every link agree on it. This default needs buffered sends (as the
        // local transport has); transports whose sends block override it.
        let send_len = pieces::total(send);
        let sends = segment_count(send_len, segment_bytes);
        let recvs = segment_count(recv.len(), segment_bytes);
        for k in 0..sends.max(recvs) {
            if k < sends {
                let segment = segment_range(send_len, segment_bytes, k);
                self.send_pieces(to, &pieces::window(send, segment))?;
            }
            if k < recvs {
                let r = segment_range(recv.len(), segment_bytes, k);
                self.recv(from, &mut recv[r.clone()])?;
                on_segment(r.start, &recv[r])?;
            }
        }
        Ok(())
    }

    /// The transport's own all-reduce (MPI_Allreduce), out of place. `Average` reduces
    /// as `Sum` (the caller scales). Transports without one return
    /// [`Error::AlgorithmUnavailable`].
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
            transport: self.name(),
            hint: "use the ring or recursive-doubling algorithm, or build with feature `mpi` and run under mpirun",
        })
    }
}

/// `out_len` must be `size * len` for [`Transport::exchange_all_into`].
fn check_exchange_len(rank: usize, size: usize, len: usize, out_len: usize) -> Result<()> {
    if size.checked_mul(len) != Some(out_len) {
        return Err(Error::Transport {
            rank,
            detail: format!(
                "exchange of {len} bytes with {size} ranks needs a receive buffer of {size} x {len} bytes, got {out_len}"
            ),
        });
    }
    Ok(())
}

/// [`Transport::all_to_all_into`] takes one send and one receive buffer per rank.
pub(crate) fn check_all_to_all_len(
    rank: usize,
    size: usize,
    sends: usize,
    recvs: usize,
) -> Result<()> {
    if sends != size || recvs != size {
        return Err(Error::Transport {
            rank,
            detail: format!(
                "all-to-all among {size} ranks needs {size} send and {size} receive buffers, got {sends} and {recvs}"
            ),
        });
    }
    Ok(())
}

/// Number of segments of at most `segment` bytes covering `len` bytes.
pub(crate) fn segment_count(len: usize, segment: usize) -> usize {
    len.div_ceil(segment.max(1))
}

/// Byte range of segment `k` (empty past the end).
pub(crate) fn segment_range(len: usize, segment: usize, k: usize) -> Range<usize> {
    let segment = segment.max(1);
    let start = (k * segment).min(len);
    let end = ((k + 1) * segment).min(len);
    start..end
}

/// The environment variable that names a rank's node for [`Transport::node_key`]'s
/// default, instead of the host's name.
pub const NODE_ENV: &str = "RINGTRAIN_NODE";

/// FNV-1a of `bytes`: a 64-bit hash of a name.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// FNV-1a of this host's name.
fn host_key() -> std::io::Result<u64> {
    let mut name = [0u8; 256];
    // SAFETY: `name` is writable for its whole length, which is passed; the call writes
    // at most that many bytes.
    if unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(fnv1a(&name[..len]))
}

/// A rank's index among the ranks on its node, and how many share the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRank {
    /// Index of this rank among the ranks on its node, `0..size`.
    pub rank: usize,
    /// Ranks on this node.
    pub size: usize,
}

/// N ranks as threads of one process: each ordered pair of ranks has its own FIFO channel.
///
/// Sends never block (the channels are unbounded), so any send/recv order that is correct
/// over MPI is also correct here. A peer whose thread has ended turns a receive into an
/// [`Error::Transport`] instead of a hang, and a receive that waits longer than the stall
/// timeout returns [`Error::StallTimeout`] naming the peer (threads cannot abort the
/// process the way the MPI transport aborts the job).
#[derive(Debug)]
pub struct LocalTransport {
    rank: usize,
    size: usize,
    /// `to_peer[p]` carries messages from this rank to rank `p`.
    to_peer: Vec<Sender<Vec<u8>>>,
    /// `from_peer[p]` carries messages from rank `p` to this rank.
    from_peer: Vec<Receiver<Vec<u8>>>,
    /// This group's id in `groups`.
    group: usize,
    /// Duplicates made of this endpoint so far.
    duplicates: AtomicUsize,
    /// Shared by every endpoint descended from one [`LocalTransport::create`].
    groups: Arc<Mutex<LocalGroups>>,
    /// Stall timeout and current operation (shared with this rank's duplicates).
    watch: StallWatch,
    /// The node each rank claims to be on ([`LocalTransport::create_on_nodes`]).
    nodes: Arc<[usize]>,
}

/// The endpoints of duplicated groups not yet taken by their ranks.
#[derive(Debug, Default)]
struct LocalGroups {
    /// Groups created so far (the next group's id).
    created: usize,
    /// `(parent group, k)` -> the endpoints of the k-th duplicate of that group, by rank.
    pending: HashMap<(usize, usize), Vec<Option<LocalTransport>>>,
}

impl LocalTransport {
    /// Creates the `n` connected endpoints, rank `i` at index `i`, all on one node.
    pub fn create(n: usize) -> Result<Vec<LocalTransport>> {
        Self::create_on_nodes(&[n])
    }

    /// Creates connected endpoints that behave as if on several nodes:
    /// `ranks_per_node[j]` ranks on node `j`, numbered node after node (`[2, 2]`: ranks 0
    /// and 1 on node 0, ranks 2 and 3 on node 1), for testing what depends on the layout
    /// ([`Transport::node_rank`], [`Transport::node_key`],
    /// [`crate::Algorithm::Hierarchical`]). The threads still share memory.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] for no ranks, or a node without ranks.
    pub fn create_on_nodes(ranks_per_node: &[usize]) -> Result<Vec<LocalTransport>> {
        let n: usize = ranks_per_node.iter().sum();
        if n == 0 || ranks_per_node.contains(&0) {
            return Err(Error::invalid(
                "local ranks per node",
                format!("{ranks_per_node:?}"),
                "ask for at least one rank on every node",
            ));
        }
        let nodes: Arc<[usize]> = ranks_per_node
            .iter()
            .enumerate()
            .flat_map(|(node, &k)| std::iter::repeat_n(node, k))
            .collect();
        let groups = Arc::new(Mutex::new(LocalGroups {
            created: 1,
            pending: HashMap::new(),
        }));
        Ok(Self::connect(&nodes, 0, &groups))
    }

    /// The endpoints of group `group`, one per entry of `nodes` (each rank's node).
    fn connect(
        nodes: &Arc<[usize]>,
        group: usize,
        groups: &Arc<Mutex<LocalGroups>>,
    ) -> Vec<LocalTransport> {
        let n = nodes.len();
        // channels[src][dst]
        let mut senders: Vec<Vec<Option<Sender<Vec<u8>>>>> = Vec::with_capacity(n);
        let mut receivers: Vec<Vec<Option<Receiver<Vec<u8>>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for src in 0..n {
            let mut row = Vec::with_capacity(n);
            for dst_receivers in receivers.iter_mut() {
                let (tx, rx) = unbounded();
                row.push(Some(tx));
                dst_receivers[src] = Some(rx);
            }
            senders.push(row);
        }
        let mut out = Vec::with_capacity(n);
        for (rank, (row, from)) in senders.into_iter().zip(receivers).enumerate() {
            out.push(LocalTransport {
                rank,
                size: n,
                to_peer: row.into_iter().flatten().collect(),
                from_peer: from.into_iter().flatten().collect(),
                group,
                duplicates: AtomicUsize::new(0),
                groups: Arc::clone(groups),
                watch: StallWatch::default(),
                nodes: Arc::clone(nodes),
            });
        }
        out
    }

    /// The next message from `peer`, waiting at most the stall timeout.
    fn receive(&self, peer: usize) -> Result<Vec<u8>> {
        let mut wait = Wait::new(&self.watch, self.rank);
        loop {
            match self.from_peer[peer].recv_timeout(wait.slice()) {
                Ok(msg) => return Ok(msg),
                Err(RecvTimeoutError::Timeout) => wait.check(|| vec![peer])?,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Transport {
                        rank: self.rank,
                        detail: format!(
                            "rank {peer} has gone away before sending the expected message"
                        ),
                    })
                }
            }
        }
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!("peer rank {peer} does not exist (size {})", self.size),
            });
        }
        Ok(())
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &'static str {
        "local"
    }
    fn stall_watch(&self) -> &StallWatch {
        &self.watch
    }

    fn send(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.to_peer[peer]
            .send(data.to_vec())
            .map_err(|_| Error::Transport {
                rank: self.rank,
                detail: format!("rank {peer} has gone away (its endpoint was dropped)"),
            })
    }

    fn recv(&self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.check_peer(peer)?;
        let msg = self.receive(peer)?;
        if msg.len() != buf.len() {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!(
                    "message from rank {peer} has {} bytes, expected {}: the ranks called different collectives or lengths",
                    msg.len(),
                    buf.len()
                ),
            });
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }

    fn sendrecv(&self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.send(to, send)?;
        self.recv(from, recv)
    }

    fn recv_vec(&self, peer: usize) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        self.receive(peer)
    }

    /// The first rank to ask for the k-th duplicate of this group creates every rank's
    /// endpoint; each rank takes its own. No message is exchanged.
    fn duplicate(&self) -> Result<Box<dyn Transport>> {
        let k = self.duplicates.fetch_add(1, Ordering::Relaxed);
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let groups = &mut *groups;
        let endpoints = match groups.pending.entry((self.group, k)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let id = groups.created;
                groups.created += 1;
                e.insert(
                    Self::connect(&self.nodes, id, &self.groups)
                        .into_iter()
                        .map(Some)
                        .collect(),
                )
            }
        };
        let mut mine = endpoints[self.rank]
            .take()
            .ok_or_else(|| Error::Transport {
                rank: self.rank,
                detail: format!("duplicate {k} of this group was already taken by this rank"),
            })?;
        if endpoints.iter().all(Option::is_none) {
            groups.pending.remove(&(self.group, k));
        }
        mine.watch = self.watch.duplicate();
        Ok(Box::new(mine))
    }

    /// The ranks on this rank's node as [`LocalTransport::create_on_nodes`] laid them out
    /// (all of them after [`LocalTransport::create`]).
    fn node_rank(&self) -> Result<NodeRank> {
        let node = self.nodes[self.rank];
        let on_node = |&n: &usize| n == node;
        Ok(NodeRank {
            rank: self.nodes[..self.rank]
                .iter()
                .filter(|n| on_node(n))
                .count(),
            size: self.nodes.iter().filter(|n| on_node(n)).count(),
        })
    }

    /// This rank's node as [`LocalTransport::create_on_nodes`] laid them out.
    fn node_key(&self) -> Result<u64> {
        Ok(self.nodes[self.rank] as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks laid out as `[2, 1, 3]`: each knows its node (the same key as its node's
    /// other ranks, another than the other nodes'), its index there and the node's size,
    /// and so do its duplicates; a layout with an empty node, or none, is refused.
    #[test]
    fn local_ranks_laid_out_on_nodes_know_their_node() {
        let layout = [2usize, 1, 3];
        let ranks = LocalTransport::create_on_nodes(&layout).expect("layout");
        let node_of = [0usize, 0, 1, 2, 2, 2];
        let local = [0usize, 1, 0, 0, 1, 2];
        for (r, t) in ranks.iter().enumerate() {
            let here = t.node_rank().expect("node rank");
            assert_eq!(here.rank, local[r], "rank {r}");
            assert_eq!(here.size, layout[node_of[r]], "rank {r}");
            assert_eq!(t.node_key().expect("key"), node_of[r] as u64, "rank {r}");
        }
        let copies: Vec<Box<dyn Transport>> = ranks
            .iter()
            .map(|t| t.duplicate().expect("duplicate"))
            .collect();
        for (r, t) in copies.iter().enumerate() {
            assert_eq!(
                t.node_key().expect("key"),
                node_of[r] as u64,
                "duplicate of rank {r}"
            );
        }
        for bad in [&[2usize, 0][..], &[], &[0]] {
            let err = LocalTransport::create_on_nodes(bad).expect_err("refused");
            assert!(
                err.to_string().contains("at least one rank on every node"),
                "{err}"
            );
        }
    }
}
