//! ringtrain-cuda (being written).
#![warn(missing_docs)]
