//! GPU-side timing with CUDA events.
//!
//! Beside the launchers on top of the launch layer: a timer is made for a [`Gpu`] and
//! records its events on that GPU's compute stream (`context.rs`).

use cust::event::{Event, EventFlags};

use crate::context::{driver, DeviceContext};
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

/// One timing event recorded on a stream of a GPU: the device's own clock at the point
/// the stream reached it. Two marks give the device time between them
/// ([`StreamMark::ms_since`]), also across the compute and the copy stream of one GPU
/// (timelines: `ringtrain train --timeline` on cuda).
pub struct StreamMark {
    device: DeviceContext,
    event: Event,
}

impl std::fmt::Debug for StreamMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamMark")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl StreamMark {
    fn record(device: &DeviceContext, copy: bool) -> Result<StreamMark> {
        device.bind()?;
        let event = Event::new(EventFlags::DEFAULT).map_err(driver("creating an event"))?;
        let stream = if copy {
            device.copy_stream()
        } else {
            device.stream()
        };
        event.record(stream).map_err(driver("recording an event"))?;
        Ok(StreamMark {
            device: device.clone(),
            event,
        })
    }

    /// A mark on `gpu`'s compute stream, after the work queued there so far.
    pub fn on_compute(gpu: &Gpu) -> Result<StreamMark> {
        Self::record(gpu.device(), false)
    }

    /// A mark on `gpu`'s copy stream, after the copies queued there so far.
    pub fn on_copy(gpu: &Gpu) -> Result<StreamMark> {
        Self::record(gpu.device(), true)
    }

    /// A mark on the copy stream of `device` (the pinned buffers' timed copies).
    pub(crate) fn on_copy_of(device: &DeviceContext) -> Result<StreamMark> {
        Self::record(device, true)
    }

    /// Milliseconds of device time from `earlier` to this mark (negative when this one
    /// came first); waits until the stream has reached this mark.
    pub fn ms_since(&self, earlier: &StreamMark) -> Result<f32> {
        self.device.bind()?;
        self.event
            .synchronize()
            .map_err(driver("waiting for an event"))?;
        earlier
            .event
            .synchronize()
            .map_err(driver("waiting for an event"))?;
        self.event
            .elapsed_time_f32(&earlier.event)
            .map_err(driver("reading the time between events"))
    }
}
