//! The cached-group step and the armed group: a group submitted again with the same
//! names and shapes is reduced without a queue entry per tensor, and once every rank has
//! taken that step with the same group, without a negotiation round ([`Armed`]).

use super::*;

/// A cached group that every rank reduced in the last cycle and reduces again in the
/// next without a negotiation round: the next cycle of every rank is a vote, in which each
/// rank votes for the group (it submitted the same group again) or against (it submitted
/// anything else, shuts down, or waits for another tensor), and the group's reduction when
/// every rank voted for it. Any vote against ends it on every rank at once (every rank
/// sees the same reduced votes), and the cycles go on with rounds. An armed engine's
/// background thread makes no idle round until the engine has been idle for
/// [`MAX_ARMED_IDLE`] (or a quarter of the stall timeout); its idle round then is a vote
/// against, so that a rank waiting in the armed reduction for an idle one goes on to the
/// general path, whose stall checks name the missing ranks and tensors.
///
/// The votes travel in one of three ways ([`Votes`]), all giving the general path's bits:
/// - a group the shared-memory all-reduce reduces where its tensors lie (without scaling
///   or wire compression) votes with the flags of that reduction, which writes nothing
///   unless every rank voted for it ([`Communicator::shared_memory_all_reduce_if`]): no
///   copy, no round;
/// - a group whose reduction carries the votes exactly is copied into the fusion buffer
///   with a vote slot after each ring chunk, and the votes are reduced with it: one
///   reduction, no round. This where the group is at most [`MAX_SLOT_VOTE_BYTES`], or
///   the communicator would copy it into one buffer anyway (direct and scatter-gather,
///   small tensors: [`Communicator::reduces_in_place`]);
/// - a larger group that the communicator reduces where its tensors lie
///   ([`Communicator::all_reduce_pieces`]), one with scaling or wire compression, or one
///   the hierarchical all-reduce reduces (its shares are not the ring's chunks), is
///   reduced after a vote of its own, a reduction of one element: the copies into and
///   out of the fusion buffer would cost more than that round. The vote comes first so
///   that nothing is written when it fails.
///
/// The slots are placed one after each ring chunk of the fused tensors, so that every
/// element stays in its chunk and is summed in the order it would be without them (the
/// other algorithms' orders do not depend on an element's place), and the algorithm is
/// the one chosen for the tensors' own size. A vote in a slot is a value whose reduction
/// is exact under every operation without scaling or wire compression: for a sum,
/// average or maximum 0 for and 1 against, so that the slot stays 0 only when every rank
/// voted for; for a minimum 1 for and 0 against.
#[derive(Debug)]
pub(super) struct Armed {
    /// The group's names (kept, so that their address stays theirs).
    pub(super) names: TensorNames,
    /// Its tensors' lengths, in the order of the names.
    pub(super) lens: Vec<usize>,
    /// `(id, index)` in id order, as [`Engine::cached_order`] gives it.
    pub(super) order: Vec<(u32, u32)>,
    pub(super) dtype: DType,
    /// Elements of all its tensors.
    pub(super) len: usize,
    /// The options with the algorithm resolved for the tensors' own size.
    pub(super) options: AllReduceOptions,
    /// How the ranks vote for it.
    pub(super) votes: Votes,
    /// When it was armed or last reduced.
    pub(super) since: Instant,
}

/// How the ranks vote for an armed group ([`Armed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Votes {
    /// With the flags of its shared-memory reduction in place.
    InFlags,
    /// In a slot after each ring chunk of the group copied into the fusion buffer.
    InSlots,
    /// In a reduction of their own before the group's, which is reduced in place.
    First,
}

/// How long an armed engine stays idle before its background thread votes against the
/// group (and idle rounds resume), at most: a step that takes longer pays that vote and a
/// round, and a rank that waits in the armed reduction for an idle one is released long
/// before the stall timeout (a quarter of it where that is shorter) would report it.
pub(super) const MAX_ARMED_IDLE: Duration = Duration::from_secs(1);

/// The largest armed group whose votes travel in slots of its own reduction: above it,
/// copying the group into the fusion buffer and back costs more than a vote of its own
/// before a reduction in place (measured at 2 to 4 ranks over shared memory, where a
/// one-element all-reduce takes a few microseconds and copying 64 KiB in and out about as
/// long).
pub(super) const MAX_SLOT_VOTE_BYTES: usize = 64 << 10;

impl Engine {
    /// `(id, index)` of every tensor of `names` in id order (the order a round's
    /// decisions reduce them in) when the group can take the cached-group step: nothing
    /// else queued, waiting or failed here, no timeline, a remembered group of at least
    /// two distinct names, every shape as cached, one dtype, one fusion buffer.
    pub(super) fn cached_order(
        &self,
        names: &TensorNames,
        tensors: &[Tensor],
    ) -> Option<Vec<(u32, u32)>> {
        if tensors.len() < 2 || self.busy() || !self.failed.is_empty() || self.timeline.enabled() {
            return None;
        }
        let key = Arc::as_ptr(&names.names).cast::<Arc<str>>() as usize;
        let (_, ids) = self.group_ids.get(&key)?;
        let dtype = tensors[0].dtype();
        let mut bytes = 0usize;
        let mut order = Vec::with_capacity(ids.len());
        for (index, (&id, t)) in ids.iter().zip(tensors).enumerate() {
            if t.dtype() != dtype || !self.table.is_cached(id, dtype, t.len() as u64) {
                return None;
            }
            bytes = bytes.saturating_add(t.size_bytes());
            order.push((id, index as u32));
        }
        if order.len() != tensors.len() || bytes > self.config.threshold_bytes {
            return None;
        }
        order.sort_unstable();
        order.windows(2).all(|w| w[0].0 < w[1].0).then_some(order)
    }

    /// Queues a group offered to the cached-group step as [`Engine::accept_group`] would
    /// have (every name has its id and a free slot: [`Engine::cached_order`] said so).
    pub(super) fn queue_cached(&mut self, batch: u64, tensors: Vec<Tensor>, order: &[(u32, u32)]) {
        let mut tensors: Vec<Option<Tensor>> = tensors.into_iter().map(Some).collect();
        for &(id, index) in order {
            let Some(tensor) = tensors[index as usize].take() else {
                continue;
            };
            self.slots[id as usize] = Some(Pending {
                tensor: Payload::Owned(tensor),
                ticket: Ticket::Member { batch, index },
                submitted: None,
            });
            self.queued += 1;
        }
    }

    /// The fused reduction of a cached group, as [`Engine::reduce_group`] does it for the
    /// same tensors queued (same buffer, same order), from and back to where they lie.
    pub(super) fn reduce_cached(
        &mut self,
        comm: &mut Communicator,
        tensors: &mut [Tensor],
        order: &[(u32, u32)],
    ) -> Result<()> {
        match tensors[0].dtype() {
            DType::F32 => self.reduce_cached_as::<f32>(comm, tensors, order),
            DType::F64 => self.reduce_cached_as::<f64>(comm, tensors, order),
            DType::F16 => self.reduce_cached_as::<half::f16>(comm, tensors, order),
            DType::BF16 => self.reduce_cached_as::<half::bf16>(comm, tensors, order),
        }
    }

    pub(super) fn reduce_cached_as<T: Element>(
        &mut self,
        comm: &mut Communicator,
        tensors: &mut [Tensor],
        order: &[(u32, u32)],
    ) -> Result<()> {
        let mut pieces = pieces_in_order::<T>(tensors, order)?;
        comm.all_reduce_pieces(&mut pieces, &self.config.options)?;
        #[cfg(test)]
        {
            self.cached_steps += 1;
        }
        Ok(())
    }

    /// Whether a cached-group step of `tensors` asks every rank to arm the group: when
    /// there is another rank and something to reduce.
    pub(super) fn can_arm(comm: &Communicator, tensors: &[Tensor]) -> bool {
        comm.size() > 1 && tensors.iter().any(|t| !t.is_empty())
    }

    /// The armed state of a group whose cached-group step every rank took, after its
    /// reduction (which settled whether the ranks share memory): votes in the flags of a
    /// shared-memory reduction in place, where there is one, its reduction is exact (no
    /// scaling, no wire compression); else in slots where its reduction carries them
    /// exactly (one of our algorithms, whose order of additions the slots keep) and either
    /// it is at most [`MAX_SLOT_VOTE_BYTES`] or the communicator reduces it in one buffer
    /// anyway ([`Communicator::reduces_in_place`]); else a vote first.
    pub(super) fn armed(
        &self,
        comm: &Communicator,
        names: &TensorNames,
        tensors: &[Tensor],
        order: Vec<(u32, u32)>,
    ) -> Armed {
        let opts = self.config.options;
        let dtype = tensors[0].dtype();
        let len: usize = tensors.iter().map(Tensor::len).sum();
        let bytes = len * dtype.size_bytes();
        let algorithm = comm.resolve_algorithm(opts.algorithm, bytes);
        let exact = opts.prescale == 1.0
            && opts.postscale == 1.0
            && opts.compression == crate::options::WireCompression::None
            && matches!(
                algorithm,
                crate::Algorithm::Ring
                    | crate::Algorithm::RecursiveDoubling
                    | crate::Algorithm::HalvingDoubling
                    | crate::Algorithm::Direct
                    | crate::Algorithm::ScatterGather
                    | crate::Algorithm::SharedMemory
            );
        // Where the communicator reduces the group in one buffer anyway, the fusion buffer
        // with slots costs no more copies than a buffer without.
        let in_place = comm.reduces_in_place(dtype, &opts, tensors.len(), bytes);
        let votes = if exact && in_place && algorithm == crate::Algorithm::SharedMemory {
            Votes::InFlags
        } else if exact && (!in_place || bytes <= MAX_SLOT_VOTE_BYTES) {
            Votes::InSlots
        } else {
            Votes::First
        };
        Armed {
            names: names.clone(),
            lens: tensors.iter().map(Tensor::len).collect(),
            order,
            dtype,
            len,
            options: AllReduceOptions { algorithm, ..opts },
            votes,
            since: Instant::now(),
        }
    }

    /// Whether `tensors` under `names` are the armed group as [`Engine::cached_order`]
    /// would find it, without its look-ups: the same names (the ids of names never change,
    /// and no round has changed a cached shape since the group was armed), the same
    /// shapes, nothing else queued, waiting or failed here.
    pub(super) fn is_armed_group(
        &self,
        armed: &Armed,
        names: &TensorNames,
        tensors: &[Tensor],
    ) -> bool {
        Arc::ptr_eq(&armed.names.names, &names.names)
            && !self.busy()
            && self.failed.is_empty()
            && tensors.len() == armed.lens.len()
            && tensors
                .iter()
                .zip(&armed.lens)
                .all(|(t, &len)| t.dtype() == armed.dtype && t.len() == len)
    }

    /// The armed group's reduction with this rank's vote: `Some(tensors)` (in the order
    /// of their names) for it, `None` against. True when every rank voted for it (the
    /// sums are in the tensors); false when any voted against (nothing was written).
    pub(super) fn armed_round(
        &mut self,
        comm: &mut Communicator,
        armed: &Armed,
        tensors: Option<&mut [Tensor]>,
    ) -> Result<bool> {
        #[cfg(test)]
        {
            self.armed_rounds += 1;
        }
        match armed.dtype {
            DType::F32 => self.armed_round_as::<f32>(comm, armed, tensors),
            DType::F64 => self.armed_round_as::<f64>(comm, armed, tensors),
            DType::F16 => self.armed_round_as::<half::f16>(comm, armed, tensors),
            DType::BF16 => self.armed_round_as::<half::bf16>(comm, armed, tensors),
        }
    }

    pub(super) fn armed_round_as<T: Element>(
        &mut self,
        comm: &mut Communicator,
        armed: &Armed,
        tensors: Option<&mut [Tensor]>,
    ) -> Result<bool> {
        match armed.votes {
            Votes::InFlags => self.armed_round_in_flags::<T>(comm, armed, tensors),
            Votes::InSlots => self.armed_round_in_slots::<T>(comm, armed, tensors),
            Votes::First => self.armed_round_voting_first::<T>(comm, armed, tensors),
        }
    }

    /// [`Votes::InFlags`]: the group reduced where its tensors lie over shared memory,
    /// when every rank's vote, carried by the reduction's flags, was for it.
    fn armed_round_in_flags<T: Element>(
        &mut self,
        comm: &mut Communicator,
        armed: &Armed,
        tensors: Option<&mut [Tensor]>,
    ) -> Result<bool> {
        let mut pieces = tensors
            .map(|tensors| pieces_in_order::<T>(tensors, &armed.order))
            .transpose()?;
        let agreed = comm.shared_memory_all_reduce_if(pieces.as_deref_mut(), &armed.options)?;
        #[cfg(test)]
        if agreed {
            self.cached_steps += 1;
        }
        Ok(agreed)
    }

    /// [`Votes::First`]: every rank's vote (0 for, 1 against) reduced by its maximum, then,
    /// when all were for, the group reduced where its tensors lie.
    fn armed_round_voting_first<T: Element>(
        &mut self,
        comm: &mut Communicator,
        armed: &Armed,
        tensors: Option<&mut [Tensor]>,
    ) -> Result<bool> {
        let mut vote = [if tensors.is_some() { 0.0f32 } else { 1.0 }];
        comm.all_reduce(&mut vote, &AllReduceOptions::with_op(crate::ReduceOp::Max))?;
        let Some(tensors) = tensors.filter(|_| vote[0] == 0.0) else {
            return Ok(false);
        };
        let mut pieces = pieces_in_order::<T>(tensors, &armed.order)?;
        comm.all_reduce_pieces(&mut pieces, &armed.options)?;
        #[cfg(test)]
        {
            self.cached_steps += 1;
        }
        Ok(true)
    }

    /// [`Votes::InSlots`]: the group copied into the fusion buffer with a vote after each
    /// ring chunk, reduced, and copied back when every slot says all were for it.
    fn armed_round_in_slots<T: Element>(
        &mut self,
        comm: &mut Communicator,
        armed: &Armed,
        mut tensors: Option<&mut [Tensor]>,
    ) -> Result<bool> {
        let (n, len) = (comm.size(), armed.len);
        let (for_it, against) = match armed.options.op {
            crate::ReduceOp::Min => (1.0, 0.0),
            _ => (0.0, 1.0),
        };
        let buf = fusion_buffer::<T>(&mut self.buffer, len + n);
        match tensors.as_deref_mut() {
            Some(tensors) => {
                let mut walk = PastSlots::new(len, n);
                for &(_, index) in &armed.order {
                    walk.scatter(buf, typed::<T>(&mut tensors[index as usize])?);
                }
            }
            None => buf.fill(T::from_f64(0.0)),
        }
        let vote = T::from_f64(if tensors.is_some() { for_it } else { against });
        for c in 0..n {
            buf[ring_chunk_range(len, n, c).end + c] = vote;
        }
        comm.all_reduce(buf, &armed.options)?;
        let agreed = (0..n).all(|c| buf[ring_chunk_range(len, n, c).end + c].to_f64() == for_it);
        if !agreed {
            return Ok(false);
        }
        let Some(tensors) = tensors else {
            return Ok(false);
        };
        let mut walk = PastSlots::new(len, n);
        for &(_, index) in &armed.order {
            walk.gather(buf, typed::<T>(&mut tensors[index as usize])?);
        }
        #[cfg(test)]
        {
            self.cached_steps += 1;
        }
        Ok(true)
    }
}

/// Each tensor's elements, in `order` (`(id, index)`: the order the general path fuses
/// them in).
fn pieces_in_order<'t, T: Element>(
    tensors: &'t mut [Tensor],
    order: &[(u32, u32)],
) -> Result<Vec<&'t mut [T]>> {
    if order
        .iter()
        .enumerate()
        .all(|(at, &(_, index))| index as usize == at)
    {
        // The group lists its tensors in id order (its names were first seen in it).
        return tensors.iter_mut().map(typed::<T>).collect();
    }
    let mut by_index = tensors
        .iter_mut()
        .map(|t| typed::<T>(t).map(Some))
        .collect::<Result<Vec<_>>>()?;
    Ok(order
        .iter()
        .filter_map(|&(_, index)| by_index[index as usize].take())
        .collect())
}

/// A walk over `len` fused elements laid out with one slot after each of the `n` ring
/// chunks (element `at` of chunk `c` lies `c` places further on), tensor after tensor:
/// each copy finds its chunk by the cursor, not by a division per tensor.
pub(super) struct PastSlots {
    /// Where each ring chunk ends (in fused elements).
    ends: Vec<usize>,
    /// The chunk of element `at`, once it is reached.
    chunk: usize,
    at: usize,
}

impl PastSlots {
    pub(super) fn new(len: usize, n: usize) -> PastSlots {
        PastSlots {
            ends: (0..n).map(|c| ring_chunk_range(len, n, c).end).collect(),
            chunk: 0,
            at: 0,
        }
    }

    /// The run of the next `want` (> 0) elements that lies in one chunk: its place in the
    /// buffer and its length.
    fn run(&mut self, want: usize) -> (usize, usize) {
        // Empty chunks (fewer elements than ranks) end where the one before them does.
        while self.ends[self.chunk] == self.at {
            self.chunk += 1;
        }
        let m = want.min(self.ends[self.chunk] - self.at);
        let place = self.at + self.chunk;
        self.at += m;
        (place, m)
    }

    /// Copies `src` to the next elements.
    pub(super) fn scatter<T: Copy>(&mut self, buf: &mut [T], mut src: &[T]) {
        while !src.is_empty() {
            let (place, m) = self.run(src.len());
            buf[place..place + m].copy_from_slice(&src[..m]);
            src = &src[m..];
        }
    }

    /// Copies the next elements into `dst`.
    pub(super) fn gather<T: Copy>(&mut self, buf: &[T], dst: &mut [T]) {
        let mut done = 0;
        while done < dst.len() {
            let (place, m) = self.run(dst.len() - done);
            dst[done..done + m].copy_from_slice(&buf[place..place + m]);
            done += m;
        }
    }
}
