//! The CUDA backend: model buffers in GPU memory, every operation a kernel launch on one
//! stream of the backend's device.
//!
//! Without the `cuda` feature the crate has no GPU runtime and [`CudaBackend::new`] returns
//! [`Error::NotCompiledWithCuda`](crate::Error::NotCompiledWithCuda).
//!
//! With it, [`CudaBackend`] drives one GPU through ringtrain-cuda: `Buffer` is a
//! `ringtrain_cuda::GpuBuffer<f32>`, operand views become device views of their spans, and
//! each operation queues one kernel (the PTX kernels of `ptx/`: `gemm`, `lstm`, `softmax`,
//! `model_ops`) on the device's stream; a GEMM of two transposed operands queues two (a
//! transpose of the smaller one into scratch, then the product), and tall column sums two.
//! Launches are counted as the CPU backend counts them: one per operation, also when an
//! operation has no work.
//!
//! Only [`Backend::download`](crate::Backend::download), [`Backend::sum`](crate::Backend::sum)
//! and the staging of ids and targets wait for the stream. Staging uploads a pass's ids
//! (with the grouping the embedding scatter needs, in one buffer) and its labels and mask
//! into device buffers taken from a pool; they go back to the pool when the staged values
//! drop, so a training loop uploads each batch's ids once and allocates nothing per batch.
//!
//! Numerics against the CPU backend: fill, copy, embeddings, bias adds, the element-wise
//! and in-place operations are bit-identical, and so are column sums of up to 256 rows
//! (taller ones add chunks of 256 rows, then the chunks in order: deterministic, within
//! about (256 + rows/256)·2^-24·Σ|x| of the CPU's sum); sigmoid / tanh (alone and inside
//! the LSTM kernels) differ by less than 1e-6 absolute; GEMMs accumulate in f32 in another
//! order (relative differences around 1e-6 of the row norms); the softmax's log-sum-exp
//! differs by at most 2e-6·max(1, |lse|); [`Backend::sum`](crate::Backend::sum) by at most
//! (2^-24 + n·2^-52)·Σ|x| (see `ptx/model_ops.ptx`).
//!
//! `GemmPrecision::F16` / `GemmPrecision::Bf16` (mixed precision) multiply 16-bit copies of
//! the GEMM operands on tensor cores with f32 accumulation; parameters, gradients and
//! activations stay f32 (f32 master weights). Activations are cast into scratch buffers on
//! every product; weight tensors (operands inside the parameter buffer the model announces
//! with [`Backend::begin_pass`](crate::Backend::begin_pass)) are cast once per pass and
//! reused by every time step and by backward. Products whose operand strides are not
//! multiples of 8 fall back to the f32 GEMM.

#[cfg(feature = "cuda")]
pub use imp::{CudaBackend, CudaIds, CudaTargets};

#[cfg(not(feature = "cuda"))]
pub use stand_in::CudaBackend;

#[cfg(not(feature = "cuda"))]
mod stand_in {
    use crate::error::{Error, Result};

    /// Handle of the GPU backend. Without the `cuda` feature no value of it can be made:
    /// [`CudaBackend::new`] returns an error that says how to get one.
    #[derive(Debug)]
    pub struct CudaBackend {
        device: usize,
        _unconstructible: std::convert::Infallible,
    }

    impl CudaBackend {
        /// The backend on GPU `device`.
        ///
        /// # Errors
        /// [`Error::NotCompiledWithCuda`]: the crate was built without the `cuda` feature.
        pub fn new(device: usize) -> Result<CudaBackend> {
            Err(Error::NotCompiledWithCuda { device })
        }

        /// The GPU index this backend drives.
        pub fn device(&self) -> usize {
            self.device
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::cell::RefCell;
    use std::collections::hash_map::Entry;
    use std::collections::HashMap;
    use std::ops::Range;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, PoisonError};

    use half::{bf16, f16};
    use ringtrain_cuda::model_ops::{self, RowIds};
    use ringtrain_cuda::{
        fp16, gemm, lstm, softmax, DevSlice, DevSliceMut, Element, Gpu, GpuBuffer, NonFiniteFlag,
        Transpose,
    };

    use crate::backend::operands::{self, arg};
    use crate::backend::{
        invalid_view, Backend, Binary, CheckedIds, CheckedTargets, GemmPrecision, InPlace, Layout,
        LstmBackwardStep, LstmForwardStep, Staged, Unary, View, ViewMut,
    };
    use crate::error::{Error, Result};

    /// The sizes of one product as the GEMM kernels take them (see `ringtrain_cuda::gemm`).
    #[derive(Debug, Clone, Copy)]
    struct Dims {
        m: usize,
        n: usize,
        k: usize,
        lda: usize,
        ldb: usize,
        ldc: usize,
    }

    /// Scratch device memory reused between calls.
    struct Scratch {
        /// 16-bit GEMM operands in f16.
        f16: HalfOperands<f16>,
        /// 16-bit GEMM operands in bf16.
        bf16: HalfOperands<bf16>,
        /// The parameter buffer of the pass in progress (see [`Backend::begin_pass`]).
        pass: Option<PassParams>,
        /// Passes begun so far; tags the cached parameter casts.
        passes: u64,
        /// Chunk partial sums of tall column sums, grown as needed.
        column_partials: Option<GpuBuffer<f32>>,
        /// The transposed operand of a GEMM whose operands are both stored transposed.
        transposed: Option<GpuBuffer<f32>>,
        /// Set by the 16-bit casts on overflow; informational only.
        cast_flag: NonFiniteFlag,
    }

    /// Device address range of the parameters of the pass in progress.
    #[derive(Clone, Copy)]
    struct PassParams {
        start: u64,
        end: u64,
        id: u64,
    }

    /// The 16-bit copies of GEMM operands in one element type.
    ///
    /// Activations are cast into two scratch buffers (A, B). A product whose activation
    /// operand is the one a scratch buffer holds the cast of, with only products run since
    /// that cast and none of them writing over it, reads that copy instead of casting
    /// again: the output projection's dW and dH products share the logits' gradient, and
    /// an LSTM layer's dW_ih, dW_hh and dX products its gates' gradient. Every other
    /// operation of the backend forgets what the buffers hold. Parameter tensors are
    /// constant during a pass, so each (address, length) of the parameter buffer is cast
    /// once per pass into a buffer of its own, kept (with the pass id it was cast in) for
    /// the next pass to recast in place.
    struct HalfOperands<T: Element> {
        scratch: [Option<GpuBuffer<T>>; 2],
        /// The f32 operand (device address, elements) each scratch buffer holds the cast
        /// of, while that cast is current.
        holds: [Option<(u64, usize)>; 2],
        params: HashMap<(u64, usize), (u64, GpuBuffer<T>)>,
    }

    impl<T: Element> HalfOperands<T> {
        fn new() -> Self {
            HalfOperands {
                scratch: [None, None],
                holds: [None, None],
                params: HashMap::new(),
            }
        }

        /// The casts of operands in the device bytes `start..end` are out of date.
        fn forget_within(&mut self, start: u64, end: u64) {
            let elem = std::mem::size_of::<f32>() as u64;
            for held in &mut self.holds {
                if held.is_some_and(|(at, len)| at < end && start < at + len as u64 * elem) {
                    *held = None;
                }
            }
        }
    }

    impl Scratch {
        /// No scratch buffer holds a current cast any more (see [`HalfOperands`]).
        fn forget_casts(&mut self) {
            self.f16.holds = [None, None];
            self.bf16.holds = [None, None];
        }

        /// Nor one of an operand in the device bytes of `written`.
        fn forget_casts_within(&mut self, written: &DevSliceMut<'_, f32>) {
            let start = written.device_ptr();
            let end = start + (written.len() * std::mem::size_of::<f32>()) as u64;
            self.f16.forget_within(start, end);
            self.bf16.forget_within(start, end);
        }
    }

    /// A 16-bit element type of the tensor-core GEMM: its cast and its product.
    trait HalfGemm: Element {
        fn cast(
            gpu: &Gpu,
            src: &DevSlice<'_, f32>,
            dst: &mut DevSliceMut<'_, Self>,
            flag: &mut NonFiniteFlag,
        ) -> ringtrain_cuda::Result<()>;
        fn gemm(
            gpu: &Gpu,
            transpose: Transpose,
            operands: (&DevSlice<'_, Self>, &DevSlice<'_, Self>),
            c: &mut DevSliceMut<'_, f32>,
            d: Dims,
            beta: f32,
        ) -> ringtrain_cuda::Result<()>;
    }

    macro_rules! half_gemm {
        ($t:ty, $cast:path, $gemm:path) => {
            impl HalfGemm for $t {
                fn cast(
                    gpu: &Gpu,
                    src: &DevSlice<'_, f32>,
                    dst: &mut DevSliceMut<'_, $t>,
                    flag: &mut NonFiniteFlag,
                ) -> ringtrain_cuda::Result<()> {
                    $cast(gpu, src, 1.0, dst, flag)
                }
                fn gemm(
                    gpu: &Gpu,
                    transpose: Transpose,
                    (a, b): (&DevSlice<'_, $t>, &DevSlice<'_, $t>),
                    c: &mut DevSliceMut<'_, f32>,
                    d: Dims,
                    beta: f32,
                ) -> ringtrain_cuda::Result<()> {
                    $gemm(
                        gpu, transpose, a, b, c, d.m, d.n, d.k, d.lda, d.ldb, d.ldc, 1.0, beta,
                    )
                }
            }
        };
    }
    half_gemm!(f16, fp16::f32_to_f16_scaled, gemm::gemm_f16);
    half_gemm!(bf16, fp16::f32_to_bf16_scaled, gemm::gemm_bf16);

    /// Where the 16-bit copy of one operand lives.
    #[derive(Clone, Copy)]
    enum HalfSource {
        /// Scratch slot 0 (A) or 1 (B), first `len` elements.
        Scratch(usize, usize),
        /// The cached cast of the parameter tensor at this (address, length).
        Param(u64, usize),
    }

    /// Casts `src` to 16 bits into scratch buffer `slot` (0 = A, 1 = B; the other one when
    /// the product's other operand is in `slot`), unless it is a parameter tensor already
    /// cast in this pass or a scratch buffer holds its current cast; says where the copy
    /// is.
    fn half_operand<T: HalfGemm>(
        gpu: &Gpu,
        ops: &mut HalfOperands<T>,
        pass: Option<PassParams>,
        (slot, taken): (usize, Option<usize>),
        src: DevSlice<'_, f32>,
        flag: &mut NonFiniteFlag,
    ) -> Result<HalfSource> {
        let (start, len) = (src.device_ptr(), src.len());
        let end = start + (len * std::mem::size_of::<f32>()) as u64;
        if let Some(pass) = pass.filter(|p| p.start <= start && end <= p.end) {
            let (cast_in, buf) = match ops.params.entry((start, len)) {
                Entry::Occupied(found) => found.into_mut(),
                Entry::Vacant(slot) => slot.insert((0, gpu.alloc::<T>(len).map_err(Error::from)?)),
            };
            if *cast_in != pass.id {
                T::cast(gpu, &src, &mut buf.as_mut_slice(), flag).map_err(Error::from)?;
                *cast_in = pass.id;
            }
            return Ok(HalfSource::Param(start, len));
        }
        if let Some(held) = (0..2).find(|&k| ops.holds[k] == Some((start, len))) {
            return Ok(HalfSource::Scratch(held, len));
        }
        let slot = if taken == Some(slot) { 1 - slot } else { slot };
        ops.holds[slot] = None;
        let mut dst = grown(gpu, &mut ops.scratch[slot], len)?;
        T::cast(gpu, &src, &mut dst, flag).map_err(Error::from)?;
        ops.holds[slot] = Some((start, len));
        Ok(HalfSource::Scratch(slot, len))
    }

    /// The device view of a 16-bit operand placed by [`half_operand`].
    fn half_view<T: Element>(ops: &HalfOperands<T>, at: HalfSource) -> Result<DevSlice<'_, T>> {
        let missing = |len| Error::OutOfBounds {
            what: "16-bit GEMM operand",
            end: len,
            len: 0,
        };
        match at {
            HalfSource::Scratch(slot, len) => ops.scratch[slot]
                .as_ref()
                .ok_or(missing(len))?
                .slice(0..len)
                .map_err(Error::from),
            HalfSource::Param(start, len) => Ok(ops
                .params
                .get(&(start, len))
                .ok_or(missing(len))?
                .1
                .as_slice()),
        }
    }

    /// The 16-bit product: operands cast (or taken from this pass's parameter casts), then
    /// the tensor-core GEMM.
    #[allow(clippy::too_many_arguments)]
    fn gemm_half_in<T: HalfGemm>(
        gpu: &Gpu,
        ops: &mut HalfOperands<T>,
        pass: Option<PassParams>,
        flag: &mut NonFiniteFlag,
        transpose: Transpose,
        (a, b): (DevSlice<'_, f32>, DevSlice<'_, f32>),
        c: &mut DevSliceMut<'_, f32>,
        d: Dims,
        beta: f32,
    ) -> Result<()> {
        let at_a = half_operand(gpu, ops, pass, (0, None), a, flag)?;
        let taken = match at_a {
            HalfSource::Scratch(slot, _) => Some(slot),
            HalfSource::Param(..) => None,
        };
        let at_b = half_operand(gpu, ops, pass, (1, taken), b, flag)?;
        let (ha, hb) = (half_view(ops, at_a)?, half_view(ops, at_b)?);
        T::gemm(gpu, transpose, (&ha, &hb), c, d, beta).map_err(Error::from)
    }

    /// Device buffers lent to staged ids and targets; each comes back when the staged value
    /// that holds it drops (see [`CudaIds`], [`CudaTargets`]).
    struct Pool<T: Element>(Arc<Mutex<Vec<GpuBuffer<T>>>>);

    impl<T: Element> Clone for Pool<T> {
        fn clone(&self) -> Self {
            Pool(Arc::clone(&self.0))
        }
    }

    impl<T: Element> Pool<T> {
        fn new() -> Self {
            Pool(Arc::new(Mutex::new(Vec::new())))
        }

        /// The smallest pooled buffer of at least `len` elements; else the largest one
        /// (the caller grows it), or `None` when the pool is empty.
        fn take(&self, len: usize) -> Option<GpuBuffer<T>> {
            let mut bufs = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let fitting = (0..bufs.len())
                .filter(|&i| bufs[i].len() >= len)
                .min_by_key(|&i| bufs[i].len());
            let pick = fitting.or_else(|| (0..bufs.len()).max_by_key(|&i| bufs[i].len()));
            pick.map(|i| bufs.swap_remove(i))
        }

        /// A buffer of at least `len` elements: pooled, or allocated to the next power of
        /// two.
        fn take_at_least(&self, gpu: &Gpu, len: usize) -> Result<GpuBuffer<T>> {
            match self.take(len) {
                Some(buf) if buf.len() >= len => Ok(buf),
                too_small => {
                    drop(too_small); // free it first
                    gpu.alloc::<T>(crate::memory::scratch_capacity(len))
                        .map_err(Error::from)
                }
            }
        }

        fn give(&self, buf: GpuBuffer<T>) {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(buf);
        }
    }

    /// Token ids staged on the GPU ([`Backend::stage_ids`]): a `ringtrain_cuda`
    /// [`RowIds`] (the checked ids and the grouping the scatter launches with, in one
    /// pooled device buffer that returns to the backend's pool on drop).
    pub struct CudaIds {
        ids: Option<RowIds>,
        rows: usize,
        bound: usize,
        pool: Pool<u32>,
    }

    impl std::fmt::Debug for CudaIds {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaIds")
                .field("rows", &self.rows)
                .field("bound", &self.bound)
                .finish()
        }
    }

    impl CudaIds {
        /// The device ids.
        ///
        /// # Errors
        /// Never in practice: the ids are released only when the value drops.
        pub fn row_ids(&self) -> Result<&RowIds> {
            self.ids
                .as_ref()
                .ok_or_else(|| invalid_view("ids", "released", "stage the ids again"))
        }
    }

    impl Staged for CudaIds {
        fn rows(&self) -> usize {
            self.rows
        }
        fn bound(&self) -> usize {
            self.bound
        }
    }

    impl Drop for CudaIds {
        fn drop(&mut self) {
            if let Some(ids) = self.ids.take() {
                self.pool.give(ids.into_storage());
            }
        }
    }

    /// Softmax targets staged on the GPU ([`Backend::stage_targets`]): labels and mask in
    /// pooled device buffers that return to the backend's pools on drop.
    pub struct CudaTargets {
        labels: Option<GpuBuffer<u32>>,
        mask: Option<GpuBuffer<f32>>,
        rows: usize,
        vocab: usize,
        words: Pool<u32>,
        floats: Pool<f32>,
    }

    impl std::fmt::Debug for CudaTargets {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaTargets")
                .field("rows", &self.rows)
                .field("vocab", &self.vocab)
                .finish()
        }
    }

    impl CudaTargets {
        /// Device views of the labels and the mask of rows `rows`.
        fn device(&self, rows: Range<usize>) -> Result<(DevSlice<'_, u32>, DevSlice<'_, f32>)> {
            let released = || invalid_view("softmax targets", "released", "stage them again");
            let labels = self.labels.as_ref().ok_or_else(released)?;
            let mask = self.mask.as_ref().ok_or_else(released)?;
            Ok((labels.slice(rows.clone())?, mask.slice(rows)?))
        }
    }

    impl Staged for CudaTargets {
        fn rows(&self) -> usize {
            self.rows
        }
        fn bound(&self) -> usize {
            self.vocab
        }
    }

    impl Drop for CudaTargets {
        fn drop(&mut self) {
            if let Some(labels) = self.labels.take() {
                self.words.give(labels);
            }
            if let Some(mask) = self.mask.take() {
                self.floats.give(mask);
            }
        }
    }

    /// CUDA backend on one GPU (see the module docs).
    pub struct CudaBackend {
        gpu: Gpu,
        precision: GemmPrecision,
        launches: AtomicU64,
        scratch: RefCell<Scratch>,
        /// u32 buffers for staged ids and labels.
        words: Pool<u32>,
        /// f32 buffers for staged masks.
        floats: Pool<f32>,
    }

    impl std::fmt::Debug for CudaBackend {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaBackend")
                .field("device", &self.gpu.ordinal())
                .field("name", &self.gpu.name())
                .field("precision", &self.precision)
                .field("launches", &self.launches())
                .finish()
        }
    }

    /// The device view of `range` of `buf`.
    fn dev(buf: &GpuBuffer<f32>, range: Range<usize>) -> Result<DevSlice<'_, f32>> {
        buf.slice(range).map_err(Error::from)
    }

    /// The mutable device view of `range` of `buf`.
    fn dev_mut(buf: &mut GpuBuffer<f32>, range: Range<usize>) -> Result<DevSliceMut<'_, f32>> {
        buf.slice_mut(range).map_err(Error::from)
    }

    /// Views of `read` and (mutable) `write`, two disjoint ranges of `buf`.
    fn read_write(
        buf: &mut GpuBuffer<f32>,
        read: Range<usize>,
        write: Range<usize>,
    ) -> Result<(DevSliceMut<'_, f32>, DevSliceMut<'_, f32>)> {
        let read_first = read.start < write.start;
        let (lo, hi) = if read_first {
            (&read, &write)
        } else {
            (&write, &read)
        };
        let (_, rest) = buf.as_mut_slice().split_at_mut(lo.start)?;
        let (first, second) = rest.split_at_mut(hi.start - lo.start)?;
        let (first, _) = first.split_at_mut(lo.len())?;
        let (second, _) = second.split_at_mut(hi.len())?;
        Ok(if read_first {
            (first, second)
        } else {
            (second, first)
        })
    }

    impl CudaBackend {
        /// The backend on GPU `device` with f32 GEMMs.
        ///
        /// # Errors
        /// A GPU error when the device does not exist or cannot be initialised.
        pub fn new(device: usize) -> Result<CudaBackend> {
            CudaBackend::with_precision(device, GemmPrecision::F32)
        }

        /// The backend on GPU `device` with GEMM operands in `precision`.
        ///
        /// # Errors
        /// A GPU error when the device does not exist or cannot be initialised.
        pub fn with_precision(device: usize, precision: GemmPrecision) -> Result<CudaBackend> {
            let count = Gpu::device_count().map_err(Error::from)?;
            if device >= count {
                return Err(Error::InvalidValue {
                    name: "device",
                    value: device.to_string(),
                    reason: format!(
                        "this machine has {count} CUDA device(s), numbered from 0; pick one below {count} \
                         (one rank per GPU: the local rank picks it)"
                    ),
                });
            }
            let gpu = Gpu::new(device).map_err(Error::from)?;
            for module in [
                &gemm::MODULE,
                &lstm::MODULE,
                &softmax::MODULE,
                &model_ops::MODULE,
                &fp16::MODULE,
            ] {
                gpu.load(module).map_err(Error::from)?;
            }
            let scratch = Scratch {
                f16: HalfOperands::new(),
                bf16: HalfOperands::new(),
                pass: None,
                passes: 0,
                column_partials: None,
                transposed: None,
                cast_flag: NonFiniteFlag::new(&gpu).map_err(Error::from)?,
            };
            Ok(CudaBackend {
                gpu,
                precision,
                launches: AtomicU64::new(0),
                scratch: RefCell::new(scratch),
                words: Pool::new(),
                floats: Pool::new(),
            })
        }

        /// Number of CUDA devices visible to this process (for picking `local_rank % count`).
        ///
        /// # Errors
        /// A GPU error when the driver cannot be initialised.
        pub fn device_count() -> Result<usize> {
            Gpu::device_count().map_err(Error::from)
        }

        /// The GPU index this backend drives.
        pub fn device(&self) -> usize {
            self.gpu.ordinal()
        }

        /// The GPU runtime handle (context, stream, module cache).
        pub fn gpu(&self) -> &Gpu {
            &self.gpu
        }

        /// Element type of the GEMM operands.
        pub fn precision(&self) -> GemmPrecision {
            self.precision
        }

        /// Waits until every queued operation has finished (for timing).
        ///
        /// # Errors
        /// A GPU error from an earlier launch or the synchronization itself.
        pub fn synchronize(&self) -> Result<()> {
            self.gpu.synchronize().map_err(Error::from)
        }

        /// Counts an operation; one that is not a matrix product may write any buffer, so
        /// no 16-bit cast of an operand stays current (see [`HalfOperands`]).
        fn launched(&self) {
            self.launches.fetch_add(1, Ordering::Relaxed);
            self.forget_casts();
        }

        fn forget_casts(&self) {
            self.scratch.borrow_mut().forget_casts();
        }

        /// `host` in a pooled device buffer (at least as long; synchronizes).
        fn upload_pooled<T: Element>(&self, pool: &Pool<T>, host: &[T]) -> Result<GpuBuffer<T>> {
            let mut buf = pool.take_at_least(&self.gpu, host.len())?;
            if let Err(e) = self
                .gpu
                .copy_from_host(host, &mut buf.slice_mut(0..host.len())?)
            {
                pool.give(buf);
                return Err(e.into());
            }
            Ok(buf)
        }

        /// The product on checked device operands: the 16-bit GEMM when the precision and
        /// the strides allow it, else the f32 one.
        fn gemm_on(
            &self,
            transpose: Transpose,
            (a, b): (DevSlice<'_, f32>, DevSlice<'_, f32>),
            c: &mut DevSliceMut<'_, f32>,
            d: Dims,
            beta: f32,
        ) -> Result<()> {
            if self.precision != GemmPrecision::F32
                && self.gemm_half(transpose, (a, b), c, d, beta)?
            {
                return Ok(());
            }
            gemm::gemm_f32(
                &self.gpu, transpose, &a, &b, c, d.m, d.n, d.k, d.lda, d.ldb, d.ldc, 1.0, beta,
            )
            .map_err(Error::from)
        }

        /// The product of two operands that are both stored transposed (no kernel takes
        /// them as they are): the smaller one is copied, transposed, into scratch, and the
        /// product runs on the copy (`NT` or `TN`). The copy moves elements only, so the
        /// result is what a `TT` kernel would compute.
        fn gemm_both_transposed(
            &self,
            (a, b): (DevSlice<'_, f32>, DevSlice<'_, f32>),
            c: &mut DevSliceMut<'_, f32>,
            d: Dims,
            beta: f32,
        ) -> Result<()> {
            // The transposed copy is rewritten where an earlier one lay.
            self.forget_casts();
            let mut slot = self.scratch.borrow_mut().transposed.take();
            let result = if d.m <= d.n {
                // A is stored [k, m]: its transpose is op(A), a dense [m, k].
                grown(&self.gpu, &mut slot, d.m * d.k).and_then(|mut t| {
                    model_ops::transpose(&self.gpu, &a, &mut t, d.k, d.m, d.lda)?;
                    let d = Dims { lda: d.k, ..d };
                    self.gemm_on(Transpose::NT, (t.as_slice(), b), c, d, beta)
                })
            } else {
                // B is stored [n, k]: its transpose is op(B), a dense [k, n].
                grown(&self.gpu, &mut slot, d.k * d.n).and_then(|mut t| {
                    model_ops::transpose(&self.gpu, &b, &mut t, d.n, d.k, d.ldb)?;
                    let d = Dims { ldb: d.n, ..d };
                    self.gemm_on(Transpose::TN, (a, t.as_slice()), c, d, beta)
                })
            };
            self.scratch.borrow_mut().transposed = slot;
            result
        }

        /// The 16-bit GEMM (see [`HalfOperands`]). Returns `false` (nothing queued) when
        /// the strides do not allow it.
        fn gemm_half(
            &self,
            transpose: Transpose,
            operands: (DevSlice<'_, f32>, DevSlice<'_, f32>),
            c: &mut DevSliceMut<'_, f32>,
            d: Dims,
            beta: f32,
        ) -> Result<bool> {
            if !d.lda.is_multiple_of(8) || !d.ldb.is_multiple_of(8) || d.k == 0 {
                return Ok(false);
            }
            let mut scratch = self.scratch.borrow_mut();
            let scratch = &mut *scratch;
            let (pass, flag) = (scratch.pass, &mut scratch.cast_flag);
            match self.precision {
                GemmPrecision::F16 => gemm_half_in(
                    &self.gpu,
                    &mut scratch.f16,
                    pass,
                    flag,
                    transpose,
                    operands,
                    c,
                    d,
                    beta,
                )?,
                GemmPrecision::Bf16 => gemm_half_in(
                    &self.gpu,
                    &mut scratch.bf16,
                    pass,
                    flag,
                    transpose,
                    operands,
                    c,
                    d,
                    beta,
                )?,
                GemmPrecision::F32 => return Ok(false),
            }
            Ok(true)
        }
    }

    /// The first `len` elements of `slot`, reallocated (to the next power of two) when
    /// it holds fewer. Buffers start 256-byte aligned, as the tensor-core GEMM needs.
    fn grown<'a, T: Element>(
        gpu: &Gpu,
        slot: &'a mut Option<GpuBuffer<T>>,
        len: usize,
    ) -> Result<DevSliceMut<'a, T>> {
        if slot.as_ref().is_none_or(|buf| buf.len() < len) {
            *slot = None; // free the old one first
            *slot = Some(
                gpu.alloc::<T>(crate::memory::scratch_capacity(len))
                    .map_err(Error::from)?,
            );
        }
        match slot {
            Some(buf) => buf.slice_mut(0..len).map_err(Error::from),
            None => Err(Error::OutOfBounds {
                what: "GEMM operand scratch",
                end: len,
                len: 0,
            }),
        }
    }

    impl Backend for CudaBackend {
        type Buffer = GpuBuffer<f32>;
        type Ids = CudaIds;
        type Targets = CudaTargets;

        fn name(&self) -> &'static str {
            "cuda"
        }

        fn zeros(&self, len: usize) -> Result<GpuBuffer<f32>> {
            // (it may reuse a freed operand's address)
            self.forget_casts();
            self.gpu.zeros(len).map_err(Error::from)
        }

        fn len(&self, buf: &GpuBuffer<f32>) -> usize {
            buf.len()
        }

        fn upload(&self, src: &[f32], dst: &mut GpuBuffer<f32>, offset: usize) -> Result<()> {
            let r = Layout::contiguous(offset, src.len()).check(dst.len(), "upload destination")?;
            self.forget_casts();
            self.gpu
                .copy_from_host(src, &mut dev_mut(dst, r)?)
                .map_err(Error::from)
        }

        fn download(&self, src: &GpuBuffer<f32>, offset: usize, dst: &mut [f32]) -> Result<()> {
            let r = Layout::contiguous(offset, dst.len()).check(src.len(), "download source")?;
            self.gpu
                .copy_to_host(&dev(src, r)?, dst)
                .map_err(Error::from)
        }

        fn launches(&self) -> u64 {
            self.launches.load(Ordering::Relaxed)
        }

        fn begin_pass(&self, params: &GpuBuffer<f32>) {
            let mut scratch = self.scratch.borrow_mut();
            scratch.forget_casts();
            scratch.passes += 1;
            let start = params.device_ptr();
            scratch.pass = Some(PassParams {
                start,
                end: start + (params.len() * std::mem::size_of::<f32>()) as u64,
                id: scratch.passes,
            });
        }

        fn end_pass(&self) {
            let mut scratch = self.scratch.borrow_mut();
            scratch.forget_casts();
            scratch.pass = None;
        }

        fn stage_ids(&self, ids: CheckedIds<'_>) -> Result<CudaIds> {
            // (a staged buffer may take a freed operand's address)
            self.forget_casts();
            let storage = match self.words.take(4 * ids.ids().len() + 1) {
                Some(buf) => buf,
                None => self.gpu.alloc::<u32>(0)?,
            };
            let staged = RowIds::stage(&self.gpu, ids.ids(), ids.bound(), storage)?;
            Ok(CudaIds {
                rows: staged.rows(),
                bound: staged.bound(),
                ids: Some(staged),
                pool: self.words.clone(),
            })
        }

        fn stage_targets(&self, targets: CheckedTargets<'_>) -> Result<CudaTargets> {
            self.forget_casts();
            let rows = targets.labels().len();
            let mut staged = CudaTargets {
                labels: None,
                mask: None,
                rows,
                vocab: targets.vocab(),
                words: self.words.clone(),
                floats: self.floats.clone(),
            };
            if rows > 0 {
                staged.labels = Some(self.upload_pooled(&self.words, targets.labels())?);
                staged.mask = Some(self.upload_pooled(&self.floats, targets.mask())?);
            }
            Ok(staged)
        }

        fn fill(&self, dst: ViewMut<'_, GpuBuffer<f32>>, value: f32) -> Result<()> {
            let [r] = operands::elementwise([arg(self, "fill destination", &dst)])?;
            self.launched();
            model_ops::fill(&self.gpu, &mut dev_mut(dst.buf, r)?, value).map_err(Error::from)
        }

        fn copy(
            &self,
            src: View<'_, GpuBuffer<f32>>,
            dst: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let [rs, rd] = operands::elementwise([
                arg(self, "copy source", &src),
                arg(self, "copy destination", &dst),
            ])?;
            self.launched();
            self.gpu
                .copy(&dev(src.buf, rs)?, &mut dev_mut(dst.buf, rd)?)
                .map_err(Error::from)
        }

        fn gemm(
            &self,
            a: View<'_, GpuBuffer<f32>>,
            b: View<'_, GpuBuffer<f32>>,
            c: ViewMut<'_, GpuBuffer<f32>>,
            accumulate: bool,
        ) -> Result<()> {
            let g = operands::gemm(
                arg(self, "gemm A", &a),
                arg(self, "gemm B", &b),
                arg(self, "gemm C", &c),
            )?;
            // Not `launched`: a product keeps the casts of the products before it current,
            // except those of what it writes.
            self.launches.fetch_add(1, Ordering::Relaxed);
            if g.m == 0 || g.n == 0 {
                return Ok(());
            }
            let beta = if accumulate { 1.0 } else { 0.0 };
            // A column-major C was turned around (Cᵀ = Bᵀ·Aᵀ): so are the buffers.
            let (a_buf, b_buf) = if g.swapped {
                (b.buf, a.buf)
            } else {
                (a.buf, b.buf)
            };
            let operands = (dev(a_buf, g.a.range)?, dev(b_buf, g.b.range)?);
            let mut c = dev_mut(c.buf, g.c.range)?;
            let d = Dims {
                m: g.m,
                n: g.n,
                k: g.k,
                lda: g.a.ld,
                ldb: g.b.ld,
                ldc: g.c.ld,
            };
            let transpose = match (g.a.trans, g.b.trans) {
                (false, false) => Some(Transpose::NN),
                (false, true) => Some(Transpose::NT),
                (true, false) => Some(Transpose::TN),
                (true, true) => None,
            };
            let result = match transpose {
                Some(transpose) => self.gemm_on(transpose, operands, &mut c, d, beta),
                None => self.gemm_both_transposed(operands, &mut c, d, beta),
            };
            self.scratch.borrow_mut().forget_casts_within(&c);
            result
        }

        fn gather_rows(
            &self,
            table: View<'_, GpuBuffer<f32>>,
            ids: &CudaIds,
            dst: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let ([d, t], width) = operands::rows_by_id(
                ids,
                arg(self, "gather destination", &dst),
                arg(self, "gather table", &table),
            )?;
            self.launched();
            model_ops::gather_rows(
                &self.gpu,
                &dev(table.buf, t)?,
                ids.row_ids()?,
                &mut dev_mut(dst.buf, d)?,
                table.layout.rows(),
                width,
            )
            .map_err(Error::from)
        }

        fn scatter_add_rows(
            &self,
            src: View<'_, GpuBuffer<f32>>,
            ids: &CudaIds,
            table: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let ([s, t], width) = operands::rows_by_id(
                ids,
                arg(self, "scatter source", &src),
                arg(self, "scatter table", &table),
            )?;
            self.launched();
            let table_rows = table.layout.rows();
            model_ops::scatter_add_rows(
                &self.gpu,
                &dev(src.buf, s)?,
                ids.row_ids()?,
                &mut dev_mut(table.buf, t)?,
                table_rows,
                width,
            )
            .map_err(Error::from)
        }

        fn column_sums(
            &self,
            src: View<'_, GpuBuffer<f32>>,
            dst: ViewMut<'_, GpuBuffer<f32>>,
            accumulate: bool,
        ) -> Result<()> {
            let [s, d] = operands::matrix_and_row(
                arg(self, "column_sums source", &src),
                arg(self, "column_sums destination", &dst),
            )?;
            self.launched();
            let (rows, cols) = src.layout.shape();
            let mut scratch = self.scratch.borrow_mut();
            let mut partials = grown(
                &self.gpu,
                &mut scratch.column_partials,
                model_ops::column_sums_scratch_len(rows, cols).max(1),
            )?;
            model_ops::column_sums_chunked(
                &self.gpu,
                &dev(src.buf, s)?,
                &mut dev_mut(dst.buf, d)?,
                rows,
                cols,
                accumulate,
                &mut partials,
            )
            .map_err(Error::from)
        }

        fn add_row_bias(
            &self,
            bias: View<'_, GpuBuffer<f32>>,
            dst: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let [d, b] = operands::matrix_and_row(
                arg(self, "bias destination", &dst),
                arg(self, "bias", &bias),
            )?;
            self.launched();
            let (rows, cols) = dst.layout.shape();
            model_ops::add_row_bias(
                &self.gpu,
                &dev(bias.buf, b)?,
                &mut dev_mut(dst.buf, d)?,
                rows,
                cols,
            )
            .map_err(Error::from)
        }

        fn unary(
            &self,
            op: Unary,
            x: View<'_, GpuBuffer<f32>>,
            dst: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let [rx, rd] = operands::elementwise([
                arg(self, "unary input", &x),
                arg(self, "unary output", &dst),
            ])?;
            self.launched();
            let (x, mut dst) = (dev(x.buf, rx)?, dev_mut(dst.buf, rd)?);
            match op {
                Unary::Sigmoid => model_ops::unary_sigmoid(&self.gpu, &x, &mut dst),
                Unary::Tanh => model_ops::unary_tanh(&self.gpu, &x, &mut dst),
            }
            .map_err(Error::from)
        }

        fn binary(
            &self,
            op: Binary,
            a: View<'_, GpuBuffer<f32>>,
            b: View<'_, GpuBuffer<f32>>,
            dst: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let [ra, rb, rd] = operands::elementwise([
                arg(self, "binary input a", &a),
                arg(self, "binary input b", &b),
                arg(self, "binary output", &dst),
            ])?;
            self.launched();
            let (a, b, mut dst) = (dev(a.buf, ra)?, dev(b.buf, rb)?, dev_mut(dst.buf, rd)?);
            match op {
                Binary::Add => model_ops::binary_add(&self.gpu, &a, &b, &mut dst),
                Binary::Mul => model_ops::binary_mul(&self.gpu, &a, &b, &mut dst),
            }
            .map_err(Error::from)
        }

        fn in_place(
            &self,
            op: InPlace,
            x: View<'_, GpuBuffer<f32>>,
            dst: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let [rx, rd] = operands::elementwise([
                arg(self, "in-place input", &x),
                arg(self, "in-place output", &dst),
            ])?;
            self.launched();
            let (x, mut dst) = (dev(x.buf, rx)?, dev_mut(dst.buf, rd)?);
            match op {
                InPlace::Add => model_ops::in_place_add(&self.gpu, &x, &mut dst),
                InPlace::MulSigmoidGrad => {
                    model_ops::in_place_mul_sigmoid_grad(&self.gpu, &x, &mut dst)
                }
                InPlace::MulTanhGrad => model_ops::in_place_mul_tanh_grad(&self.gpu, &x, &mut dst),
            }
            .map_err(Error::from)
        }

        fn lstm_forward_step(&self, s: LstmForwardStep<'_, GpuBuffer<f32>>) -> Result<()> {
            let r = operands::lstm_forward(self, &s)?;
            self.launched();
            let (c_prev, mut c) = read_write(s.cells, r.c_prev, r.c)?;
            // The kernel reads block `step` of an input projection of `steps` blocks: this
            // step's block is the only one.
            lstm::lstm_pointwise_forward_step(
                &self.gpu,
                &dev(s.input_proj.buf, r.input_proj)?,
                &dev(s.recurrent.buf, r.recurrent)?,
                &dev(s.bias.buf, r.bias)?,
                &c_prev.as_slice(),
                &mut c,
                &mut dev_mut(s.h.buf, r.h)?,
                &mut dev_mut(s.act.buf, r.act)?,
                0,
                1,
                r.batch,
                r.hidden,
            )
            .map_err(Error::from)
        }

        fn lstm_backward_step(&self, s: LstmBackwardStep<'_, GpuBuffer<f32>>) -> Result<()> {
            let r = operands::lstm_backward(self, &s)?;
            self.launched();
            lstm::lstm_pointwise_backward(
                &self.gpu,
                &dev(s.act.buf, r.act)?,
                &dev(s.c_prev.buf, r.c_prev)?,
                &dev(s.c.buf, r.c)?,
                &dev(s.dh.buf, r.dh)?,
                &dev(s.dc.buf, r.dc)?,
                &mut dev_mut(s.dgates.buf, r.dgates)?,
                &mut dev_mut(s.dc_prev.buf, r.dc_prev)?,
                r.batch,
                r.hidden,
            )
            .map_err(Error::from)
        }

        fn softmax_xent_forward(
            &self,
            logits: View<'_, GpuBuffer<f32>>,
            targets: &CudaTargets,
            first_row: usize,
            loss: ViewMut<'_, GpuBuffer<f32>>,
            lse: ViewMut<'_, GpuBuffer<f32>>,
        ) -> Result<()> {
            let operands::SoftmaxRanges {
                logits: l,
                per_row: [lo, ls],
                targets: t,
                rows,
                vocab,
            } = operands::softmax(
                arg(self, "softmax logits", &logits),
                targets,
                first_row,
                [
                    arg(self, "softmax loss", &loss),
                    arg(self, "softmax lse", &lse),
                ],
            )?;
            self.launched();
            if rows == 0 {
                return Ok(());
            }
            let (labels, mask) = targets.device(t)?;
            softmax::softmax_xent_forward(
                &self.gpu,
                &dev(logits.buf, l)?,
                &labels,
                &mask,
                &mut dev_mut(loss.buf, lo)?,
                &mut dev_mut(lse.buf, ls)?,
                rows,
                vocab,
            )
            .map_err(Error::from)
        }

        fn softmax_xent_backward(
            &self,
            logits: ViewMut<'_, GpuBuffer<f32>>,
            lse: View<'_, GpuBuffer<f32>>,
            targets: &CudaTargets,
            first_row: usize,
            scale: f32,
        ) -> Result<()> {
            let operands::SoftmaxRanges {
                logits: l,
                per_row: [ls],
                targets: t,
                rows,
                vocab,
            } = operands::softmax(
                arg(self, "softmax logits", &logits),
                targets,
                first_row,
                [arg(self, "softmax lse", &lse)],
            )?;
            self.launched();
            if rows == 0 {
                return Ok(());
            }
            let (labels, mask) = targets.device(t)?;
            softmax::softmax_xent_backward(
                &self.gpu,
                &mut dev_mut(logits.buf, l)?,
                &dev(lse.buf, ls)?,
                &labels,
                &mask,
                scale,
                rows,
                vocab,
            )
            .map_err(Error::from)
        }

        fn sum(&self, src: View<'_, GpuBuffer<f32>>) -> Result<f64> {
            let [r] = operands::elementwise([arg(self, "sum source", &src)])?;
            self.launched();
            if r.is_empty() {
                return Ok(0.0);
            }
            model_ops::sum(&self.gpu, &dev(src.buf, r)?).map_err(Error::from)
        }
    }
}
