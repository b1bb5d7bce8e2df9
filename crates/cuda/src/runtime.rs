//! The device runtime: one [`Gpu`] per device index, holding the CUDA context,
//! the stream every launch and copy goes to, and the cache of loaded modules.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cust::context::{Context, CurrentContext};
use cust::device::{Device, DeviceAttribute};
use cust::error::CudaError;
use cust::module::Module;
use cust::stream::{Stream, StreamFlags};
use cust::sys as cuda;

use crate::error::{Error, Result};
use crate::memory::{DevSlice, DevSliceMut, Element};
use crate::signature::{Param, PtxModule};

/// Wraps a driver error with what was being done.
pub(crate) fn driver(during: &'static str) -> impl FnOnce(CudaError) -> Error {
    move |source| Error::Driver { during, source }
}

/// Turns a raw driver result into the crate's error.
pub(crate) fn check(result: cuda::CUresult, during: &'static str) -> Result<()> {
    if result == cuda::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName stores a pointer to a static string (or leaves null).
    let found = unsafe { cuda::cuGetErrorName(result, &mut name) };
    let name = if found == cuda::CUresult::CUDA_SUCCESS && !name.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        "unknown error".to_string()
    };
    Err(Error::DriverCall {
        during,
        code: result as u32,
        name,
    })
}

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
    ordinal: usize,
    name: String,
    multiprocessors: u32,
    // Field order is drop order: modules and stream go before the context.
    modules: Mutex<HashMap<&'static str, Arc<LoadedModule>>>,
    stream: Stream,
    copy_stream: Stream,
    context: Context,
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        // Module unloads and stream destruction act on the current context.
        let _ = CurrentContext::set_current(&self.context);
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
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("multiprocessors", &self.inner.multiprocessors)
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
        cust::init(cust::CudaFlags::empty()).map_err(driver("initializing the CUDA driver"))?;
        let n = Device::num_devices().map_err(driver("counting CUDA devices"))?;
        Ok(n as usize)
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
        let count = Gpu::device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidArgument {
                arg: "ordinal",
                value: ordinal.to_string(),
                reason: if count == 0 {
                    "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
                } else {
                    "there is no device with this index (indices run from 0 to the device count - 1)"
                },
            });
        }
        let index = u32::try_from(ordinal).map_err(|_| Error::TooLarge {
            arg: "ordinal",
            value: ordinal,
            limit: u32::MAX as usize,
        })?;
        let device = Device::get_device(index).map_err(driver("opening the device"))?;
        let context = Context::new(device).map_err(driver("creating the primary context"))?;
        CurrentContext::set_current(&context).map_err(driver("making the context current"))?;
        let name = device.name().map_err(driver("reading the device name"))?;
        let sms = device
            .get_attribute(DeviceAttribute::MultiprocessorCount)
            .map_err(driver("reading the multiprocessor count"))?;
        // A blocking stream: it also orders against the legacy default stream.
        let stream =
            Stream::new(StreamFlags::DEFAULT, None).map_err(driver("creating the stream"))?;
        let copy_stream =
            Stream::new(StreamFlags::DEFAULT, None).map_err(driver("creating the copy stream"))?;
        let gpu = Gpu {
            inner: Arc::new(GpuInner {
                ordinal,
                name,
                multiprocessors: sms.max(1) as u32,
                modules: Mutex::new(HashMap::new()),
                stream,
                copy_stream,
                context,
            }),
        };
        gpus.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        CurrentContext::set_current(&self.inner.context)
            .map_err(driver("making the context current"))
    }

    /// The device index.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device name reported by the driver.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Number of streaming multiprocessors (used to size grid-stride launches).
    pub fn multiprocessors(&self) -> u32 {
        self.inner.multiprocessors
    }

    /// The raw stream handle, for interop with other CUDA code.
    pub fn raw_stream(&self) -> cuda::CUstream {
        self.inner.stream.as_inner()
    }

    pub(crate) fn stream(&self) -> &Stream {
        &self.inner.stream
    }

    pub(crate) fn copy_stream(&self) -> &Stream {
        &self.inner.copy_stream
    }

    /// Waits until all work queued on this GPU's compute stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner
            .stream
            .synchronize()
            .map_err(driver("waiting for the stream"))
    }

    /// Waits until all work queued on both of this GPU's streams has finished.
    pub fn synchronize_all(&self) -> Result<()> {
        self.synchronize()?;
        self.inner
            .copy_stream
            .synchronize()
            .map_err(driver("waiting for the copy stream"))
    }

    /// Grid size for a grid-stride loop over `work` items with `block` threads:
    /// enough blocks to cover the work, at most 32 per multiprocessor.
    pub fn grid_for(&self, work: usize, block: u32) -> u32 {
        let blocks = work.div_ceil(block as usize).max(1);
        let cap = self.inner.multiprocessors as usize * 32;
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
                self.inner.stream.as_inner(),
                pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(result, "launching a kernel")
    }

    /// A kernel argument for a device slice, checking it lives on this GPU.
    pub(crate) fn arg<T: Element>(
        &self,
        name: &'static str,
        slice: &DevSlice<'_, T>,
    ) -> Result<KernelArg> {
        self.check_device(name, slice.device())?;
        Ok(KernelArg::Ptr(slice.device_ptr()))
    }

    /// A kernel argument for a mutable device slice, checking it lives on this GPU.
    pub(crate) fn arg_mut<T: Element>(
        &self,
        name: &'static str,
        slice: &DevSliceMut<'_, T>,
    ) -> Result<KernelArg> {
        self.check_device(name, slice.device())?;
        Ok(KernelArg::Ptr(slice.device_ptr()))
    }

    /// Checks that memory on device `device` may be used with this GPU.
    pub(crate) fn check_slice_device(&self, name: &'static str, device: usize) -> Result<()> {
        self.check_device(name, device)
    }

    fn check_device(&self, name: &'static str, device: usize) -> Result<()> {
        if device == self.inner.ordinal {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                arg: name,
                value: format!("a buffer on device {device}"),
                reason: "the launch runs on a different device; copy the data to this device first",
            })
        }
    }
}
