//! The bottom layer of the runtime: driver error checks and [`DeviceContext`], one
//! device's CUDA context with its compute and copy streams.
//!
//! Memory (`memory.rs`, `pinned.rs`) holds a [`DeviceContext`] to copy on its streams,
//! wait for them and free into its context; the launch layer (`runtime.rs`, whose
//! [`Gpu`](crate::Gpu) adds the module cache) wraps one. This module uses neither.

use std::sync::Arc;

use cust::context::{Context, CurrentContext};
use cust::device::{Device, DeviceAttribute};
use cust::error::CudaError;
use cust::stream::{Stream, StreamFlags};
use cust::sys as cuda;

use crate::error::{Error, Result};

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

/// Number of CUDA devices visible to this process (initializes the driver).
pub(crate) fn device_count() -> Result<usize> {
    cust::init(cust::CudaFlags::empty()).map_err(driver("initializing the CUDA driver"))?;
    let n = Device::num_devices().map_err(driver("counting CUDA devices"))?;
    Ok(n as usize)
}

struct DeviceContextInner {
    ordinal: usize,
    name: String,
    multiprocessors: u32,
    // Field order is drop order: the streams go before the context.
    stream: Stream,
    copy_stream: Stream,
    context: Context,
}

impl Drop for DeviceContextInner {
    fn drop(&mut self) {
        // Stream destruction acts on the current context.
        let _ = CurrentContext::set_current(&self.context);
    }
}

/// One device's primary context, its compute stream and its copy stream.
///
/// Cloning is cheap and shares the context and streams; they are destroyed when the
/// last clone (a [`Gpu`](crate::Gpu), a buffer) is dropped.
#[derive(Clone)]
pub(crate) struct DeviceContext {
    inner: Arc<DeviceContextInner>,
}

impl DeviceContext {
    /// Opens device `ordinal`: its primary context (made current on the calling
    /// thread), a compute stream and a copy stream.
    pub(crate) fn new(ordinal: usize) -> Result<DeviceContext> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidValue {
                name: "ordinal",
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
        Ok(DeviceContext {
            inner: Arc::new(DeviceContextInner {
                ordinal,
                name,
                multiprocessors: sms.max(1) as u32,
                stream,
                copy_stream,
                context,
            }),
        })
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        CurrentContext::set_current(&self.inner.context)
            .map_err(driver("making the context current"))
    }

    /// The device index.
    pub(crate) fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device name reported by the driver.
    pub(crate) fn name(&self) -> &str {
        &self.inner.name
    }

    /// Number of streaming multiprocessors.
    pub(crate) fn multiprocessors(&self) -> u32 {
        self.inner.multiprocessors
    }

    /// The compute stream: every launch and synchronous copy goes here.
    pub(crate) fn stream(&self) -> &Stream {
        &self.inner.stream
    }

    /// The copy stream: downloads into pinned memory that overlap later kernels.
    pub(crate) fn copy_stream(&self) -> &Stream {
        &self.inner.copy_stream
    }

    /// Waits until all work queued on the compute stream has finished.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner
            .stream
            .synchronize()
            .map_err(driver("waiting for the stream"))
    }

    /// Waits until all work queued on both streams has finished.
    pub(crate) fn synchronize_all(&self) -> Result<()> {
        self.synchronize()?;
        self.inner
            .copy_stream
            .synchronize()
            .map_err(driver("waiting for the copy stream"))
    }

    /// Checks that memory on device `device` may be used with this context.
    pub(crate) fn check_device(&self, name: &'static str, device: usize) -> Result<()> {
        if device == self.inner.ordinal {
            Ok(())
        } else {
            Err(Error::InvalidValue {
                name,
                value: format!("a buffer on device {device}"),
                reason: "the launch runs on a different device; copy the data to this device first",
            })
        }
    }
}
