//! Device memory: owned buffers and borrowed views.
//!
//! The memory layer: it sits on `context.rs` (a buffer holds its device's
//! [`DeviceContext`] to copy on its streams and to free into it) and knows nothing of
//! modules or launches; [`Gpu`](crate::Gpu)'s `alloc`, `upload`, `copy`, ... forward
//! here.
//!
//! A [`GpuBuffer`] owns device memory on one device. Launchers take views:
//! [`DevSlice`] (read) and [`DevSliceMut`] (write), borrowed from a buffer, so
//! the borrow checker keeps a kernel's outputs from aliasing its inputs. Views
//! of parts of a buffer come from [`GpuBuffer::slice`] and
//! [`GpuBuffer::slice_mut`] / [`DevSliceMut::split_at_mut`].
//!
//! Element types are plain bit patterns ([`Element`]: `bytemuck::Pod`), which
//! includes `half::f16` / `half::bf16` (half 2.x) directly: memory is moved as
//! bytes, never through cust's `DeviceCopy` (whose half impls are for half 1.x).

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use cust::sys as cuda;

use crate::context::{check, DeviceContext};
use crate::error::{Error, Result};

/// An element type that can live in device memory.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Name for messages ("f32", "f16", ...).
    const NAME: &'static str;
}

macro_rules! element {
    ($($t:ty => $name:literal),* $(,)?) => {
        $(impl Element for $t { const NAME: &'static str = $name; })*
    };
}
element!(f32 => "f32", f64 => "f64", u32 => "u32", i32 => "i32", u16 => "u16", u8 => "u8",
    half::f16 => "f16", half::bf16 => "bf16");

fn byte_len<T: Element>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or(Error::TooLarge {
            arg: "len",
            value: len,
            limit: usize::MAX / std::mem::size_of::<T>(),
        })
}

pub(crate) fn check_range(arg: &'static str, range: &Range<usize>, len: usize) -> Result<()> {
    if range.start <= range.end && range.end <= len {
        Ok(())
    } else {
        Err(Error::InvalidValue {
            name: arg,
            value: format!("{}..{}", range.start, range.end),
            reason: "the range is outside the buffer (or reversed); it must lie within 0..len",
        })
    }
}

/// Owned device memory holding `len` elements of `T`.
///
/// Dropping it frees the memory (the driver's free waits for queued work that
/// may still use it).
pub struct GpuBuffer<T: Element> {
    device: DeviceContext,
    ptr: u64,
    len: usize,
    _type: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for GpuBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuBuffer<{}>[{}] on device {}",
            T::NAME,
            self.len,
            self.device.ordinal()
        )
    }
}

impl<T: Element> Drop for GpuBuffer<T> {
    fn drop(&mut self) {
        if self.ptr != 0 && self.device.bind().is_ok() {
            // Work queued on the streams may still read or write this memory (a launcher's
            // uploaded ids, a scratch buffer, a download to pinned memory): wait for it
            // before the memory goes back.
            let _ = self.device.synchronize_all();
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once, after
            // both streams (the only ones work is queued on) have drained.
            unsafe {
                let _ = cuda::cuMemFree_v2(self.ptr);
            }
            HELD.fetch_sub(
                (self.len * std::mem::size_of::<T>()) as u64,
                Ordering::Relaxed,
            );
        }
    }
}

static HELD: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// Device memory this process holds in [`GpuBuffer`]s (every device allocation of the
/// crate), now and at most so far: the allocator's high-water mark. The driver's own
/// context memory is not included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemoryUse {
    /// Bytes held now.
    pub held: u64,
    /// The most bytes held at once since the process started.
    pub peak: u64,
}

impl DeviceMemoryUse {
    /// This process's figures now.
    pub fn process() -> DeviceMemoryUse {
        DeviceMemoryUse {
            held: HELD.load(Ordering::Relaxed),
            peak: PEAK.load(Ordering::Relaxed),
        }
    }
}

fn count_alloc(bytes: usize) {
    let held = HELD.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(held, Ordering::Relaxed);
}

// The memory operations behind `Gpu::alloc`, `Gpu::copy`, ... (documented there).
impl DeviceContext {
    /// Allocates `len` elements; the contents are unspecified.
    pub(crate) fn alloc<T: Element>(&self, len: usize) -> Result<GpuBuffer<T>> {
        let bytes = byte_len::<T>(len)?;
        let mut ptr: u64 = 0;
        if bytes > 0 {
            self.bind()?;
            // SAFETY: cuMemAlloc writes one device address into `ptr`.
            let result = unsafe { cuda::cuMemAlloc_v2(&mut ptr, bytes) };
            if result == cuda::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                let (mut free, mut total) = (0usize, 0usize);
                // SAFETY: cuMemGetInfo writes two sizes; on failure both stay 0 (unknown).
                let _ = unsafe { cuda::cuMemGetInfo_v2(&mut free, &mut total) };
                return Err(Error::OutOfMemory {
                    bytes,
                    held: HELD.load(Ordering::Relaxed),
                    free,
                    total,
                });
            }
            check(result, "allocating device memory")?;
            count_alloc(bytes);
        }
        Ok(GpuBuffer {
            device: self.clone(),
            ptr,
            len,
            _type: PhantomData,
        })
    }

    /// Allocates `len` elements set to all-zero bits.
    pub(crate) fn zeros<T: Element>(&self, len: usize) -> Result<GpuBuffer<T>> {
        let mut buf = self.alloc(len)?;
        buf.fill_bytes(0)?;
        Ok(buf)
    }

    /// Allocates a buffer holding a copy of `host`.
    pub(crate) fn upload<T: Element>(&self, host: &[T]) -> Result<GpuBuffer<T>> {
        let mut buf = self.alloc(host.len())?;
        buf.copy_from_host(host)?;
        Ok(buf)
    }

    /// Queues a device-to-device copy of `src` into `dst` (same length).
    pub(crate) fn copy<T: Element>(
        &self,
        src: &impl AsDevSlice<T>,
        dst: &mut impl AsDevSliceMut<T>,
    ) -> Result<()> {
        let src = src.dev_slice();
        let dst = dst.dev_slice_mut();
        crate::error::check_len("dst", src.len(), dst.len())?;
        self.check_device("src", src.device())?;
        self.check_device("dst", dst.device())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges lie inside live allocations of this context
        // (views are bounds-checked) and `dst` is borrowed mutably, so the
        // ranges do not overlap.
        let result = unsafe {
            cuda::cuMemcpyDtoDAsync_v2(
                dst.device_ptr(),
                src.device_ptr(),
                src.len() * std::mem::size_of::<T>(),
                self.stream().as_inner(),
            )
        };
        check(result, "copying device memory")
    }

    /// Copies the device view `src` into `host` (same length) on the compute stream and
    /// waits for it.
    pub(crate) fn copy_to_host<T: Element>(
        &self,
        src: &impl AsDevSlice<T>,
        host: &mut [T],
    ) -> Result<()> {
        let src = src.dev_slice();
        crate::error::check_len("host", src.len(), host.len())?;
        self.check_device("src", src.device())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(host);
        // SAFETY: the view lies inside a live allocation of this context (views are
        // bounds-checked) and holds exactly `bytes.len()` bytes; the host slice stays
        // borrowed until the stream is synchronized below.
        let result = unsafe {
            cuda::cuMemcpyDtoHAsync_v2(
                bytes.as_mut_ptr().cast(),
                src.device_ptr(),
                bytes.len(),
                self.stream().as_inner(),
            )
        };
        check(result, "copying device memory to the host")?;
        crate::transfer::count_to_host(bytes.len());
        self.synchronize()
    }

    /// Copies `host` into the device view `dst` (same length) on the compute stream and
    /// waits for it.
    pub(crate) fn copy_from_host<T: Element>(
        &self,
        host: &[T],
        dst: &mut impl AsDevSliceMut<T>,
    ) -> Result<()> {
        let dst = dst.dev_slice_mut();
        crate::error::check_len("host", dst.len(), host.len())?;
        self.check_device("dst", dst.device())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let bytes: &[u8] = bytemuck::cast_slice(host);
        // SAFETY: the view lies inside a live allocation of this context and holds
        // exactly `bytes.len()` bytes; the host slice stays borrowed until the stream is
        // synchronized below.
        let result = unsafe {
            cuda::cuMemcpyHtoDAsync_v2(
                dst.device_ptr(),
                bytes.as_ptr().cast(),
                bytes.len(),
                self.stream().as_inner(),
            )
        };
        check(result, "copying host memory to the device")?;
        crate::transfer::count_to_device(bytes.len());
        self.synchronize()
    }
}

impl<T: Element> GpuBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Index of the device holding the memory.
    pub fn device(&self) -> usize {
        self.device.ordinal()
    }

    /// Copies `host` into the buffer (same length), after the work queued so far.
    pub fn copy_from_host(&mut self, host: &[T]) -> Result<()> {
        crate::error::check_len("host", self.len, host.len())?;
        if self.len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let bytes: &[u8] = bytemuck::cast_slice(host);
        // SAFETY: the destination holds exactly `bytes.len()` bytes; the host
        // slice stays borrowed until the stream is synchronized below.
        let result = unsafe {
            cuda::cuMemcpyHtoDAsync_v2(
                self.ptr,
                bytes.as_ptr().cast(),
                bytes.len(),
                self.device.stream().as_inner(),
            )
        };
        check(result, "copying host memory to the device")?;
        crate::transfer::count_to_device(bytes.len());
        self.device.synchronize()
    }

    /// Copies the buffer into `host` (same length), waiting for queued work first.
    pub fn copy_to_host(&self, host: &mut [T]) -> Result<()> {
        crate::error::check_len("host", self.len, host.len())?;
        if self.len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(host);
        // SAFETY: the source holds exactly `bytes.len()` bytes; the host slice
        // stays borrowed until the stream is synchronized below.
        let result = unsafe {
            cuda::cuMemcpyDtoHAsync_v2(
                bytes.as_mut_ptr().cast(),
                self.ptr,
                bytes.len(),
                self.device.stream().as_inner(),
            )
        };
        check(result, "copying device memory to the host")?;
        crate::transfer::count_to_host(bytes.len());
        self.device.synchronize()
    }

    /// Copies the buffer into a new `Vec`, waiting for queued work first.
    pub fn to_host(&self) -> Result<Vec<T>> {
        let mut host = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut host)?;
        Ok(host)
    }

    /// Queues setting every byte to `byte` (0xFF makes f32/f16/bf16 NaN: handy as poison).
    pub fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        let bytes = byte_len::<T>(self.len)?;
        if bytes == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: the allocation holds `bytes` bytes.
        let result = unsafe {
            cuda::cuMemsetD8Async(self.ptr, byte, bytes, self.device.stream().as_inner())
        };
        check(result, "filling device memory")
    }

    /// A read view of the whole buffer.
    pub fn as_slice(&self) -> DevSlice<'_, T> {
        DevSlice {
            ptr: self.ptr,
            len: self.len,
            device: self.device.ordinal(),
            _borrow: PhantomData,
        }
    }

    /// A write view of the whole buffer.
    pub fn as_mut_slice(&mut self) -> DevSliceMut<'_, T> {
        DevSliceMut {
            ptr: self.ptr,
            len: self.len,
            device: self.device.ordinal(),
            _borrow: PhantomData,
        }
    }

    /// A read view of elements `range`.
    pub fn slice(&self, range: Range<usize>) -> Result<DevSlice<'_, T>> {
        self.as_slice().slice(range)
    }

    /// A write view of elements `range`.
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<DevSliceMut<'_, T>> {
        check_range("range", &range, self.len)?;
        let view = self.as_mut_slice();
        Ok(DevSliceMut {
            ptr: view.ptr + (range.start * std::mem::size_of::<T>()) as u64,
            len: range.end - range.start,
            device: view.device,
            _borrow: PhantomData,
        })
    }
}

/// A borrowed read-only view of device elements.
#[derive(Debug)]
pub struct DevSlice<'a, T> {
    ptr: u64,
    len: usize,
    device: usize,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for DevSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevSlice<'_, T> {}

impl<'a, T: Element> DevSlice<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// Index of the device holding the memory.
    pub fn device(&self) -> usize {
        self.device
    }
    /// A narrower view.
    pub fn slice(self, range: Range<usize>) -> Result<DevSlice<'a, T>> {
        check_range("range", &range, self.len)?;
        Ok(DevSlice {
            ptr: self.ptr + (range.start * std::mem::size_of::<T>()) as u64,
            len: range.end - range.start,
            device: self.device,
            _borrow: PhantomData,
        })
    }
}

/// A borrowed writable view of device elements.
#[derive(Debug)]
pub struct DevSliceMut<'a, T> {
    ptr: u64,
    len: usize,
    device: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> DevSliceMut<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// Index of the device holding the memory.
    pub fn device(&self) -> usize {
        self.device
    }
    /// A read view of the same elements.
    pub fn as_slice(&self) -> DevSlice<'_, T> {
        DevSlice {
            ptr: self.ptr,
            len: self.len,
            device: self.device,
            _borrow: PhantomData,
        }
    }
    /// A shorter-lived writable view of the same elements.
    pub fn reborrow(&mut self) -> DevSliceMut<'_, T> {
        DevSliceMut {
            ptr: self.ptr,
            len: self.len,
            device: self.device,
            _borrow: PhantomData,
        }
    }
    /// Splits into two disjoint writable views at element `mid`.
    pub fn split_at_mut(self, mid: usize) -> Result<(DevSliceMut<'a, T>, DevSliceMut<'a, T>)> {
        check_range("mid", &(0..mid), self.len)?;
        let size = std::mem::size_of::<T>() as u64;
        Ok((
            DevSliceMut {
                ptr: self.ptr,
                len: mid,
                device: self.device,
                _borrow: PhantomData,
            },
            DevSliceMut {
                ptr: self.ptr + mid as u64 * size,
                len: self.len - mid,
                device: self.device,
                _borrow: PhantomData,
            },
        ))
    }
}

/// Anything that can be read by a kernel: buffers and views.
pub trait AsDevSlice<T> {
    /// The read view.
    fn dev_slice(&self) -> DevSlice<'_, T>;
}

/// Anything a kernel can write: buffers and writable views.
pub trait AsDevSliceMut<T> {
    /// The write view.
    fn dev_slice_mut(&mut self) -> DevSliceMut<'_, T>;
}

impl<T: Element> AsDevSlice<T> for GpuBuffer<T> {
    fn dev_slice(&self) -> DevSlice<'_, T> {
        self.as_slice()
    }
}
impl<T: Element> AsDevSlice<T> for DevSlice<'_, T> {
    fn dev_slice(&self) -> DevSlice<'_, T> {
        *self
    }
}
impl<T: Element> AsDevSlice<T> for DevSliceMut<'_, T> {
    fn dev_slice(&self) -> DevSlice<'_, T> {
        self.as_slice()
    }
}
impl<T: Element> AsDevSliceMut<T> for GpuBuffer<T> {
    fn dev_slice_mut(&mut self) -> DevSliceMut<'_, T> {
        self.as_mut_slice()
    }
}
impl<T: Element> AsDevSliceMut<T> for DevSliceMut<'_, T> {
    fn dev_slice_mut(&mut self) -> DevSliceMut<'_, T> {
        self.reborrow()
    }
}
