//! The hierarchical all-reduce ([`crate::Algorithm::Hierarchical`]) for ranks on several
//! nodes. The links within a node (shared memory, NVLink) are many times faster than the
//! links between nodes, so the elements should cross between nodes as few times as they
//! can, and every node's ranks should share that traffic. With `k` ranks on every node:
//!
//! 1. within each node, a reduce-scatter: local rank `l` ends with its share of the
//!    message reduced over its node, through the node's shared-memory segment (chunk `l`
//!    of every piece of the segment the message goes through: the first two steps of
//!    [`crate::shared_memory`]) where every node maps one, else by a ring (chunk `l` of
//!    the message, [`crate::ring_chunk_range`] over `k`);
//! 2. across nodes, the ranks with the same local rank all-reduce their share among
//!    themselves ([`crate::Algorithm::Auto`]): each rank sends about `1/k` of the message
//!    over the links between nodes, all `k` of a node at once;
//! 3. within each node, an all-gather of the shares, the same way as step 1.
//!
//! Whether the nodes reduce through shared memory is agreed by every rank (the shares
//! must line up across nodes) on the first call, and again after the segment's size or
//! directory changes; ranks whose segment sizes differ are refused then, on every rank.
//!
//! Where the nodes hold different numbers of ranks the chunks would not line up across
//! nodes. Then each node all-reduces the whole message (`auto`), the first rank of every
//! node all-reduces it across nodes, and each first rank broadcasts it within its node (a
//! message in pieces as one buffer).
//! One node: the node's all-reduce alone; one rank per node: the all-reduce across nodes
//! alone.
//!
//! Each element is reduced once (within its node in rank order through shared memory or
//! in the ring's order, then across nodes in the order of the algorithm `auto` takes
//! there) and copied to the other ranks, so
//! every rank ends with the same bits; they need not be the bits of a one-level
//! algorithm, whose order of additions differs.
//!
//! The nodes are found once per communicator, on its first hierarchical all-reduce or
//! [`Communicator::nodes`]: every rank's [`crate::Transport::node_key`] (the host's name,
//! or [`crate::NODE_ENV`] where it is set), exchanged, and the two communicators of the phases made from them
//! ([`Communicator::subgroup`]). [`crate::Algorithm::Auto`] never takes this algorithm:
//! the switch points between it and the one-level algorithms depend on the links between
//! nodes, which a one-node machine cannot measure.
//!
//! ```
//! use ringtrain_collective::{Algorithm, AllReduceOptions, Communicator};
//!
//! // Four ranks on two nodes: ranks 0 and 1 on node 0, ranks 2 and 3 on node 1.
//! let opts = AllReduceOptions::sum().algorithm(Algorithm::Hierarchical);
//! let sums = Communicator::run_local_on_nodes(&[2, 2], |mut comm| {
//!     assert_eq!(comm.nodes()?, vec![vec![0, 1], vec![2, 3]]);
//!     let mut v = vec![comm.rank() as f32; 1000];
//!     comm.all_reduce(&mut v, &opts).map(|_| v)
//! })?;
//! for v in sums {
//!     assert_eq!(v?, vec![6.0f32; 1000]); // 0 + 1 + 2 + 3
//! }
//! # Ok::<(), ringtrain_collective::Error>(())
//! ```

use crate::communicator::{ring_chunk_range, Communicator};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::options::{AllReduceOptions, ReduceOp};
use crate::pieces;

/// The nodes of a communicator and the communicators of the hierarchical all-reduce's
/// phases, made once.
pub(crate) struct Hierarchy {
    /// The ranks of each node, ascending; the nodes in the order of their first ranks.
    nodes: Vec<Vec<usize>>,
    /// This rank's node.
    node: Communicator,
    /// The ranks of every node whose local index (rank in `node`) is this rank's.
    across: Communicator,
    /// Whether every node reduces through its shared-memory segment, as agreed for the
    /// node communicator's segment settings (size, directory): settings every rank
    /// changes at the same call, so that every rank agrees again at the same one.
    node_phase: Option<(bool, (usize, Option<std::path::PathBuf>))>,
}

impl Hierarchy {
    /// Finds the nodes of `comm`'s ranks and makes the phases' communicators, for
    /// `purpose` (what stall messages call the exchange). Collective over `comm`.
    fn new(comm: &mut Communicator, purpose: &'static str) -> Result<Hierarchy> {
        let key = comm.transport().node_key()?;
        comm.begin(purpose, None, 8);
        let keys = comm.transport().exchange_all(&key.to_le_bytes())?;
        let mut nodes: Vec<(u64, Vec<usize>)> = Vec::new();
        for (rank, key) in keys.iter().enumerate() {
            let Ok(key) = <[u8; 8]>::try_from(key.as_slice()).map(u64::from_le_bytes) else {
                return Err(Error::Transport {
                    rank: comm.rank(),
                    detail: format!(
                        "rank {rank} sent {} bytes instead of its node's 8: the ranks called different collectives",
                        key.len()
                    ),
                });
            };
            match nodes.iter_mut().find(|(k, _)| *k == key) {
                Some((_, ranks)) => ranks.push(rank),
                None => nodes.push((key, vec![rank])),
            }
        }
        let nodes: Vec<Vec<usize>> = nodes.into_iter().map(|(_, ranks)| ranks).collect();
        let mine = nodes
            .iter()
            .find(|ranks| ranks.contains(&comm.rank()))
            .expect("every rank, this one too, is on a node");
        let local = mine
            .iter()
            .position(|&r| r == comm.rank())
            .expect("this rank is on its node");
        let node = comm.subgroup(mine)?;
        let peers: Vec<usize> = nodes
            .iter()
            .filter_map(|ranks| ranks.get(local).copied())
            .collect();
        let across = comm.subgroup(&peers)?;
        Ok(Hierarchy {
            nodes,
            node,
            across,
            node_phase: None,
        })
    }

    /// Whether every node reduces through its shared-memory segment: mapped on each node,
    /// then agreed by every rank of `comm` (the parent), once per segment setting.
    /// Collective over `comm`.
    fn node_shares_memory(&mut self, comm: &mut Communicator) -> Result<bool> {
        let (mapped, settings) = self.node.shares_memory()?;
        if let Some((agreed, ref known)) = self.node_phase {
            if *known == settings {
                return Ok(agreed);
            }
        }
        comm.begin(
            "hierarchical all-reduce (agreeing on shared memory)",
            None,
            1,
        );
        // Every rank's segment size too: nodes whose segments differ would cut the message
        // into different shares, and the all-reduces across nodes would add elements
        // that do not belong together.
        let mut mine = settings.0.to_le_bytes().to_vec();
        mine.push(u8::from(mapped));
        let all = comm.transport().exchange_all(&mine)?;
        let sizes: Vec<String> = all
            .iter()
            .map(
                |m| match m.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()) {
                    Some(b) => u64::from_le_bytes(b).to_string(),
                    None => "?".to_string(),
                },
            )
            .collect();
        if sizes.iter().any(|s| *s != sizes[comm.rank()]) {
            return Err(Error::invalid(
                "segment bytes (one value per rank)",
                sizes.join(", "),
                "set the same segment size on every rank (Communicator::set_segment_bytes): \
                 the hierarchical all-reduce cuts the message by it",
            ));
        }
        let agreed = all.iter().all(|m| m.get(8) == Some(&1));
        self.node_phase = Some((agreed, settings));
        Ok(agreed)
    }

    /// Whether every node holds as many ranks.
    fn uniform(&self) -> bool {
        self.nodes
            .iter()
            .all(|ranks| ranks.len() == self.nodes[0].len())
    }
}

impl Communicator {
    /// The ranks of each node (ascending), the nodes in the order of their first ranks:
    /// `[[0, 1], [2, 3]]` for four ranks, two per node. Found on the first call (or the
    /// first [`crate::Algorithm::Hierarchical`] all-reduce) from every rank's
    /// [`crate::Transport::node_key`], and kept: collective the first time, local after.
    ///
    /// # Errors
    /// The transport's.
    pub fn nodes(&mut self) -> Result<Vec<Vec<usize>>> {
        Ok(self.hierarchy("finding the nodes")?.nodes.clone())
    }

    /// The hierarchy, made on the first call (for `purpose`); its communicators take this
    /// one's current settings.
    fn hierarchy(&mut self, purpose: &'static str) -> Result<&mut Hierarchy> {
        let hierarchy = self.take_hierarchy(purpose)?;
        Ok(self.hierarchy.insert(hierarchy))
    }

    /// [`Communicator::hierarchy`], out of this communicator while it works with both.
    fn take_hierarchy(&mut self, purpose: &'static str) -> Result<Box<Hierarchy>> {
        let mut hierarchy = match self.hierarchy.take() {
            Some(h) => h,
            None => Box::new(Hierarchy::new(self, purpose)?),
        };
        hierarchy.node.adopt_settings_of(self);
        hierarchy.across.adopt_settings_of(self);
        Ok(hierarchy)
    }

    /// [`crate::Algorithm::Hierarchical`] of the message `pieces` make up, without
    /// scaling (see the module docs).
    pub(crate) fn hierarchical_all_reduce<T: Element>(
        &mut self,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let mut h = self.take_hierarchy("hierarchical all-reduce (finding the nodes)")?;
        let result = h.all_reduce(self, pieces, op);
        self.hierarchy = Some(h);
        result
    }
}

impl Hierarchy {
    /// The hierarchical all-reduce of `pieces` on `comm`'s ranks (see the module docs).
    fn all_reduce<T: Element>(
        &mut self,
        comm: &mut Communicator,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let inner = AllReduceOptions::with_op(match op {
            ReduceOp::Average => ReduceOp::Sum,
            other => other,
        });
        if self.nodes.len() == 1 {
            return self.node.all_reduce_pieces(pieces, &inner);
        }
        if self.node.size() == 1 && self.uniform() {
            return self.across.all_reduce_pieces(pieces, &inner);
        }
        if !self.uniform() {
            self.node.all_reduce_pieces(pieces, &inner)?;
            if self.node.rank() == 0 {
                self.across.all_reduce_pieces(pieces, &inner)?;
            }
            // One message for all the pieces (a fused group has hundreds).
            return self
                .node
                .through_one_buffer(pieces, |node, buf| node.broadcast(buf, 0));
        }
        let shared = self.node_shares_memory(comm)?;
        let own = if shared {
            self.node.shared_memory_reduce_scatter(pieces, inner.op)?
        } else {
            self.node.ring_reduce_scatter(pieces, inner.op)?;
            vec![ring_chunk_range(
                pieces::total(pieces),
                self.node.size(),
                self.node.rank(),
            )]
        };
        {
            let carved = pieces::carve_many(pieces, &own);
            let mut share: Vec<&mut [T]> = carved.into_iter().flatten().collect();
            self.across.all_reduce_pieces(&mut share, &inner)?;
        }
        if shared {
            self.node.shared_memory_all_gather(pieces)
        } else {
            self.node.ring_all_gather_chunks(pieces)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;

    /// Rank `r`'s input: values whose sums round differently in different orders.
    fn input(r: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + r * 104_729) % 1013) as f32 * 1.0e-3 + 1.0e4 * (r % 2) as f32)
            .collect()
    }

    /// Every layout (one node, one rank per node, even and uneven nodes), lengths from 0
    /// past the chunk counts, whole and in pieces, each operation, the nodes reducing
    /// through shared memory (in one piece of the segment or dozens) or, with one node's
    /// shared memory off, all of them by the ring: every rank gets the same bits, within
    /// f32 rounding of the f64 sum (exactly the extreme for min and max), and the nodes
    /// as laid out.
    #[test]
    fn every_layout_reduces_to_the_same_bits_on_every_rank() {
        let layouts: [&[usize]; 6] = [&[3], &[1, 1, 1], &[2, 2], &[3, 3], &[2, 1], &[1, 3, 2]];
        for layout in layouts {
            let n: usize = layout.iter().sum();
            for len in [0usize, 1, 5, 1000] {
                for op in [
                    ReduceOp::Sum,
                    ReduceOp::Average,
                    ReduceOp::Max,
                    ReduceOp::Min,
                ] {
                    // Whole; through the segment in dozens of pieces; and so with the
                    // last node's shared memory off, where every node must take the ring
                    // (whose chunks are not the segment's).
                    for (cut, small_segment, last_node_off) in [
                        (None, false, false),
                        (Some(len / 3), true, false),
                        (Some(len / 3), true, true),
                    ] {
                        let opts = AllReduceOptions::with_op(op).algorithm(Algorithm::Hierarchical);
                        let last_node = n - layout[layout.len() - 1];
                        let outs = Communicator::run_local_on_nodes(layout, |mut comm| {
                            if small_segment {
                                comm.set_segment_bytes(64);
                            }
                            if last_node_off && comm.rank() >= last_node {
                                comm.set_shared_memory_dir(None);
                            }
                            let mut v = input(comm.rank(), len);
                            match cut {
                                None => comm.all_reduce(&mut v, &opts)?,
                                Some(at) => {
                                    let (a, b) = v.split_at_mut(at);
                                    comm.all_reduce_pieces(&mut [a, b], &opts)?;
                                }
                            }
                            Ok::<_, Error>((v, comm.nodes()?))
                        })
                        .expect("threads");
                        let outs: Vec<(Vec<f32>, Vec<Vec<usize>>)> = outs
                            .into_iter()
                            .map(|o| o.unwrap_or_else(|e| panic!("{layout:?}, {len}, {op}: {e}")))
                            .collect();
                        let mut next = 0;
                        let expected_nodes: Vec<Vec<usize>> = layout
                            .iter()
                            .map(|&k| {
                                next += k;
                                (next - k..next).collect()
                            })
                            .collect();
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        for (r, (v, nodes)) in outs.iter().enumerate() {
                            assert_eq!(nodes, &expected_nodes, "{layout:?}: rank {r}");
                            assert_eq!(
                                bits(v),
                                bits(&outs[0].0),
                                "{layout:?}, {len}, {op}: rank {r}"
                            );
                        }
                        for (i, &got) in outs[0].0.iter().enumerate() {
                            let all = (0..n).map(|r| f64::from(input(r, len)[i]));
                            let want = match op {
                                ReduceOp::Sum => all.sum::<f64>(),
                                ReduceOp::Average => all.sum::<f64>() / n as f64,
                                ReduceOp::Max => all.fold(f64::MIN, f64::max),
                                ReduceOp::Min => all.fold(f64::MAX, f64::min),
                            };
                            let tolerance = match op {
                                ReduceOp::Max | ReduceOp::Min => 0.0,
                                _ => want.abs() * n as f64 * f64::from(f32::EPSILON),
                            };
                            assert!(
                                (f64::from(got) - want).abs() <= tolerance,
                                "{layout:?}, {len}, {op}, element {i}: {got} against {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Ranks that set different segment sizes: every rank is told, naming each rank's
    /// size, before anything is reduced across nodes.
    #[test]
    fn different_segment_sizes_are_refused_on_every_rank() {
        let outs = Communicator::run_local_on_nodes(&[2, 2], |mut comm| {
            if comm.rank() == 3 {
                comm.set_segment_bytes(1024);
            }
            let mut v = vec![1.0f32; 4096];
            let opts = AllReduceOptions::sum().algorithm(Algorithm::Hierarchical);
            comm.all_reduce(&mut v, &opts).map(|_| v)
        })
        .expect("threads");
        let sizes = format!("{d}, {d}, {d}, 1024", d = crate::DEFAULT_SEGMENT_BYTES);
        for (r, out) in outs.iter().enumerate() {
            let msg = out.as_ref().expect_err("refused").to_string();
            assert!(
                msg.contains(&sizes) && msg.contains("set_segment_bytes"),
                "rank {r}: {msg}"
            );
        }
    }

    /// A rank that stops taking part after the nodes are known: every other rank's wait
    /// (within its node or across nodes) ends with an error after the stall timeout, and
    /// the rank that waits for it names it by its number in the whole communicator.
    #[test]
    fn a_stalled_rank_on_another_node_is_named() {
        let outs = Communicator::run_local_on_nodes(&[2, 2], |mut comm| {
            comm.set_stall_timeout(Some(std::time::Duration::from_millis(300)));
            comm.nodes()?;
            if comm.rank() == 3 {
                std::thread::sleep(std::time::Duration::from_secs(3));
                return Ok(());
            }
            let mut v = vec![1.0f32; 4096];
            comm.all_reduce(
                &mut v,
                &AllReduceOptions::sum().algorithm(Algorithm::Hierarchical),
            )
        })
        .expect("threads");
        let mut named = false;
        for (r, out) in outs[..3].iter().enumerate() {
            let msg = out
                .as_ref()
                .expect_err("a stalled rank fails the wait")
                .to_string();
            named |= msg.contains("waiting for rank 3");
            // Rank 2 waits for rank 3; the ranks of node 0 wait for their partners.
            assert!(
                msg.contains("waiting for rank") || msg.contains("gone away"),
                "rank {r}: {msg}"
            );
        }
        assert!(named, "no rank named rank 3: {outs:?}");
    }

    /// Two nodes of two ranks: the sums take the two levels' order of additions, not the
    /// ring's (so the two-level path ran), within rounding of the ring's average; scaling
    /// and wire compression apply as with the other algorithms.
    #[test]
    fn two_levels_take_their_own_order_and_keep_the_options() {
        let len = 4096;
        let run = |algorithm, compression| {
            Communicator::run_local_on_nodes(&[2, 2], |mut comm| {
                let opts = AllReduceOptions {
                    compression,
                    prescale: 0.5,
                    ..AllReduceOptions::average().algorithm(algorithm)
                };
                let mut v = input(comm.rank(), len);
                comm.all_reduce(&mut v, &opts).map(|_| v)
            })
            .expect("threads")
            .into_iter()
            .map(|r| r.expect("all-reduce"))
            .collect::<Vec<_>>()
        };
        use crate::WireCompression::{Bf16, None as Plain};
        let hier = run(Algorithm::Hierarchical, Plain);
        let ring = run(Algorithm::Ring, Plain);
        assert!(hier.iter().all(|v| v == &hier[0]));
        let close = hier[0]
            .iter()
            .zip(&ring[0])
            .all(|(a, b)| (a - b).abs() <= 1e-3 * b.abs().max(1.0));
        assert!(
            close,
            "the hierarchical average is the ring's, within rounding"
        );
        // 1, 2^24, 1, -2^24 turned by one rank per element: the nodes' sums, then their
        // sum, round unlike any one-level order somewhere.
        let turned = |algorithm| {
            Communicator::run_local_on_nodes(&[2, 2], |mut comm| {
                let r = comm.rank();
                let mut v: Vec<f32> = (0..len)
                    .map(|i| [1.0, 16_777_216.0, 1.0, -16_777_216.0][(r + i) % 4])
                    .collect();
                comm.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(algorithm))
                    .map(|_| v)
            })
            .expect("threads")
            .swap_remove(0)
            .expect("all-reduce")
        };
        let two_levels = turned(Algorithm::Hierarchical);
        assert!(
            two_levels.iter().all(|&x| x == 1.0),
            "(x0 + x1) + (x2 + x3) is 1 everywhere"
        );
        for one_level in [Algorithm::Ring, Algorithm::Direct, Algorithm::SharedMemory] {
            assert_ne!(turned(one_level), two_levels, "{one_level}");
        }
        let squeezed = run(Algorithm::Hierarchical, Bf16);
        assert!(squeezed.iter().all(|v| v == &squeezed[0]));
        let near = squeezed[0]
            .iter()
            .zip(&hier[0])
            .all(|(a, b)| (a - b).abs() <= 2e-2 * b.abs().max(1.0));
        assert!(near, "bf16 on the wire stays within bf16's rounding");
    }
}
