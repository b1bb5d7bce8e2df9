//! The shared-memory all-reduce ([`crate::Algorithm::SharedMemory`]): the ranks of one
//! node reduce through a memory segment they all map, instead of sending messages.
//!
//! The message goes through the segment a piece at a time (the communicator's segment
//! size, [`crate::Communicator::set_segment_bytes`], per rank). A piece is split into one
//! chunk per rank ([`crate::ring_chunk_range`]). For each piece:
//!
//! 1. every rank copies the chunks the other ranks reduce into its own slot of the
//!    segment and raises its flag;
//! 2. once every flag is up, rank `p` reduces chunk `p` in rank order,
//!    `((x0 op x1) op x2) ...`, its own elements from its buffer and the others' from
//!    their slots, a block at a time; the result goes into its buffer and its slot, and
//!    it raises its flag again;
//! 3. once every flag is up again, every rank copies the other ranks' reduced chunks out
//!    of their slots.
//!
//! Two sets of slots take turns, so a rank fills the next piece while slower ranks still
//! copy the last one out; a set is refilled two pieces later, when every rank has
//! finished the piece that used it (each rank finishes a piece before it raises its flag
//! for the next, so two flags per piece order everything). Every element is reduced at one rank in rank order and copied to the
//! others, so every rank ends with the same bits, those of [`crate::Algorithm::Direct`]
//! and scatter-gather. What it saves over messages: a message over shared memory is
//! copied twice (into the transport's buffer by the sender, out by the receiver) and the
//! received copy is read again to be reduced; here the reduction reads the other ranks'
//! slots directly, and a flag in shared memory replaces each message's protocol.
//!
//! A message in pieces (a fused group of tensors where they lie) is walked once per
//! piece of the segment, a run of a piece at a time: the first step remembers where each
//! rank's chunk starts, and the reduction and the copies out start there.
//!
//! The ranks may vote on an all-reduce (`NodeSegment::all_reduce_if`): each writes its
//! vote beside its flag before the first piece's first rise, and every rank reads all of
//! them once every flag is up; a vote against ends the call there on every rank, before
//! anything but the slots is written. An armed group of the fusion engine votes this way,
//! without a round of its own.
//!
//! Steps 1 and 2 alone are a reduce-scatter (`NodeSegment::reduce_scatter`), and step 3
//! with flags of its own an all-gather (`NodeSegment::all_gather`): the phases within a
//! node of [`crate::Algorithm::Hierarchical`].
//!
//! The segment is a file in `/dev/shm` (or the directory
//! [`crate::Communicator::set_shared_memory_dir`] names), created by rank 0 on the first
//! shared-memory all-reduce of a communicator, its memory reserved at once, mapped by
//! every rank, and removed as soon as every rank has mapped it or the attempt failed, so
//! that nothing is left behind however the job ends (unless it is killed in the moment
//! between). Where some rank cannot map it (ranks on other nodes, containers that do not
//! share `/dev/shm`, no room there), every rank learns it at once: an explicit
//! shared-memory all-reduce fails on every rank with an error that says why, and `auto`
//! chooses among the other algorithms from then on. A flag that does not rise is waited
//! for under the stall timeout like any message ([`crate::stall`]).
//!
//! ```
//! use ringtrain_collective::{Algorithm, AllReduceOptions, Communicator};
//!
//! let opts = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
//! let sums = Communicator::run_local(3, |mut comm| {
//!     let mut v = vec![comm.rank() as f32; 1000];
//!     comm.all_reduce(&mut v, &opts).map(|_| v)
//! })?;
//! for v in sums {
//!     assert_eq!(v?, vec![3.0f32; 1000]); // 0 + 1 + 2
//! }
//! # Ok::<(), ringtrain_collective::Error>(())
//! ```

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::communicator::ring_chunk_range;
use crate::dtype::Element;
use crate::error::Result;
use crate::options::ReduceOp;
use crate::pieces;
use crate::stall::Wait;
use crate::transport::Transport;
use smallvec::SmallVec;

/// Bytes of a cache line: every flag lies in one of its own.
const LINE: usize = 64;

/// Bytes of a page: the slots start on one, and addresses that agree modulo a page are
/// what `copy_across` keeps loads and stores apart from.
const PAGE: usize = 4096;

/// Where the slots begin: after the header line and one line per rank's flag, on a page.
fn data_offset(ranks: usize) -> usize {
    (LINE * (ranks + 1)).div_ceil(PAGE) * PAGE
}

/// Bytes from one slot to the next: whole pages, so that the same element of every slot
/// lies at the same place within its page.
fn slot_stride(slot_bytes: usize) -> usize {
    slot_bytes.div_ceil(PAGE) * PAGE
}

/// Spins on a flag before the wait starts yielding the core: a rank that shares its core
/// with the rank it waits for would otherwise hold the core for a whole time slice.
const SPINS_BEFORE_YIELD: u32 = 64;

/// Bytes of the blocks a chunk is reduced in: small enough for the partial sums to stay in
/// the first-level cache while every rank's elements of the block are added.
const REDUCE_BLOCK_BYTES: usize = 8 << 10;

/// A segment mapped by every rank of a communicator, and how far its flags have counted.
#[derive(Debug)]
pub(crate) struct NodeSegment {
    map: memmap2::MmapRaw,
    ranks: usize,
    rank: usize,
    /// Bytes of one rank's slot: the most of a piece.
    slot_bytes: usize,
    /// Pieces this rank has finished (the same count on every rank once the call ends):
    /// piece `k`'s flags count `2k + 1` and `2k + 2`.
    pieces: u64,
    /// Two blocks of [`REDUCE_BLOCK_BYTES`]: the partial sums and this rank's elements.
    scratch: Vec<u64>,
}

/// Where segments are made unless the communicator says otherwise
/// ([`crate::Communicator::set_shared_memory_dir`]): memory of this node only. A
/// temporary directory could be a network file system that ranks on different nodes see
/// at once, where a mapping is not shared memory at all.
pub const DEFAULT_SEGMENT_DIR: &str = "/dev/shm";

/// A fresh name for a segment file in `dir`: the process, the time and a counter.
fn segment_path(dir: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    dir.join(format!(
        "ringtrain-allreduce-{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Removes the segment's file when dropped: the mappings stay.
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A token rank 0 writes into the segment's first word, so that a rank that opened a file
/// of that name but another file (another node's) can tell.
fn token(path: &Path) -> u64 {
    // A hash of the name: different for every segment, since the names are.
    crate::transport::fnv1a(path.as_os_str().as_encoded_bytes())
}

/// Gives `file` `bytes` bytes of memory now: a file of that length alone would get its
/// pages when first touched, and a full `/dev/shm` (a container's is 64 MiB by default)
/// would then kill the process with SIGBUS instead of failing here.
fn reserve(file: &File, bytes: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: the descriptor is open for writing and stays open for the call.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

/// Maps all of `file`, which must hold at least `bytes` bytes.
fn map(file: &File, bytes: usize) -> std::io::Result<memmap2::MmapRaw> {
    let map = memmap2::MmapRaw::map_raw(file)?;
    if map.len() < bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{} bytes mapped, {bytes} expected", map.len()),
        ));
    }
    Ok(map)
}

impl NodeSegment {
    /// Bytes of the segment for `ranks` ranks with slots of `slot_bytes`.
    fn bytes(ranks: usize, slot_bytes: usize) -> usize {
        data_offset(ranks) + 2 * ranks * slot_stride(slot_bytes)
    }

    /// Creates and maps the segment on every rank of `transport`. Collective: every rank
    /// gets the segment, or every rank gets why some rank could not create or map it.
    /// `dir` is where rank 0 makes it; `None` on any rank: that rank takes no part in
    /// shared memory, and every rank gets why.
    ///
    /// # Errors
    /// The transport's, exchanging where the segment is and whether every rank mapped it.
    pub(crate) fn create(
        transport: &dyn Transport,
        slot_bytes: usize,
        dir: Option<&Path>,
    ) -> Result<std::result::Result<NodeSegment, String>> {
        let (ranks, rank) = (transport.size(), transport.rank());
        let bytes = Self::bytes(ranks, slot_bytes);
        // Rank 0 creates the file and says where it is, or why it could not. The file goes
        // when this function returns, whatever happens on the way: once every rank has
        // mapped it, or given up.
        let mut created: Option<(Unlink, memmap2::MmapRaw)> = None;
        let announce = match (rank, dir) {
            (0, None) => "Ehas shared memory turned off".to_string(),
            (0, Some(dir)) => {
                let path = segment_path(dir);
                let made = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|file| {
                        reserve(&file, bytes)?;
                        map(&file, bytes)
                    });
                match made {
                    Ok(map) => {
                        // SAFETY: the mapping is at least `bytes` long, page-aligned, and no
                        // other rank has it yet; the first word is the token.
                        unsafe { (map.as_mut_ptr() as *mut u64).write(token(&path)) };
                        let text = path.to_string_lossy().into_owned();
                        created = Some((Unlink(path), map));
                        format!("P{text}")
                    }
                    Err(e) => {
                        let _ = std::fs::remove_file(&path);
                        format!("Ecould not create {} ({bytes} bytes): {e}", path.display())
                    }
                }
            }
            _ => String::new(),
        };
        let told = transport.exchange_all(announce.as_bytes())?;
        let told = String::from_utf8_lossy(&told[0]).into_owned();
        let (unlink, created) = created.map_or((None, None), |(u, m)| (Some(u), Some(m)));
        let opened: std::result::Result<memmap2::MmapRaw, String> = match (created, told.split_at(1))
        {
            (Some(map), _) => Ok(map),
            (None, ("P", _)) if dir.is_none() => Err("has shared memory turned off".to_string()),
            (None, ("P", path)) => OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .and_then(|file| map(&file, bytes))
                .map_err(|e| format!("could not map rank 0's segment {path}: {e}"))
                .and_then(|map| {
                    // SAFETY: the mapping is at least `bytes` long and page-aligned; rank 0
                    // wrote the token before announcing the path and writes it no more.
                    let seen = unsafe { (map.as_ptr() as *const u64).read() };
                    (seen == token(Path::new(path))).then_some(map).ok_or_else(|| {
                        format!("{path} here is not rank 0's segment (another node, or another /dev/shm)")
                    })
                }),
            (None, (_, why)) => Err(why.to_string()),
        };
        let status = match &opened {
            Ok(_) => Vec::new(),
            Err(why) => why.clone().into_bytes(),
        };
        let statuses = transport.exchange_all(&status)?;
        drop(unlink);
        if let Some((failed, why)) = statuses.iter().enumerate().find(|(_, s)| !s.is_empty()) {
            return Ok(Err(format!(
                "the shared-memory all-reduce needs every rank on one node, mapping one segment: rank {failed}: {}; use another algorithm (auto chooses among the others then)",
                String::from_utf8_lossy(why)
            )));
        }
        let Ok(map) = opened else {
            unreachable!("every status was empty, this rank's too");
        };
        Ok(Ok(NodeSegment {
            map,
            ranks,
            rank,
            slot_bytes,
            pieces: 0,
            scratch: Vec::new(),
        }))
    }

    /// The slot size this segment was made with.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn flag(&self, rank: usize) -> &AtomicU64 {
        debug_assert!(rank < self.ranks);
        // SAFETY: the flags lie within the mapping (below `data_offset`), one aligned u64
        // per cache line, and are only ever accessed atomically, from every process.
        unsafe { &*(self.map.as_ptr().add(LINE * (rank + 1)) as *const AtomicU64) }
    }

    /// Rank `rank`'s slot of set `set`.
    fn slot(&self, set: usize, rank: usize) -> *mut u8 {
        let at = data_offset(self.ranks) + (set * self.ranks + rank) * slot_stride(self.slot_bytes);
        debug_assert!(at + self.slot_bytes <= self.map.len());
        // SAFETY: within the mapping (see `bytes`).
        unsafe { self.map.as_mut_ptr().add(at) }
    }

    /// Elements `range` of rank `rank`'s slot of set `set`, to read.
    ///
    /// # Safety
    /// No rank may write these elements while the slice lives (the flags order it).
    unsafe fn read<T: Element>(&self, set: usize, rank: usize, range: Range<usize>) -> &[T] {
        debug_assert!(range.end * T::BYTES <= self.slot_bytes);
        // SAFETY: within the slot, aligned (slots start on pages, slot sizes are
        // multiples of 8); the caller keeps writers away.
        unsafe {
            std::slice::from_raw_parts(
                (self.slot(set, rank) as *const T).add(range.start),
                range.len(),
            )
        }
    }

    /// Elements `range` of this rank's slot of set `set`, to write.
    ///
    /// # Safety
    /// No rank may read or write these elements while the slice lives (the flags order
    /// it).
    #[allow(clippy::mut_from_ref)]
    unsafe fn write<T: Element>(&self, set: usize, range: Range<usize>) -> &mut [T] {
        debug_assert!(range.end * T::BYTES <= self.slot_bytes);
        // SAFETY: as `read`; only this rank writes its own slot.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.slot(set, self.rank) as *mut T).add(range.start),
                range.len(),
            )
        }
    }

    /// Rank `rank`'s vote on the all-reduce it enters, in its flag's line: 0 for, 1
    /// against ([`NodeSegment::all_reduce_if`]). Written before the flag rises to the first
    /// piece's `2k + 1`, read once every flag has, and not written again before every flag
    /// reaches `2k + 2`.
    fn vote(&self, rank: usize) -> &AtomicU64 {
        debug_assert!(rank < self.ranks);
        // SAFETY: as `flag`: the word after it in the same line.
        unsafe { &*(self.map.as_ptr().add(LINE * (rank + 1) + 8) as *const AtomicU64) }
    }

    fn raise(&self, value: u64) {
        self.flag(self.rank).store(value, Ordering::Release);
    }

    /// Waits until every rank's flag counts at least `value`.
    fn wait_all(&self, transport: &dyn Transport, value: u64) -> Result<()> {
        let mut wait: Option<Wait<'_>> = None;
        let mut spins = 0u32;
        for p in 0..self.ranks {
            while self.flag(p).load(Ordering::Acquire) < value {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                    continue;
                }
                std::thread::yield_now();
                // Ranks by the numbers the whole job knows them by, in a subgroup too.
                let wait = wait.get_or_insert_with(|| {
                    Wait::new(transport.stall_watch(), transport.global_rank(self.rank))
                });
                let behind = || {
                    (0..self.ranks)
                        .filter(|&q| self.flag(q).load(Ordering::Acquire) < value)
                        .map(|q| transport.global_rank(q))
                        .collect()
                };
                if let Err(e) = wait.check(behind) {
                    return Err(transport.stalled(e));
                }
            }
        }
        Ok(())
    }

    /// Reduces chunk `own` of the piece in set `set` in rank order, a block at a time
    /// (every rank's elements of a block, then the next block, so that the partial sums
    /// stay in the cache): this rank's elements come from its buffer, the pieces of
    /// `message` from `at` on, the other ranks' from their slots. The result goes back
    /// there and to this rank's slot.
    fn reduce_own<T: Element>(
        &mut self,
        set: usize,
        own: Range<usize>,
        message: &mut [&mut [T]],
        at: pieces::Cursor,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.ranks, self.rank);
        let block = (REDUCE_BLOCK_BYTES / T::BYTES).max(1);
        let mut scratch = std::mem::take(&mut self.scratch);
        // Room for both blocks at any offset within a page, and a page between them.
        scratch.resize((2 * REDUCE_BLOCK_BYTES + 3 * PAGE) / 8, 0);
        // The partial sums lie half a page away (in address modulo a page) from the
        // slots' elements they are added to, and this rank's elements half a page from
        // them: no load of one waits for a store to another (see `copy_across`).
        let slots_at = self.slot(set, 0) as usize + own.start * T::BYTES;
        let base = scratch.as_ptr() as usize;
        let to_acc = (slots_at + PAGE / 2).wrapping_sub(base) % PAGE / 8 * 8;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..]);
        let (acc, own_block) = bytes[to_acc..].split_at_mut(REDUCE_BLOCK_BYTES + PAGE / 2);
        let acc: &mut [T] = bytemuck::cast_slice_mut(&mut acc[..REDUCE_BLOCK_BYTES]);
        let own_block: &mut [T] = bytemuck::cast_slice_mut(&mut own_block[..REDUCE_BLOCK_BYTES]);
        let mut result = Ok(());
        let (mut from, mut to) = (at, at);
        let mut at = 0;
        while at < own.len() && result.is_ok() {
            let b = block.min(own.len() - at);
            let range = own.start + at..own.start + at + b;
            let (acc, own_block) = (&mut acc[..b], &mut own_block[..b]);
            read_across(&mut from, message, own_block);
            if r == 0 {
                acc.copy_from_slice(own_block);
            } else {
                // SAFETY: rank 0 wrote this chunk of its slot before its flag reached
                // 2k + 1 and writes it again only after every flag passes 2k + 2.
                acc.copy_from_slice(unsafe { self.read::<T>(set, 0, range.clone()) });
            }
            for p in 1..n {
                let src: &[T] = if p == r {
                    own_block
                } else {
                    // SAFETY: as above, for rank p.
                    unsafe { self.read::<T>(set, p, range.clone()) }
                };
                if let Err(e) = crate::communicator::reduce_into(op, acc, src) {
                    result = Err(e);
                    break;
                }
            }
            write_across(&mut to, message, acc);
            // SAFETY: the other ranks read this chunk of this rank's slot only after its
            // flag reaches 2k + 2, and this rank alone writes it.
            unsafe { self.write::<T>(set, range) }.copy_from_slice(acc);
            at += b;
        }
        self.scratch = scratch;
        result
    }

    /// All-reduces the message `pieces` make up (see the module docs). Collective like any
    /// all-reduce: an empty message too takes the flags of one piece on every rank.
    ///
    /// # Errors
    /// A flag that does not rise within the stall timeout; a rank that entered
    /// [`NodeSegment::all_reduce_if`] and voted against meanwhile (the ranks disagree on
    /// which collective comes next).
    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        transport: &dyn Transport,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let agreed = self.all_reduce_if(transport, Some(pieces), op)?;
        self.entered_without_a_vote(agreed, "all-reduce")
    }

    /// Ok where every rank voted for the `collective` this rank entered without a vote;
    /// else the error that says the ranks disagree.
    fn entered_without_a_vote(&self, agreed: bool, collective: &str) -> Result<()> {
        if agreed {
            return Ok(());
        }
        Err(crate::Error::Transport {
            rank: self.rank,
            detail: format!(
                "another rank voted against a shared-memory {collective} that this rank \
                 entered without a vote: the ranks disagree on the collective that comes next"
            ),
        })
    }

    /// All-reduces the message `pieces` make up when every rank votes for it: `Some` (the
    /// same non-empty message on every rank that votes for it) for, `None` against. True
    /// when every rank voted for it, the sums then in the pieces; false when any voted
    /// against, and then no rank has written anything but its own slot. The votes travel
    /// with the flags of the first piece: no round of their own.
    pub(crate) fn all_reduce_if<T: Element>(
        &mut self,
        transport: &dyn Transport,
        message: Option<&mut [&mut [T]]>,
        op: ReduceOp,
    ) -> Result<bool> {
        self.reduce_pieces(transport, message, op, true)
    }

    /// The reduce-scatter half of [`NodeSegment::all_reduce`]: afterwards the elements
    /// [`NodeSegment::own_ranges`] names hold the reduction in rank order (the bits the
    /// all-reduce gives them), the others this rank's own values or partial ones.
    /// Collective.
    ///
    /// # Errors
    /// As [`NodeSegment::all_reduce`].
    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        transport: &dyn Transport,
        pieces: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        let agreed = self.reduce_pieces(transport, Some(pieces), op, false)?;
        self.entered_without_a_vote(agreed, "reduce-scatter")
    }

    /// The element ranges of a message of `len` elements of `T` that
    /// [`NodeSegment::reduce_scatter`] leaves reduced at this rank, in order: its chunk of
    /// each piece of the segment the message goes through.
    pub(crate) fn own_ranges<T: Element>(&self, len: usize) -> Vec<Range<usize>> {
        let per_piece = (self.slot_bytes / T::BYTES).max(1);
        (0..len)
            .step_by(per_piece)
            .map(|start| {
                let own = ring_chunk_range(per_piece.min(len - start), self.ranks, self.rank);
                start + own.start..start + own.end
            })
            .filter(|range| !range.is_empty())
            .collect()
    }

    /// The all-gather half of [`NodeSegment::all_reduce`]: every rank's
    /// [`NodeSegment::own_ranges`] of the message, as they are on that rank, to every
    /// other rank. Collective.
    ///
    /// # Errors
    /// A flag that does not rise within the stall timeout.
    pub(crate) fn all_gather<T: Element>(
        &mut self,
        transport: &dyn Transport,
        pieces: &mut [&mut [T]],
    ) -> Result<()> {
        let (n, r) = (self.ranks, self.rank);
        let per_piece = self.slot_bytes / T::BYTES;
        let len = pieces::total(pieces);
        let mut cursor = pieces::Cursor::default();
        let mut start = 0;
        let mut first = true;
        while first || start < len {
            first = false;
            let m = per_piece.min(len - start);
            let k = self.pieces;
            let set = (k % 2) as usize;
            // Set `set` is free: see `reduce_pieces`.
            let mut starts: SmallVec<[pieces::Cursor; 9]> = SmallVec::with_capacity(n + 1);
            let mut walk = cursor;
            for p in 0..n {
                let chunk = ring_chunk_range(m, n, p);
                starts.push(walk);
                if p == r {
                    // SAFETY: as step 1 of `reduce_pieces`.
                    let dst = unsafe { self.write::<T>(set, chunk) };
                    read_across(&mut walk, pieces, dst);
                } else {
                    walk.skip(pieces, chunk.len());
                }
            }
            self.raise(2 * k + 1);
            self.wait_all(transport, 2 * k + 1)?;
            for (p, at) in starts.iter_mut().enumerate().take(n) {
                if p != r {
                    // SAFETY: rank p wrote its chunk before its flag reached 2k + 1, and
                    // writes this set again only after every flag passes 2k + 2.
                    let src = unsafe { self.read::<T>(set, p, ring_chunk_range(m, n, p)) };
                    write_across(at, pieces, src);
                }
            }
            // Nobody waits for this rise here: the next use of this set waits for the
            // rises of the piece after it, which come later.
            self.raise(2 * k + 2);
            cursor = walk;
            self.pieces += 1;
            start += m;
        }
        Ok(())
    }

    /// [`NodeSegment::all_reduce_if`] (`gather`), or its reduce-scatter half.
    fn reduce_pieces<T: Element>(
        &mut self,
        transport: &dyn Transport,
        message: Option<&mut [&mut [T]]>,
        op: ReduceOp,
        gather: bool,
    ) -> Result<bool> {
        let (n, r) = (self.ranks, self.rank);
        let mut against: [&mut [T]; 0] = [];
        let voted_for = message.is_some();
        let pieces = message.unwrap_or(&mut against);
        let per_piece = self.slot_bytes / T::BYTES;
        let len = pieces::total(pieces);
        // Where piece k starts in the message: step 1 walks it from there, once.
        let mut cursor = pieces::Cursor::default();
        let mut start = 0;
        let mut first = true;
        while first || start < len {
            let m = per_piece.min(len - start);
            let k = self.pieces;
            let set = (k % 2) as usize;
            // Set `set` was last used by piece k - 2, which every rank has finished: every
            // rank raised 2(k - 1) + 1 after it, and this rank has seen 2(k - 1) + 2.
            let chunks: SmallVec<[Range<usize>; 8]> =
                (0..n).map(|p| ring_chunk_range(m, n, p)).collect();
            // 1. What the other ranks reduce, into this rank's slot; on the way, where each
            // chunk starts in the message (and where the piece ends), for steps 2 and 3.
            let mut starts: SmallVec<[pieces::Cursor; 9]> = SmallVec::with_capacity(n + 1);
            let mut walk = cursor;
            for (c, chunk) in chunks.iter().enumerate() {
                starts.push(walk);
                if c == r {
                    walk.skip(pieces, chunk.len());
                } else {
                    // SAFETY: set `set` of this rank's slot is read by nobody until the
                    // flag below (every rank finished piece k - 2, see above).
                    let dst = unsafe { self.write::<T>(set, chunk.clone()) };
                    read_across(&mut walk, pieces, dst);
                }
            }
            starts.push(walk);
            if first {
                self.vote(r).store(u64::from(!voted_for), Ordering::Relaxed);
            }
            self.raise(2 * k + 1);
            self.wait_all(transport, 2 * k + 1)?;
            if std::mem::take(&mut first)
                && (0..n).any(|p| self.vote(p).load(Ordering::Relaxed) != 0)
            {
                // Every rank reads the same votes; none is written again before every
                // flag reaches 2k + 2, and nothing was written but the slots.
                self.raise(2 * k + 2);
                self.wait_all(transport, 2 * k + 2)?;
                self.pieces += 1;
                return Ok(false);
            }
            // 2. This rank's chunk, reduced in rank order, into its buffer and slot.
            self.reduce_own::<T>(set, chunks[r].clone(), pieces, starts[r], op)?;
            self.raise(2 * k + 2);
            // Every rank has read the votes once every flag is here, and may write its next.
            self.wait_all(transport, 2 * k + 2)?;
            if !gather {
                cursor = starts[n];
                self.pieces += 1;
                start += m;
                continue;
            }
            // 3. The other ranks' reduced chunks out of their slots.
            for (p, chunk) in chunks.iter().enumerate() {
                if p != r {
                    // SAFETY: rank p wrote its reduced chunk before its flag reached 2k + 2,
                    // and writes this set again only after every flag passes 2k + 2.
                    let src = unsafe { self.read::<T>(set, p, chunk.clone()) };
                    write_across(&mut starts[p], pieces, src);
                }
            }
            cursor = starts[n];
            self.pieces += 1;
            start += m;
        }
        Ok(true)
    }
}

/// How far behind a store a load to an address equal to it modulo a page (a different
/// address) may come and still wait for it: a processor matches a load against earlier
/// stores by the low 12 bits of the address first ("4K aliasing").
const ALIAS_WINDOW: usize = 512;

/// Runs of at most this many bytes go through [`copy_across`]'s own loop of cache lines in
/// its AVX-512 build; longer ones through `memcpy`, which is as fast from there up.
const LINE_LOOP_BYTES: usize = 2048;

/// Copies `src` into `dst` (as long). A forward copy whose destination lies just after its
/// source modulo a page (a buffer 16 bytes past a page start copied from a slot at one,
/// which malloc's large buffers are) makes every load wait for the store just issued to
/// an address that agrees in its low 12 bits: 256 KiB out of the slots took 92-108 us on
/// the 2-core development machine, and 20 us with the slots moved by half a page. There
/// the copy runs backwards, a cache line at a time, so that no load comes after a store
/// to a higher address.
///
/// With `LINES` (the AVX-512 build of the walks over a message in pieces, see
/// [`read_across`]) a run of up to [`LINE_LOOP_BYTES`] also goes a line at a time, one
/// vector load and store each, inside the walk, with no call of `memcpy` per run. On an
/// Intel Xeon, one process, the best of 300 walks each: 1000 runs of 256 bytes took
/// 7.5-7.9 us this way against 10.7-10.8 us with `memcpy` per run, 250 runs of 1 KiB
/// 6.4-6.7 us against 7.3-8.0 us, 1000 runs of 64 bytes about the same. With AVX2's
/// half-line vectors the loop was slower than `memcpy` (15-17 us against 11-12 us in a
/// plain loop over the 1000 runs of 256 bytes), so only the AVX-512 build has it. On a
/// CPU that splits 512-bit loads and stores in two, as AMD's Zen 4 does, it is
/// unmeasured.
#[inline(always)]
fn copy_across<const LINES: bool, T: bytemuck::Pod>(dst: &mut [T], src: &[T]) {
    let (dst, src): (&mut [u8], &[u8]) = (bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    let ahead = (dst.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize) % PAGE;
    let backwards = ahead != 0 && ahead < ALIAS_WINDOW;
    let len = dst.len();
    let by_lines = backwards || (LINES && len <= LINE_LOOP_BYTES);
    if !by_lines || len < LINE {
        dst.copy_from_slice(src);
        return;
    }
    let line = |dst: &mut [u8], at: usize| {
        let line: [u8; LINE] = src[at..at + LINE].try_into().expect("a whole line");
        dst[at..at + LINE].copy_from_slice(&line);
    };
    // The lines from `first_whole` are whole lines of `dst` (a store across two lines
    // costs two); the first and the last line of the run, wherever they lie, overlap
    // them.
    let first_whole = (LINE - dst.as_ptr() as usize % LINE) % LINE;
    let whole = (first_whole..len - LINE + 1).step_by(LINE);
    // Both ends always: a branch on whether they are needed, which changes from piece to
    // piece, cost more than the line it saves (1000 runs of 256 bytes: 7.5-8.5 us walked
    // with both ends, 10.2-10.6 us with the branches).
    if backwards {
        line(dst, len - LINE);
        for at in whole.rev() {
            line(dst, at);
        }
        line(dst, 0);
    } else {
        line(dst, 0);
        for at in whole {
            line(dst, at);
        }
        line(dst, len - LINE);
    }
}

/// Whether this CPU runs the AVX-512 build of [`read_across`] and [`write_across`] (the
/// answer is cached by the standard library).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// `cursor.read(pieces, dst, ..)` with [`copy_across`], the walk and the copies compiled
/// together for AVX-512 where the CPU has it (see `LINES` there).
fn read_across<T: bytemuck::Pod>(cursor: &mut pieces::Cursor, pieces: &[&mut [T]], dst: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        #[target_feature(enable = "avx512f")]
        fn wide<T: bytemuck::Pod>(cursor: &mut pieces::Cursor, pieces: &[&mut [T]], dst: &mut [T]) {
            // A closure here inherits the target features, and inlines the copy.
            cursor.read(pieces, dst, |d, s| copy_across::<true, T>(d, s));
        }
        // SAFETY: the CPU has AVX-512 F, which `wide` is compiled for (checked just above).
        return unsafe { wide(cursor, pieces, dst) };
    }
    cursor.read(pieces, dst, copy_across::<false, T>);
}

/// `cursor.write(pieces, src, ..)` with [`copy_across`], compiled as [`read_across`] is.
fn write_across<T: bytemuck::Pod>(cursor: &mut pieces::Cursor, pieces: &mut [&mut [T]], src: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        #[target_feature(enable = "avx512f")]
        fn wide<T: bytemuck::Pod>(cursor: &mut pieces::Cursor, pieces: &mut [&mut [T]], src: &[T]) {
            cursor.write(pieces, src, |d, s| copy_across::<true, T>(d, s));
        }
        // SAFETY: the CPU has AVX-512 F, which `wide` is compiled for (checked just above).
        return unsafe { wide(cursor, pieces, src) };
    }
    cursor.write(pieces, src, copy_across::<false, T>);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, AllReduceOptions, Communicator};

    /// `input` cut into slices of `lens` (which cover it).
    fn cut<'a>(input: &'a mut [f32], lens: &[usize]) -> Vec<&'a mut [f32]> {
        let mut rest = input;
        lens.iter()
            .map(|&n| {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
                rest = tail;
                head
            })
            .collect()
    }

    /// A vote against on any one rank: every rank is told, and no message changes (one
    /// of dozens of pieces of the segment, in slices); the next vote, all for, gives the
    /// direct all-reduce's bits; and a rank that entered a plain shared-memory all-reduce
    /// meanwhile is told that the ranks disagree, after which both go on.
    #[test]
    fn a_vote_against_leaves_every_message_alone_and_the_next_reduces() {
        let lens = [3usize, 0, 250, 1, 746];
        for size in [2, 3, 4] {
            for against in 0..size {
                let outs = Communicator::run_local(size, |mut comm| -> Result<()> {
                    let r = comm.rank();
                    let input: Vec<f32> = (0..1000)
                        .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37)
                        .collect();
                    let mut direct = input.clone();
                    let sum = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
                    let opts = AllReduceOptions::sum().algorithm(Algorithm::Direct);
                    comm.all_reduce(&mut direct, &opts)?;
                    // 64-byte slots: the message goes through the segment in dozens of
                    // pieces.
                    comm.set_segment_bytes(64);
                    let mut message = input.clone();
                    let mut pieces = cut(&mut message, &lens);
                    let vote = (r != against).then_some(&mut pieces[..]);
                    let agreed = comm.shared_memory_all_reduce_if(vote, &sum)?;
                    assert!(!agreed, "rank {r}: rank {against} voted against");
                    assert_eq!(message, input, "rank {r}: a vote against writes nothing");
                    let mut pieces = cut(&mut message, &lens);
                    let agreed = comm.shared_memory_all_reduce_if(Some(&mut pieces[..]), &sum)?;
                    assert!(agreed, "rank {r}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&message), bits(&direct), "rank {r}");
                    // A plain all-reduce on `against`, a vote against everywhere else.
                    let mut plain = input.clone();
                    if r == against {
                        let shm = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
                        let err = comm.all_reduce(&mut plain, &shm).expect_err("disagree");
                        assert!(err.to_string().contains("voted against"), "{err}");
                    } else {
                        let agreed = comm.shared_memory_all_reduce_if::<f32>(None, &sum)?;
                        assert!(!agreed);
                    }
                    let mut again = input.clone();
                    comm.all_reduce(
                        &mut again,
                        &AllReduceOptions::sum().algorithm(Algorithm::SharedMemory),
                    )?;
                    assert_eq!(bits(&again), bits(&direct), "rank {r}, afterwards");
                    Ok(())
                })
                .expect("threads");
                for (r, out) in outs.into_iter().enumerate() {
                    out.unwrap_or_else(|e| panic!("{size} ranks, rank {r}: {e}"));
                }
            }
        }
    }

    /// Every placement of the destination within a page of the source (the backward path
    /// below [`ALIAS_WINDOW`], the forward one elsewhere), every length around a cache
    /// line's multiples and around [`LINE_LOOP_BYTES`], with and without the loop of
    /// lines for short runs: the destination ends as the source, and nothing past it
    /// moves.
    #[test]
    fn copy_across_copies_every_byte_in_either_direction() {
        let src: Vec<u8> = (0..3 * PAGE).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 4 * PAGE];
        let (s, d) = (src.as_ptr() as usize, dst.as_ptr() as usize);
        let mut backwards = 0;
        type Copy = fn(&mut [u8], &[u8]);
        let copies: [Copy; 2] = [copy_across::<false, u8>, copy_across::<true, u8>];
        for ahead in (0..PAGE).step_by(8).chain([1, 15, 17, 63, 65, 511, 513]) {
            // The destination's start, `ahead` bytes after the source's modulo a page.
            let at = (s + ahead).wrapping_sub(d) % PAGE;
            for len in [
                0usize,
                1,
                63,
                64,
                65,
                200,
                LINE_LOOP_BYTES,
                LINE_LOOP_BYTES + 1,
                2 * PAGE + 1,
            ] {
                for (lines, copy) in copies.iter().enumerate() {
                    dst.fill(0);
                    copy(&mut dst[at..at + len], &src[..len]);
                    assert_eq!(
                        &dst[at..at + len],
                        &src[..len],
                        "ahead {ahead}, {len} bytes, lines {lines}"
                    );
                    assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0));
                }
            }
            backwards += usize::from(ahead > 0 && ahead < ALIAS_WINDOW);
        }
        assert!(backwards > 0, "the backward path ran");
    }

    /// The walks that copy between a message in pieces and one buffer (in the build this
    /// CPU takes, the AVX-512 one where it has it) move exactly the elements from the
    /// cursor on, across runs shorter and longer than [`LINE_LOOP_BYTES`] and pieces that
    /// end within a cache line.
    #[test]
    fn the_walks_copy_a_message_in_pieces_from_any_element() {
        #[cfg(target_arch = "x86_64")]
        if !has_avx512() {
            println!("the AVX-512 build is not taken here: the portable one is tested");
        }
        let lens = [1usize, 16, 17, 64, 700, 0, 3, 513, 5];
        let total: usize = lens.iter().sum();
        let message: Vec<f32> = (0..total).map(|i| i as f32 + 0.5).collect();
        for start in [0usize, 1, 16, 100, 700] {
            let mut buffer = message.clone();
            let mut pieces = cut(&mut buffer, &lens);
            let mut out = vec![0.0f32; total - start];
            let mut cursor = pieces::Cursor::at(&pieces, start);
            read_across(&mut cursor, &pieces, &mut out);
            assert_eq!(out, message[start..], "read from {start}");
            let twice: Vec<f32> = out.iter().map(|x| 2.0 * x).collect();
            write_across(&mut pieces::Cursor::at(&pieces, start), &mut pieces, &twice);
            drop(pieces);
            assert_eq!(
                buffer[..start],
                message[..start],
                "nothing before {start} moves"
            );
            assert_eq!(buffer[start..], twice[..], "written from {start}");
        }
    }
}
