//! The CUDA backend: model buffers in GPU memory, every operation a kernel launch on one
//! stream of the backend's device.
//!
//! Without the `cuda` feature the crate has no GPU runtime and [`CudaBackend::new`] returns
//! [`Error::NotCompiledWithCuda`](crate::Error::NotCompiledWithCuda).
//!
//! With it, [`CudaBackend`] drives one GPU through ringtrain-cuda: `Buffer` is a
//! `ringtrain_cuda::GpuBuffer<f32>`, operands are views at element offsets, and each
//! operation queues one kernel (the PTX kernels of `ptx/`: `gemm`, `lstm`, `softmax`,
//! `model_ops`) on the device's stream. Only [`Backend::download`](crate::Backend::download), [`Backend::sum`](crate::Backend::sum) and the
//! per-call uploads of ids, labels and masks wait for the stream. Launches are counted as
//! the CPU backend counts them: one per operation, also when an operation has no work.
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
//! reused by every time step and by backward. Products whose row strides are not multiples
//! of 8 fall back to the f32 GEMM.

#[cfg(feature = "cuda")]
pub use imp::{CudaBackend, GemmPrecision};

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

    use half::{bf16, f16};
    use ringtrain_cuda::model_ops;
    use ringtrain_cuda::{
        fp16, gemm, lstm, softmax, DevSlice, DevSliceMut, Element, Gpu, GpuBuffer, NonFiniteFlag,
        Transpose,
    };

    use crate::backend::{
        check_add_row_bias, check_binary, check_column_sums, check_gather_rows, check_gemm,
        check_in_place, check_lstm_backward_step, check_lstm_forward_step, check_scatter_add_rows,
        check_softmax_xent_backward, check_softmax_xent_forward, check_two_slots, check_unary,
        span, Backend, Binary, Gemm, InPlace, LstmStep, Unary,
    };
    use crate::error::{Error, Result};

    /// Element type of the GEMM operands.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum GemmPrecision {
        /// f32 operands, f32 SIMT GEMM (`gemm_f32_*`).
        #[default]
        F32,
        /// Operands rounded to f16, tensor-core GEMM with f32 accumulation.
        F16,
        /// Operands rounded to bf16, tensor-core GEMM with f32 accumulation.
        Bf16,
    }

    /// Scratch device memory reused between calls.
    struct Scratch {
        /// u32 buffers (ids, labels, scatter segments) by exact length.
        words: HashMap<usize, Vec<GpuBuffer<u32>>>,
        /// f32 buffers (masks) by exact length.
        floats: HashMap<usize, Vec<GpuBuffer<f32>>>,
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
    /// Activations are cast into two scratch buffers (A, B) on every product. Parameter
    /// tensors are constant during a pass, so each (address, length) of the parameter buffer
    /// is cast once per pass into a buffer of its own, kept (with the pass id it was cast
    /// in) for the next pass to recast in place.
    struct HalfOperands<T: Element> {
        scratch: [Option<GpuBuffer<T>>; 2],
        params: HashMap<(u64, usize), (u64, GpuBuffer<T>)>,
    }

    impl<T: Element> HalfOperands<T> {
        fn new() -> Self {
            HalfOperands {
                scratch: [None, None],
                params: HashMap::new(),
            }
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
        #[allow(clippy::too_many_arguments)]
        fn gemm(
            gpu: &Gpu,
            transpose: Transpose,
            a: &DevSlice<'_, Self>,
            b: &DevSlice<'_, Self>,
            c: &mut DevSliceMut<'_, f32>,
            g: &Gemm,
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
                    a: &DevSlice<'_, $t>,
                    b: &DevSlice<'_, $t>,
                    c: &mut DevSliceMut<'_, f32>,
                    g: &Gemm,
                    beta: f32,
                ) -> ringtrain_cuda::Result<()> {
                    $gemm(
                        gpu, transpose, a, b, c, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, 1.0, beta,
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

    /// Casts `src` (operand `slot`: 0 = A, 1 = B) to 16 bits, unless it is a parameter
    /// tensor already cast in this pass; says where the copy is.
    fn half_operand<T: HalfGemm>(
        gpu: &Gpu,
        ops: &mut HalfOperands<T>,
        pass: Option<PassParams>,
        slot: usize,
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
        let mut dst = grown(gpu, &mut ops.scratch[slot], len)?;
        T::cast(gpu, &src, &mut dst, flag).map_err(Error::from)?;
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
        a: DevSlice<'_, f32>,
        b: DevSlice<'_, f32>,
        c: &mut DevSliceMut<'_, f32>,
        g: &Gemm,
        beta: f32,
    ) -> Result<()> {
        let at_a = half_operand(gpu, ops, pass, 0, a, flag)?;
        let at_b = half_operand(gpu, ops, pass, 1, b, flag)?;
        let (ha, hb) = (half_view(ops, at_a)?, half_view(ops, at_b)?);
        T::gemm(gpu, transpose, &ha, &hb, c, g, beta).map_err(Error::from)
    }

    /// Takes a cached buffer of exactly `len` elements from `pool`, or allocates one.
    fn take<T: Element>(
        gpu: &Gpu,
        pool: &mut HashMap<usize, Vec<GpuBuffer<T>>>,
        len: usize,
    ) -> Result<GpuBuffer<T>> {
        match pool.get_mut(&len).and_then(Vec::pop) {
            Some(buf) => Ok(buf),
            None => gpu.alloc::<T>(len).map_err(Error::from),
        }
    }

    fn give<T: Element>(pool: &mut HashMap<usize, Vec<GpuBuffer<T>>>, buf: GpuBuffer<T>) {
        pool.entry(buf.len()).or_default().push(buf);
    }

    /// CUDA backend on one GPU (see the module docs).
    pub struct CudaBackend {
        gpu: Gpu,
        precision: GemmPrecision,
        launches: AtomicU64,
        scratch: RefCell<Scratch>,
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

    fn view<'a>(buf: &'a GpuBuffer<f32>, r: Range<usize>) -> Result<DevSlice<'a, f32>> {
        buf.slice(r).map_err(Error::from)
    }

    fn view_mut<'a>(buf: &'a mut GpuBuffer<f32>, r: Range<usize>) -> Result<DevSliceMut<'a, f32>> {
        buf.slice_mut(r).map_err(Error::from)
    }

    /// Read view of slot `read` and write view of slot `write` of a `[slots, len]` buffer.
    fn two_slots<'a>(
        buf: &'a mut GpuBuffer<f32>,
        read: usize,
        write: usize,
        len: usize,
        what: &'static str,
    ) -> Result<(DevSliceMut<'a, f32>, DevSliceMut<'a, f32>)> {
        check_two_slots(buf.len(), read, write, len, what)?;
        let lo = read.min(write) * len;
        let whole = buf.as_mut_slice();
        let (_, rest) = whole.split_at_mut(lo).map_err(Error::from)?;
        let gap = read.max(write) * len - lo;
        let (first, second) = rest.split_at_mut(gap).map_err(Error::from)?;
        let (first, _) = first.split_at_mut(len).map_err(Error::from)?;
        let (second, _) = second.split_at_mut(len).map_err(Error::from)?;
        Ok(if read < write {
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
                return Err(Error::InvalidConfig {
                    field: "device",
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
                words: HashMap::new(),
                floats: HashMap::new(),
                f16: HalfOperands::new(),
                bf16: HalfOperands::new(),
                pass: None,
                passes: 0,
                column_partials: None,
                cast_flag: NonFiniteFlag::new(&gpu).map_err(Error::from)?,
            };
            Ok(CudaBackend {
                gpu,
                precision,
                launches: AtomicU64::new(0),
                scratch: RefCell::new(scratch),
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

        fn launched(&self) {
            self.launches.fetch_add(1, Ordering::Relaxed);
        }

        /// Uploads `host` into a cached u32 buffer of its length (synchronizes).
        fn upload_words(&self, host: &[u32]) -> Result<GpuBuffer<u32>> {
            let mut scratch = self.scratch.borrow_mut();
            let mut buf = take(&self.gpu, &mut scratch.words, host.len())?;
            buf.copy_from_host(host).map_err(Error::from)?;
            Ok(buf)
        }

        /// Uploads `host` into a cached f32 buffer of its length (synchronizes).
        fn upload_floats(&self, host: &[f32]) -> Result<GpuBuffer<f32>> {
            let mut scratch = self.scratch.borrow_mut();
            let mut buf = take(&self.gpu, &mut scratch.floats, host.len())?;
            buf.copy_from_host(host).map_err(Error::from)?;
            Ok(buf)
        }

        fn return_words(&self, buf: GpuBuffer<u32>) {
            give(&mut self.scratch.borrow_mut().words, buf);
        }

        fn return_floats(&self, buf: GpuBuffer<f32>) {
            give(&mut self.scratch.borrow_mut().floats, buf);
        }

        /// Runs `f` with labels and mask on the device.
        fn with_labels<R>(
            &self,
            labels: &[u32],
            mask: &[f32],
            rows: usize,
            f: impl FnOnce(&GpuBuffer<u32>, &GpuBuffer<f32>) -> Result<R>,
        ) -> Result<R> {
            if labels.len() != rows || mask.len() != rows {
                return Err(Error::OutOfBounds {
                    what: "softmax labels / mask (one per row)",
                    end: labels.len().max(mask.len()),
                    len: rows,
                });
            }
            let labels_dev = self.upload_words(labels)?;
            let mask_dev = self.upload_floats(mask)?;
            let result = f(&labels_dev, &mask_dev);
            self.return_words(labels_dev);
            self.return_floats(mask_dev);
            result
        }

        /// The 16-bit GEMM (see [`HalfOperands`]). Returns `false` (nothing queued) when
        /// the strides do not allow it.
        #[allow(clippy::too_many_arguments)]
        fn gemm_half(
            &self,
            transpose: Transpose,
            a: DevSlice<'_, f32>,
            b: DevSlice<'_, f32>,
            c: &mut DevSliceMut<'_, f32>,
            g: &Gemm,
            beta: f32,
        ) -> Result<bool> {
            if g.lda % 8 != 0 || g.ldb % 8 != 0 || g.k == 0 {
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
                    a,
                    b,
                    c,
                    g,
                    beta,
                )?,
                GemmPrecision::Bf16 => gemm_half_in(
                    &self.gpu,
                    &mut scratch.bf16,
                    pass,
                    flag,
                    transpose,
                    a,
                    b,
                    c,
                    g,
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
                gpu.alloc::<T>(len.next_power_of_two())
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

        fn name(&self) -> &'static str {
            "cuda"
        }

        fn zeros(&self, len: usize) -> Result<GpuBuffer<f32>> {
            self.gpu.zeros(len).map_err(Error::from)
        }

        fn len(&self, buf: &GpuBuffer<f32>) -> usize {
            buf.len()
        }

        fn upload(&self, src: &[f32], dst: &mut GpuBuffer<f32>, offset: usize) -> Result<()> {
            let r = span("upload destination", offset, src.len(), dst.len())?;
            self.gpu
                .copy_from_host(src, &mut view_mut(dst, r)?)
                .map_err(Error::from)
        }

        fn download(&self, src: &GpuBuffer<f32>, offset: usize, dst: &mut [f32]) -> Result<()> {
            let r = span("download source", offset, dst.len(), src.len())?;
            self.gpu
                .copy_to_host(&view(src, r)?, dst)
                .map_err(Error::from)
        }

        fn launches(&self) -> u64 {
            self.launches.load(Ordering::Relaxed)
        }

        fn begin_pass(&self, params: &GpuBuffer<f32>) {
            let mut scratch = self.scratch.borrow_mut();
            scratch.passes += 1;
            let start = params.device_ptr();
            scratch.pass = Some(PassParams {
                start,
                end: start + (params.len() * std::mem::size_of::<f32>()) as u64,
                id: scratch.passes,
            });
        }

        fn end_pass(&self) {
            self.scratch.borrow_mut().pass = None;
        }

        fn fill(
            &self,
            dst: &mut GpuBuffer<f32>,
            offset: usize,
            len: usize,
            value: f32,
        ) -> Result<()> {
            let r = span("fill destination", offset, len, dst.len())?;
            self.launched();
            model_ops::fill(&self.gpu, &mut view_mut(dst, r)?, value).map_err(Error::from)
        }

        fn copy(
            &self,
            src: &GpuBuffer<f32>,
            src_offset: usize,
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
            len: usize,
        ) -> Result<()> {
            let rs = span("copy source", src_offset, len, src.len())?;
            let rd = span("copy destination", dst_offset, len, dst.len())?;
            self.launched();
            self.gpu
                .copy(&view(src, rs)?, &mut view_mut(dst, rd)?)
                .map_err(Error::from)
        }

        fn gemm(
            &self,
            a: &GpuBuffer<f32>,
            b: &GpuBuffer<f32>,
            c: &mut GpuBuffer<f32>,
            g: &Gemm,
        ) -> Result<()> {
            let [ra, rb, rc] = check_gemm(g, a.len(), b.len(), c.len())?;
            let transpose = match (g.trans_a, g.trans_b) {
                (false, false) => Transpose::NN,
                (false, true) => Transpose::NT,
                (true, false) => Transpose::TN,
                (true, true) => {
                    return Err(Error::InvalidConfig {
                        field: "gemm",
                        value: "trans_a and trans_b".into(),
                        reason: "the GPU GEMM has nn, nt and tn kernels; compute (B·A)ᵀ with one \
                                 transposed operand instead"
                            .into(),
                    })
                }
            };
            self.launched();
            if g.m == 0 || g.n == 0 {
                return Ok(());
            }
            let beta = if g.accumulate { 1.0 } else { 0.0 };
            let (a, b) = (view(a, ra)?, view(b, rb)?);
            let mut c = view_mut(c, rc)?;
            if self.precision != GemmPrecision::F32
                && self.gemm_half(transpose, a, b, &mut c, g, beta)?
            {
                return Ok(());
            }
            gemm::gemm_f32(
                &self.gpu, transpose, &a, &b, &mut c, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, 1.0, beta,
            )
            .map_err(Error::from)
        }

        fn gather_rows(
            &self,
            table: &GpuBuffer<f32>,
            table_offset: usize,
            table_rows: usize,
            width: usize,
            ids: &[u32],
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
        ) -> Result<()> {
            let [t, d] = check_gather_rows(
                table.len(),
                table_offset,
                table_rows,
                width,
                ids,
                dst.len(),
                dst_offset,
            )?;
            self.launched();
            if ids.is_empty() {
                return Ok(());
            }
            model_ops::gather_rows(
                &self.gpu,
                &view(table, t)?,
                ids,
                &mut view_mut(dst, d)?,
                table_rows,
                width,
            )
            .map_err(Error::from)
        }

        fn scatter_add_rows(
            &self,
            src: &GpuBuffer<f32>,
            src_offset: usize,
            ids: &[u32],
            width: usize,
            table: &mut GpuBuffer<f32>,
            table_offset: usize,
            table_rows: usize,
        ) -> Result<()> {
            let [s, t] = check_scatter_add_rows(
                src.len(),
                src_offset,
                ids,
                width,
                table.len(),
                table_offset,
                table_rows,
            )?;
            self.launched();
            if ids.is_empty() || width == 0 {
                return Ok(());
            }
            model_ops::scatter_add_rows(
                &self.gpu,
                &view(src, s)?,
                ids,
                &mut view_mut(table, t)?,
                table_rows,
                width,
            )
            .map_err(Error::from)
        }

        fn column_sums(
            &self,
            src: &GpuBuffer<f32>,
            src_offset: usize,
            rows: usize,
            cols: usize,
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
            accumulate: bool,
        ) -> Result<()> {
            let [s, d] =
                check_column_sums(src.len(), src_offset, rows, cols, dst.len(), dst_offset)?;
            self.launched();
            let mut scratch = self.scratch.borrow_mut();
            let mut partials = grown(
                &self.gpu,
                &mut scratch.column_partials,
                model_ops::column_sums_scratch_len(rows, cols).max(1),
            )?;
            model_ops::column_sums_chunked(
                &self.gpu,
                &view(src, s)?,
                &mut view_mut(dst, d)?,
                rows,
                cols,
                accumulate,
                &mut partials,
            )
            .map_err(Error::from)
        }

        fn add_row_bias(
            &self,
            bias: &GpuBuffer<f32>,
            bias_offset: usize,
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
            rows: usize,
            cols: usize,
        ) -> Result<()> {
            let [b, d] =
                check_add_row_bias(bias.len(), bias_offset, dst.len(), dst_offset, rows, cols)?;
            self.launched();
            model_ops::add_row_bias(
                &self.gpu,
                &view(bias, b)?,
                &mut view_mut(dst, d)?,
                rows,
                cols,
            )
            .map_err(Error::from)
        }

        fn unary(
            &self,
            op: Unary,
            x: &GpuBuffer<f32>,
            x_offset: usize,
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
            len: usize,
        ) -> Result<()> {
            let [rx, rd] = check_unary(x.len(), x_offset, dst.len(), dst_offset, len)?;
            self.launched();
            let (x, mut dst) = (view(x, rx)?, view_mut(dst, rd)?);
            match op {
                Unary::Sigmoid => model_ops::unary_sigmoid(&self.gpu, &x, &mut dst),
                Unary::Tanh => model_ops::unary_tanh(&self.gpu, &x, &mut dst),
            }
            .map_err(Error::from)
        }

        fn binary(
            &self,
            op: Binary,
            a: &GpuBuffer<f32>,
            a_offset: usize,
            b: &GpuBuffer<f32>,
            b_offset: usize,
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
            len: usize,
        ) -> Result<()> {
            let [ra, rb, rd] = check_binary(
                a.len(),
                a_offset,
                b.len(),
                b_offset,
                dst.len(),
                dst_offset,
                len,
            )?;
            self.launched();
            let (a, b, mut dst) = (view(a, ra)?, view(b, rb)?, view_mut(dst, rd)?);
            match op {
                Binary::Add => model_ops::binary_add(&self.gpu, &a, &b, &mut dst),
                Binary::Mul => model_ops::binary_mul(&self.gpu, &a, &b, &mut dst),
            }
            .map_err(Error::from)
        }

        fn in_place(
            &self,
            op: InPlace,
            x: &GpuBuffer<f32>,
            x_offset: usize,
            dst: &mut GpuBuffer<f32>,
            dst_offset: usize,
            len: usize,
        ) -> Result<()> {
            let [rx, rd] = check_in_place(x.len(), x_offset, dst.len(), dst_offset, len)?;
            self.launched();
            let (x, mut dst) = (view(x, rx)?, view_mut(dst, rd)?);
            match op {
                InPlace::Add => model_ops::in_place_add(&self.gpu, &x, &mut dst),
                InPlace::MulSigmoidGrad => {
                    model_ops::in_place_mul_sigmoid_grad(&self.gpu, &x, &mut dst)
                }
                InPlace::MulTanhGrad => model_ops::in_place_mul_tanh_grad(&self.gpu, &x, &mut dst),
            }
            .map_err(Error::from)
        }

        fn lstm_forward_step(
            &self,
            input_proj: &GpuBuffer<f32>,
            recurrent: &GpuBuffer<f32>,
            bias: &GpuBuffer<f32>,
            bias_offset: usize,
            cells: &mut GpuBuffer<f32>,
            hiddens: &mut GpuBuffer<f32>,
            act: &mut GpuBuffer<f32>,
            at: &LstmStep,
        ) -> Result<()> {
            let spans = check_lstm_forward_step(
                at,
                input_proj.len(),
                recurrent.len(),
                bias.len(),
                bias_offset,
                cells.len(),
                hiddens.len(),
                act.len(),
            )?;
            let bh = at.batch * at.hidden;
            let (c_prev, mut c) =
                two_slots(cells, at.prev_slot, at.out_slot, bh, "lstm cell slots")?;
            self.launched();
            lstm::lstm_pointwise_forward_step(
                &self.gpu,
                &view(input_proj, spans.input_proj)?,
                &view(recurrent, spans.recurrent)?,
                &view(bias, spans.bias)?,
                &c_prev,
                &mut c,
                &mut view_mut(hiddens, spans.hidden)?,
                &mut view_mut(act, spans.act)?,
                at.step,
                at.steps,
                at.batch,
                at.hidden,
            )
            .map_err(Error::from)
        }

        fn lstm_backward_step(
            &self,
            act: &GpuBuffer<f32>,
            cells: &GpuBuffer<f32>,
            dh: &GpuBuffer<f32>,
            dc: &GpuBuffer<f32>,
            dgates: &mut GpuBuffer<f32>,
            dc_prev: &mut GpuBuffer<f32>,
            at: &LstmStep,
        ) -> Result<()> {
            let s = check_lstm_backward_step(
                at,
                act.len(),
                cells.len(),
                dh.len(),
                dc.len(),
                dgates.len(),
                dc_prev.len(),
            )?;
            self.launched();
            lstm::lstm_pointwise_backward(
                &self.gpu,
                &view(act, s.act)?,
                &view(cells, s.c_prev)?,
                &view(cells, s.c)?,
                &view(dh, s.dh)?,
                &view(dc, s.dc)?,
                &mut view_mut(dgates, s.dgates)?,
                &mut view_mut(dc_prev, s.dc_prev)?,
                at.batch,
                at.hidden,
            )
            .map_err(Error::from)
        }

        fn softmax_xent_forward(
            &self,
            logits: &GpuBuffer<f32>,
            labels: &[u32],
            mask: &[f32],
            loss: &mut GpuBuffer<f32>,
            lse: &mut GpuBuffer<f32>,
            rows: usize,
            vocab: usize,
        ) -> Result<()> {
            let [l, lo, ls] =
                check_softmax_xent_forward(rows, vocab, logits.len(), loss.len(), lse.len())?;
            self.launched();
            if rows == 0 {
                return Ok(());
            }
            self.with_labels(labels, mask, rows, |labels, mask| {
                softmax::softmax_xent_forward(
                    &self.gpu,
                    &view(logits, l)?,
                    labels,
                    mask,
                    &mut view_mut(loss, lo)?,
                    &mut view_mut(lse, ls)?,
                    rows,
                    vocab,
                )
                .map_err(Error::from)
            })
        }

        fn softmax_xent_backward(
            &self,
            logits: &mut GpuBuffer<f32>,
            lse: &GpuBuffer<f32>,
            labels: &[u32],
            mask: &[f32],
            scale: f32,
            rows: usize,
            vocab: usize,
        ) -> Result<()> {
            let [l, ls] = check_softmax_xent_backward(rows, vocab, logits.len(), lse.len())?;
            self.launched();
            if rows == 0 {
                return Ok(());
            }
            self.with_labels(labels, mask, rows, |labels, mask| {
                softmax::softmax_xent_backward(
                    &self.gpu,
                    &mut view_mut(logits, l)?,
                    &view(lse, ls)?,
                    labels,
                    mask,
                    scale,
                    rows,
                    vocab,
                )
                .map_err(Error::from)
            })
        }

        fn sum(&self, src: &GpuBuffer<f32>, offset: usize, len: usize) -> Result<f64> {
            let r = span("sum source", offset, len, src.len())?;
            self.launched();
            if len == 0 {
                return Ok(0.0);
            }
            model_ops::sum(&self.gpu, &view(src, r)?).map_err(Error::from)
        }
    }
}
