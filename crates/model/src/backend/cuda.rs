//! The CUDA backend's entry point.
//!
//! Without the `cuda` feature the crate has no GPU runtime and [`CudaBackend::new`] returns
//! [`Error::NotCompiledWithCuda`]. With the feature the PTX runtime (ringtrain-cuda) is
//! linked, but the model operations are not yet implemented on the GPU, so
//! [`CudaBackend::new`] returns [`Error::CudaBackendUnavailable`] rather than a backend
//! that would silently do nothing.

use crate::error::{Error, Result};

/// Handle of the GPU backend. No value of it can be made in this version (see the module
/// docs): every constructor returns an error that says why.
#[derive(Debug)]
pub struct CudaBackend {
    device: usize,
    _unconstructible: std::convert::Infallible,
}

impl CudaBackend {
    /// The backend on GPU `device`.
    ///
    /// # Errors
    /// [`Error::NotCompiledWithCuda`] when the crate was built without the `cuda` feature;
    /// [`Error::CudaBackendUnavailable`] when it was built with it.
    pub fn new(device: usize) -> Result<CudaBackend> {
        if cfg!(feature = "cuda") {
            Err(Error::CudaBackendUnavailable { device })
        } else {
            Err(Error::NotCompiledWithCuda { device })
        }
    }

    /// The GPU index this backend drives.
    pub fn device(&self) -> usize {
        self.device
    }
}
