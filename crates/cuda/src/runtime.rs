//! The launch layer: one [`Gpu`] per device index, holding the device's context and
//! streams (`context.rs`) and the cache of loaded modules, and launching kernels with
//! [`LaunchConfig`] and [`KernelArg`]s. It sits on the memory layer (`memory.rs`,
//! `pinned.rs`), whose operations `Gpu` offers as methods ([`Gpu::alloc`],
//! [`Gpu::pinned`], ...); nothing below it knows about it.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cust::module::Module;
use cust::sys as cuda;

use crate::context::{check, device_count, driver, DeviceContext};
use crate::error::{Error, Result};
use crate::memory::{AsDevSlice, AsDevSliceMut, DevSlice, DevSliceMut, Element, GpuBuffer};
use crate::pinned::PinnedBuffer;
use crate::signature::{Param, PtxModule};

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes (the ringtrain kernels use static shared memory only).
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `grid` blocks of `block` threads.
    pub fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig {
            grid: (grid.max(1), 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// Threads per block of the element-wise, grid-stride kernels.
pub(crate) const GRID_STRIDE_BLOCK: u32 = 256;

/// One kernel argument, matching a [`Param`] kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device address (`.u64`).
    Ptr(u64),
    /// A 32-bit unsigned value (`.u32`).
    U32(u32),
    /// A 32-bit float (`.f32`).
    F32(f32),
}

impl KernelArg {
    /// The parameter kind this argument fills.
    pub fn kind(&self) -> Param {
        match self {
            KernelArg::Ptr(_) => Param::Ptr,
            KernelArg::U32(_) => Param::U32,
            KernelArg::F32(_) => Param::F32,
        }
    }

    fn as_launch_ptr(&self) -> *mut c_void {
        match self {
            KernelArg::Ptr(v) => v as *const u64 as *mut c_void,
            KernelArg::U32(v) => v as *const u32 as *mut c_void,
            KernelArg::F32(v) => v as *const f32 as *mut c_void,
        }
    }
}

/// A CUfunction handle. It stays valid while its module is loaded, and the
/// module lives in the same cache entry.
#[derive(Clone, Copy)]
struct RawFunction(cuda::CUfunction);

// SAFETY: a CUfunction is an opaque driver handle; the driver allows using it
// from any thread once its context is current.
unsafe impl Send for RawFunction {}
// SAFETY: see the Send impl; the handle is never mutated.
unsafe impl Sync for RawFunction {}

struct LoadedModule {
    functions: HashMap<&'static str, RawFunction>,
    // Keeps the functions' module loaded; dropped after `functions`.
    _module: Module,
}

struct GpuInner {
    // Field order is drop order: the modules go before the context they live in.
    modules: Mutex<HashMap<&'static str, Arc<LoadedModule>>>,
    device: DeviceContext,
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        // Module unloads act on the current context.
        let _ = self.device.bind();
        if let Ok(mut modules) = self.modules.lock() {
            modules.clear();
        }
    }
}

/// One GPU: its primary context, a compute stream, a copy stream, and the loaded PTX modules.
///
/// * **Context**: the driver's per-device state (memory, loaded code). A `Gpu`
///   holds the device's primary context and makes it current on whichever thread
///   uses the `Gpu`, so it can be shared across threads.
/// * **Stream**: an in-order queue of device work. Every launch and copy made
///   through this `Gpu` is queued on its one stream, so they run in call order;
///   the host waits only in [`Gpu::synchronize`] and the copies back to the host.
/// * **Copy stream**: a second queue, for copies into pinned host memory
///   ([`PinnedBuffer::download_async`](crate::PinnedBuffer::download_async)) that run
///   while later kernels compute; each is ordered after the compute stream's work by
///   an event.
/// * **Module**: a PTX file loaded into the context (the driver compiles it for
///   the device at load time). Each `ptx/*.ptx` file is loaded once per context,
///   on its first launch, and cached.
///
/// `Gpu::new(i)` returns the same shared `Gpu` (same context, stream and cache)
/// each time it is called with the same index. Cloning is cheap.
///
/// ```no_run
/// use ringtrain_cuda::{optim, Gpu};
/// # fn main() -> ringtrain_cuda::Result<()> {
/// let gpu = Gpu::new(0)?;
/// let mut buf = gpu.upload(&[1.0f32, 2.0, 3.0])?;
/// optim::scale_f32(&gpu, &mut buf, 0.5)?;
/// assert_eq!(buf.to_host()?, vec![0.5, 1.0, 1.5]);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<GpuInner>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name())
            .field("multiprocessors", &self.multiprocessors())
            .finish()
    }
}

fn registry() -> &'static Mutex<HashMap<usize, Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Gpu>>> = OnceLock::new();
    GPUS.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Gpu {
    /// Number of CUDA devices visible to this process.
    pub fn device_count() -> Result<usize> {
        device_count()
    }

    /// The shared `Gpu` for device `ordinal` (created on first use).
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let mut gpus = registry()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(gpu) = gpus.get(&ordinal) {
            gpu.bind()?;
            return Ok(gpu.clone());
        }
        let gpu = Gpu {
            inner: Arc::new(GpuInner {
                modules: Mutex::new(HashMap::new()),
                device: DeviceContext::new(ordinal)?,
            }),
        };
        gpus.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    /// The device's context and streams, for the layers below this one.
    pub(crate) fn device(&self) -> &DeviceContext {
        &self.inner.device
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.inner.device.bind()
    }

    /// Free and total memory of the device in bytes, as the driver reports them now.
    ///
    /// # Errors
    /// A driver error.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cust::memory::mem_get_info().map_err(driver("reading free device memory"))
    }

    /// The device index.
    pub fn ordinal(&self) -> usize {
        self.inner.device.ordinal()
    }

    /// The device name reported by the driver.
    pub fn name(&self) -> &str {
        self.inner.device.name()
    }

    /// Number of streaming multiprocessors (used to size grid-stride launches).
    pub fn multiprocessors(&self) -> u32 {
        self.inner.device.multiprocessors()
    }

    /// The raw stream handle, for interop with other CUDA code.
    pub fn raw_stream(&self) -> cuda::CUstream {
        self.inner.device.stream().as_inner()
    }

    /// Waits until all work queued on this GPU's compute stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.device.synchronize()
    }

    /// Waits until all work queued on both of this GPU's streams has finished.
    pub fn synchronize_all(&self) -> Result<()> {
        self.inner.device.synchronize_all()
    }

    /// Grid size for a grid-stride loop over `work` items with `block` threads:
    /// enough blocks to cover the work, at most 32 per multiprocessor.
    pub fn grid_for(&self, work: usize, block: u32) -> u32 {
        let blocks = work.div_ceil(block as usize).max(1);
        let cap = self.multiprocessors() as usize * 32;
        blocks.min(cap) as u32
    }

    /// A 1-D grid-stride launch over `work` items with [`GRID_STRIDE_BLOCK`] threads per
    /// block and [`Gpu::grid_for`] blocks.
    pub(crate) fn grid_stride(&self, work: usize) -> LaunchConfig {
        LaunchConfig::linear(self.grid_for(work, GRID_STRIDE_BLOCK), GRID_STRIDE_BLOCK)
    }

    /// Number of modules loaded into this context so far.
    pub fn loaded_modules(&self) -> usize {
        self.inner.modules.lock().map(|m| m.len()).unwrap_or(0)
    }

    fn loaded(&self, module: &PtxModule) -> Result<Arc<LoadedModule>> {
        let mut modules = self.inner.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = modules.get(module.name) {
            return Ok(found.clone());
        }
        let loaded = Module::from_ptx(module.text, &[]).map_err(driver("loading a PTX module"))?;
        let mut functions = HashMap::new();
        for kernel in module.kernels {
            let function = loaded
                .get_function(kernel.name)
                .map_err(driver("looking up a kernel in its module"))?;
            functions.insert(kernel.name, RawFunction(function.to_raw()));
        }
        let entry = Arc::new(LoadedModule {
            functions,
            _module: loaded,
        });
        modules.insert(module.name, entry.clone());
        Ok(entry)
    }

    /// Loads `module` into this context now (launches do it on first use).
    pub fn load(&self, module: &PtxModule) -> Result<()> {
        self.bind()?;
        self.loaded(module).map(|_| ())
    }

    /// Launches `kernel` of `module` on this GPU's stream.
    ///
    /// The arguments are checked against the kernel's declared signature
    /// (count and kinds) before anything is queued.
    ///
    /// # Safety
    ///
    /// The kernel reads and writes device memory through the pointer arguments.
    /// The caller must pass pointers to live allocations of this context that
    /// are large enough for the sizes passed with them, and must not let host
    /// code free or reuse them while the kernel may run. The typed launchers in
    /// this crate guarantee that by taking checked device slices.
    pub unsafe fn launch(
        &self,
        module: &PtxModule,
        kernel: &str,
        config: LaunchConfig,
        args: &[KernelArg],
    ) -> Result<()> {
        let signature = module.kernel(kernel)?;
        if signature.params.len() != args.len() {
            return Err(Error::SignatureMismatch {
                kernel: kernel.to_string(),
                reason: format!(
                    "declared with {} parameters, launched with {} arguments",
                    signature.params.len(),
                    args.len()
                ),
            });
        }
        for (i, (param, arg)) in signature.params.iter().zip(args).enumerate() {
            if *param != arg.kind() {
                return Err(Error::SignatureMismatch {
                    kernel: kernel.to_string(),
                    reason: format!(
                        "parameter {i} is declared {:?} but the argument is {:?}",
                        param, arg
                    ),
                });
            }
        }
        self.bind()?;
        let loaded = self.loaded(module)?;
        let function = loaded
            .functions
            .get(signature.name)
            .copied()
            .ok_or_else(|| Error::UnknownKernel {
                module: module.name,
                kernel: kernel.to_string(),
            })?;
        let mut pointers: Vec<*mut c_void> = args.iter().map(KernelArg::as_launch_ptr).collect();
        let (gx, gy, gz) = config.grid;
        let (bx, by, bz) = config.block;
        // SAFETY: `function` belongs to a module loaded in this context (kept
        // alive by `loaded`); `pointers` holds one pointer per declared
        // parameter, each to a value of the declared size that outlives this
        // call (the driver copies them before returning). Memory safety of the
        // pointed-to device buffers is the caller's obligation (see above).
        let result = unsafe {
            cuda::cuLaunchKernel(
                function.0,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                config.shared_bytes,
                self.raw_stream(),
                pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(result, "launching a kernel")?;
        crate::launches::count_launch();
        Ok(())
    }

    /// A kernel argument for a device slice, checking it lives on this GPU.
    pub(crate) fn arg<T: Element>(
        &self,
        name: &'static str,
        slice: &DevSlice<'_, T>,
    ) -> Result<KernelArg> {
        self.inner.device.check_device(name, slice.device())?;
        Ok(KernelArg::Ptr(slice.device_ptr()))
    }

    /// A kernel argument for a mutable device slice, checking it lives on this GPU.
    pub(crate) fn arg_mut<T: Element>(
        &self,
        name: &'static str,
        slice: &DevSliceMut<'_, T>,
    ) -> Result<KernelArg> {
        self.inner.device.check_device(name, slice.device())?;
        Ok(KernelArg::Ptr(slice.device_ptr()))
    }
}

/// Memory on this GPU: the memory layer's operations (`memory.rs`, `pinned.rs`), all
/// queued on the compute stream unless said otherwise.
impl Gpu {
    /// Allocates `len` elements; the contents are unspecified.
    pub fn alloc<T: Element>(&self, len: usize) -> Result<GpuBuffer<T>> {
        self.inner.device.alloc(len)
    }

    /// Allocates `len` elements set to all-zero bits.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<GpuBuffer<T>> {
        self.inner.device.zeros(len)
    }

    /// Allocates a buffer holding a copy of `host`.
    pub fn upload<T: Element>(&self, host: &[T]) -> Result<GpuBuffer<T>> {
        self.inner.device.upload(host)
    }

    /// Queues a device-to-device copy of `src` into `dst` (same length).
    pub fn copy<T: Element>(
        &self,
        src: &impl AsDevSlice<T>,
        dst: &mut impl AsDevSliceMut<T>,
    ) -> Result<()> {
        self.inner.device.copy(src, dst)
    }

    /// Copies the device view `src` into `host` (same length), after the work queued so
    /// far on the stream; returns when the copy is done. Views let a part of a buffer
    /// (one gradient tensor of a flat buffer) travel without a staging copy.
    pub fn copy_to_host<T: Element>(&self, src: &impl AsDevSlice<T>, host: &mut [T]) -> Result<()> {
        self.inner.device.copy_to_host(src, host)
    }

    /// Copies `host` into the device view `dst` (same length), after the work queued so
    /// far on the stream; returns when the copy is done.
    pub fn copy_from_host<T: Element>(
        &self,
        host: &[T],
        dst: &mut impl AsDevSliceMut<T>,
    ) -> Result<()> {
        self.inner.device.copy_from_host(host, dst)
    }

    /// Allocates `len` zeroed elements of page-locked host memory for copies with this GPU.
    ///
    /// # Errors
    /// [`Error::TooLarge`] if the byte size overflows; a driver error if the memory
    /// cannot be locked (the limit is the host's RAM and `ulimit -l`).
    pub fn pinned<T: Element>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        self.inner.device.pinned(len)
    }
}
