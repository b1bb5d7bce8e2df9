//! GPU-side timing with CUDA events.
//!
//! Beside the launchers on top of the launch layer: a timer is made for a [`Gpu`] and
//! records its events on that GPU's compute stream (`context.rs`).

use cust::event::{Event, EventFlags};

use crate::context::driver;
use crate::error::Result;
use crate::runtime::Gpu;

/// Times work on a [`Gpu`]'s stream with two CUDA events.
///
/// `start` and `stop` record events on the stream; `elapsed_ms` waits for the
/// stop event and returns the device time between the two, so host overheads
/// between launches count only as far as they leave the device idle.
#[derive(Debug)]
pub struct GpuTimer {
    gpu: Gpu,
    start: Event,
    stop: Event,
}

impl GpuTimer {
    /// Two timing events on `gpu`.
    pub fn new(gpu: &Gpu) -> Result<GpuTimer> {
        gpu.bind()?;
        Ok(GpuTimer {
            gpu: gpu.clone(),
            start: Event::new(EventFlags::DEFAULT).map_err(driver("creating an event"))?,
            stop: Event::new(EventFlags::DEFAULT).map_err(driver("creating an event"))?,
        })
    }

    /// Records the start event on the stream.
    pub fn start(&self) -> Result<()> {
        self.gpu.bind()?;
        self.start
            .record(self.gpu.device().stream())
            .map_err(driver("recording an event"))
    }

    /// Records the stop event on the stream.
    pub fn stop(&self) -> Result<()> {
        self.gpu.bind()?;
        self.stop
            .record(self.gpu.device().stream())
            .map_err(driver("recording an event"))
    }

    /// Waits for the stop event; milliseconds between start and stop.
    pub fn elapsed_ms(&self) -> Result<f32> {
        self.gpu.bind()?;
        self.stop
            .synchronize()
            .map_err(driver("waiting for an event"))?;
        self.stop
            .elapsed_time_f32(&self.start)
            .map_err(driver("reading the time between events"))
    }

    /// Runs `work` `runs` times, timing each run; returns the median in ms.
    pub fn median_ms(&self, runs: usize, mut work: impl FnMut() -> Result<()>) -> Result<f32> {
        let mut times = Vec::with_capacity(runs.max(1));
        for _ in 0..runs.max(1) {
            self.start()?;
            work()?;
            self.stop()?;
            times.push(self.elapsed_ms()?);
        }
        times.sort_by(f32::total_cmp);
        Ok(times[times.len() / 2])
    }
}
