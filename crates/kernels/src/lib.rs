//! ringtrain-kernels (being written).
#![no_std]
#![warn(missing_docs)]
