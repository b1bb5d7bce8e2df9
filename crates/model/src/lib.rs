//! ringtrain-model: placeholder until its issue fills it.
#![warn(missing_docs)]
