//! Page-locked ("pinned") host memory and copies that overlap with kernels.
//!
//! The driver can move page-locked host memory by DMA while kernels run; pageable
//! memory goes through a staging copy and does not overlap. [`PinnedBuffer`] owns
//! such memory and remembers which of its element ranges an asynchronous copy is
//! still writing or reading, so host code can never observe a half-finished copy:
//!
//! * [`PinnedBuffer::download_async`] queues device → host on the GPU's **copy
//!   stream**, ordered after all the work queued so far on the compute stream
//!   (an event recorded there, waited for on the copy stream). Kernels queued
//!   afterwards keep running while the copy travels.
//! * [`PinnedBuffer::upload_async`] queues host → device on the **compute
//!   stream**, so kernels queued afterwards see the data.
//! * [`PinnedBuffer::wait`] returns a range once the copies touching it are done;
//!   [`PinnedBuffer::is_ready`] asks without blocking; [`PinnedBuffer::as_mut_slice`]
//!   waits for everything. [`PinnedBuffer::settled`] gives the whole buffer without
//!   waiting, or `None` while a copy is in flight.
//!
//! ```no_run
//! use ringtrain_cuda::Gpu;
//! # fn main() -> ringtrain_cuda::Result<()> {
//! let gpu = Gpu::new(0)?;
//! let grads = gpu.upload(&vec![1.0f32; 1 << 20])?;
//! let mut host = gpu.pinned::<f32>(1 << 20)?;
//! host.download_async(0..1 << 19, &grads.slice(0..1 << 19)?)?; // first half
//! host.download_async(1 << 19..1 << 20, &grads.slice(1 << 19..1 << 20)?)?;
//! let first = host.wait(0..1 << 19)?; // the second half may still be in flight
//! assert_eq!(first[0], 1.0);
//! # Ok(())
//! # }
//! ```

use std::ops::Range;
use std::ptr::NonNull;

use cust::event::{Event, EventFlags, EventStatus};
use cust::stream::StreamWaitEventFlags;
use cust::sys as cuda;

use crate::context::{check, driver, DeviceContext};
use crate::error::{Error, Result};
use crate::memory::{AsDevSlice, AsDevSliceMut, Element};
use crate::timing::StreamMark;

/// An asynchronous copy touching `range` of a pinned buffer, done when `done` fires.
#[derive(Debug)]
struct InFlight {
    range: Range<usize>,
    done: Event,
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Page-locked host memory for `len` elements of `T`, with asynchronous copies to and
/// from a [`Gpu`](crate::Gpu) (see the module docs).
pub struct PinnedBuffer<T: Element> {
    device: DeviceContext,
    ptr: NonNull<T>,
    len: usize,
    in_flight: Vec<InFlight>,
}

// SAFETY: the buffer owns its host allocation exclusively (like a `Box<[T]>`), and the
// driver allows freeing pinned memory and using events from any thread.
unsafe impl<T: Element> Send for PinnedBuffer<T> {}
// SAFETY: `&PinnedBuffer` only gives out `settled()`, a shared slice that exists only
// while no copy is in flight; everything that queues or waits takes `&mut self`.
unsafe impl<T: Element> Sync for PinnedBuffer<T> {}

impl<T: Element> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedBuffer<{}>[{}] for device {} ({} copies in flight)",
            T::NAME,
            self.len,
            self.device.ordinal(),
            self.in_flight.len()
        )
    }
}

// The allocation behind `Gpu::pinned` (documented there).
impl DeviceContext {
    /// Allocates `len` zeroed elements of page-locked host memory for copies with this
    /// device.
    pub(crate) fn pinned<T: Element>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        let size = std::mem::size_of::<T>();
        let bytes = len.checked_mul(size).ok_or(Error::TooLarge {
            arg: "len",
            value: len,
            limit: usize::MAX / size.max(1),
        })?;
        self.bind()?;
        let ptr = if bytes == 0 {
            NonNull::dangling()
        } else {
            let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: cuMemAllocHost stores a pointer to `bytes` bytes of page-locked
            // memory (aligned for any type) into `raw`, or fails and leaves it null.
            check(
                unsafe { cuda::cuMemAllocHost_v2(&mut raw, bytes) },
                "allocating pinned host memory",
            )?;
            let typed = NonNull::new(raw.cast::<T>()).ok_or(Error::InvalidValue {
                name: "len",
                value: len.to_string(),
                reason: "the driver returned no pinned memory; request less or free some",
            })?;
            // SAFETY: the allocation holds `bytes` bytes, and all-zero bytes are a valid
            // `T` (`Element: Pod`).
            unsafe { std::ptr::write_bytes(typed.as_ptr().cast::<u8>(), 0, bytes) };
            typed
        };
        Ok(PinnedBuffer {
            device: self.clone(),
            ptr,
            len,
            in_flight: Vec::new(),
        })
    }
}

impl<T: Element> PinnedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of asynchronous copies queued on this buffer and not yet waited for.
    pub fn copies_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn check_range(&self, arg: &'static str, range: &Range<usize>) -> Result<()> {
        crate::memory::check_range(arg, range, self.len)
    }

    /// Waits for (and forgets) every in-flight copy overlapping `range`.
    fn settle(&mut self, range: &Range<usize>) -> Result<()> {
        let mut result = Ok(());
        self.in_flight.retain(|copy| {
            if !overlaps(&copy.range, range) || result.is_err() {
                return true;
            }
            match copy.done.synchronize() {
                Ok(()) => false,
                Err(e) => {
                    result = Err(driver("waiting for a pinned-memory copy")(e));
                    true
                }
            }
        });
        result
    }

    /// The elements of `range`, once every copy touching them has finished.
    ///
    /// # Errors
    /// A range outside the buffer, or the driver error of a failed copy.
    pub fn wait(&mut self, range: Range<usize>) -> Result<&[T]> {
        self.check_range("range", &range)?;
        self.device.bind()?;
        self.settle(&range)?;
        // SAFETY: `range` lies inside the allocation and no copy touches it any more (copies
        // into other ranges may still run: the slice covers exactly `range`).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.len()) })
    }

    /// [`wait`](Self::wait), mutable: the elements of `range` to reduce in place, once every
    /// copy touching them has finished.
    ///
    /// # Errors
    /// A range outside the buffer, or the driver error of a failed copy.
    pub fn wait_mut(&mut self, range: Range<usize>) -> Result<&mut [T]> {
        self.check_range("range", &range)?;
        self.device.bind()?;
        self.settle(&range)?;
        // SAFETY: as in `wait`, with `&mut self` for exclusive access to `range`.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len())
        })
    }

    /// Whether every copy touching `range` has finished (does not block).
    ///
    /// # Errors
    /// A range outside the buffer, or the driver error of a failed copy.
    pub fn is_ready(&mut self, range: Range<usize>) -> Result<bool> {
        self.check_range("range", &range)?;
        self.device.bind()?;
        for copy in self.in_flight.iter().filter(|c| overlaps(&c.range, &range)) {
            let status = copy
                .done
                .query()
                .map_err(driver("asking whether a pinned-memory copy is done"))?;
            if status == EventStatus::NotReady {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Waits for every in-flight copy.
    ///
    /// # Errors
    /// The driver error of a failed copy.
    pub fn wait_all(&mut self) -> Result<()> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        self.settle(&(0..self.len))
    }

    /// The whole buffer, after waiting for every in-flight copy.
    ///
    /// # Errors
    /// The driver error of a failed copy.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait_all()?;
        // SAFETY: the allocation holds `len` elements and no copy uses it any more.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// The whole buffer if no copy is in flight (after [`wait_all`](Self::wait_all) or
    /// [`as_mut_slice`](Self::as_mut_slice)), else `None`. Never blocks.
    pub fn settled(&self) -> Option<&[T]> {
        // SAFETY: with nothing in flight no DMA touches the memory, and `&self` excludes
        // the `&mut self` calls that would queue one.
        self.in_flight
            .is_empty()
            .then(|| unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The whole buffer, mutable, if no copy is in flight, else `None`. Never blocks.
    pub fn settled_mut(&mut self) -> Option<&mut [T]> {
        // SAFETY: as in `settled`, with `&mut self` for exclusive access.
        self.in_flight
            .is_empty()
            .then(|| unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    fn event(&self) -> Result<Event> {
        Event::new(EventFlags::DISABLE_TIMING).map_err(driver("creating an event"))
    }

    /// Queues copying the device view `src` into `range` of this buffer on the GPU's copy
    /// stream, after all the work queued so far on its compute stream. Returns at once;
    /// [`wait`](Self::wait) / [`is_ready`](Self::is_ready) tell when the data is there.
    ///
    /// `src` must stay unchanged until the copy is done: kernels queued later on the
    /// compute stream must not write it (the copy runs concurrently with them).
    ///
    /// # Errors
    /// A range outside the buffer, a length or device mismatch, or a driver error.
    pub fn download_async(&mut self, range: Range<usize>, src: &impl AsDevSlice<T>) -> Result<()> {
        self.download(range, src, false).map(drop)
    }

    /// [`download_async`](Self::download_async), timed with CUDA events on the copy
    /// stream: the marks where the copy starts (after the compute work it waits for) and
    /// ends. An empty range copies nothing and gives no marks.
    ///
    /// # Errors
    /// As [`download_async`](Self::download_async).
    pub fn download_async_timed(
        &mut self,
        range: Range<usize>,
        src: &impl AsDevSlice<T>,
    ) -> Result<Option<(StreamMark, StreamMark)>> {
        self.download(range, src, true)
    }

    fn download(
        &mut self,
        range: Range<usize>,
        src: &impl AsDevSlice<T>,
        timed: bool,
    ) -> Result<Option<(StreamMark, StreamMark)>> {
        let src = src.dev_slice();
        self.check_range("range", &range)?;
        crate::error::check_len("src", range.len(), src.len())?;
        self.device.check_device("src", src.device())?;
        if range.is_empty() {
            return Ok(None);
        }
        self.device.bind()?;
        self.settle(&range)?; // an earlier copy may still read or write these elements
        let after_compute = self.event()?;
        after_compute
            .record(self.device.stream())
            .map_err(driver("recording an event on the compute stream"))?;
        self.device
            .copy_stream()
            .wait_event(after_compute, StreamWaitEventFlags::DEFAULT)
            .map_err(driver("ordering the copy stream after the compute stream"))?;
        let start = if timed {
            Some(StreamMark::on_copy_of(&self.device)?)
        } else {
            None
        };
        let bytes = range.len() * std::mem::size_of::<T>();
        // SAFETY: `range` lies inside the pinned allocation, which stays alive (Drop waits
        // for every in-flight copy) and is not touched by the host until `done` fires (the
        // range is recorded in `in_flight` below); `src` is a checked view of `bytes`
        // bytes of a live allocation of this context.
        let result = unsafe {
            cuda::cuMemcpyDtoHAsync_v2(
                self.ptr.as_ptr().add(range.start).cast(),
                src.device_ptr(),
                bytes,
                self.device.copy_stream().as_inner(),
            )
        };
        check(result, "copying device memory to pinned host memory")?;
        crate::transfer::count_to_host(bytes);
        let done = self.event()?;
        done.record(self.device.copy_stream())
            .map_err(driver("recording an event on the copy stream"))?;
        self.in_flight.push(InFlight { range, done });
        match start {
            Some(start) => Ok(Some((start, StreamMark::on_copy_of(&self.device)?))),
            None => Ok(None),
        }
    }

    /// Queues copying `range` of this buffer into the device view `dst` on the GPU's
    /// compute stream: kernels queued afterwards see the data. Returns at once; the host
    /// elements stay locked (only [`wait`](Self::wait) and friends give them out) until the
    /// copy has read them.
    ///
    /// # Errors
    /// A range outside the buffer, a length or device mismatch, or a driver error.
    pub fn upload_async(
        &mut self,
        range: Range<usize>,
        dst: &mut impl AsDevSliceMut<T>,
    ) -> Result<()> {
        let dst = dst.dev_slice_mut();
        self.check_range("range", &range)?;
        crate::error::check_len("dst", range.len(), dst.len())?;
        self.device.check_device("dst", dst.device())?;
        if range.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        self.settle(&range)?; // a download may still be writing these elements
        let bytes = range.len() * std::mem::size_of::<T>();
        // SAFETY: as in `download_async`: the host range is live and locked until `done`
        // fires; `dst` is a checked view of `bytes` bytes of a live allocation.
        let result = unsafe {
            cuda::cuMemcpyHtoDAsync_v2(
                dst.device_ptr(),
                self.ptr.as_ptr().add(range.start).cast(),
                bytes,
                self.device.stream().as_inner(),
            )
        };
        check(result, "copying pinned host memory to the device")?;
        crate::transfer::count_to_device(bytes);
        let done = self.event()?;
        done.record(self.device.stream())
            .map_err(driver("recording an event on the compute stream"))?;
        self.in_flight.push(InFlight { range, done });
        Ok(())
    }
}

impl<T: Element> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.len == 0 || self.device.bind().is_err() {
            return;
        }
        if self.wait_all().is_err() {
            // A copy failed to finish and may still target this memory: leaking it is the
            // only safe choice (the context is broken at this point anyway).
            return;
        }
        // SAFETY: the memory came from cuMemAllocHost in this context, is freed once, and
        // no copy uses it any more.
        unsafe {
            let _ = cuda::cuMemFreeHost(self.ptr.as_ptr().cast());
        }
    }
}
