//! Before the first step: ranks agree on the flags and the model, the output files are
//! checked (on the rank that writes them), a checkpoint is resumed, rank 0's parameters reach every rank, the clocks of a `--timeline` are synchronised, and the strategy and optimizer start.

use std::path::{Path, PathBuf};

use ringtrain_collective::Communicator;

use crate::checkpoint::Checkpoint;
use crate::config::ValidatedConfig;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::input::{BatchSource, InputPosition};
use crate::optimizer::{LossScaler, Optimizer};
use crate::pipeline::PipelineUpdate;
use crate::strategy::Strategy;
use crate::timeline::TrainTimeline;
use crate::trainable::TrainableModel;

/// A session whose model neither updates on its device nor has a host optimizer.
pub(super) fn no_optimizer() -> Error {
    Error::Internal("the session has no optimizer for a model updated on the host".into())
}

/// One rank's training state between steps.
pub(super) struct Session<'a> {
    pub(super) cfg: &'a ValidatedConfig,
    pub(super) rank: usize,
    pub(super) control: Control,
    pub(super) strategy: Strategy,
    /// The host optimizer (`None`: the model updates on its device with its own).
    pub(super) optimizer: Option<Optimizer>,
    /// The dynamic loss scale of f16 gradients (`None`: f32 gradients).
    pub(super) scaler: Option<LossScaling>,
    /// Steps completed, counting those of a resumed checkpoint.
    pub(super) step: u64,
    /// This rank's examples per step (0 for a dedicated parameter server).
    pub(super) batch_size: usize,
    /// Where this rank's input stands after the last batch trained on.
    pub(super) input: Option<InputPosition>,
    /// What resuming did (`None`: the run did not resume): a line for the log.
    pub(super) resumed: Option<String>,
    /// The last checkpoint known to be whole (resumed or written by this run), and its step.
    pub(super) last_checkpoint: Option<(PathBuf, u64)>,
    /// The `--timeline` of this rank (`None`: no timeline, nothing recorded).
    pub(super) timeline: Option<TrainTimeline>,
}

/// Where the dynamic loss scale of f16 gradients lives.
#[derive(Debug, Clone, Copy)]
pub(super) enum LossScaling {
    /// On the host: the trainer feeds it each step's outcome and puts it on the wire.
    Host(LossScaler),
    /// On the model's device ([`crate::trainable::DeviceResident::start_loss_scaler`]):
    /// the device multiplies it into the casts and updates it; the host reads it only
    /// for checkpoints, reports and the log line of a skipped step.
    Device,
}

impl<'a> Session<'a> {
    /// Sets up rank `comm.rank()` to train `model` (collective: every rank calls it).
    ///
    /// # Errors
    /// The collective's `SettingsDiffer` when ranks were started with different flags
    /// or built different models; checkpoint errors (on every rank); transport errors.
    pub(super) fn start(
        cfg: &'a ValidatedConfig,
        mut comm: Communicator,
        model: &mut dyn TrainableModel,
        batches: &mut dyn BatchSource,
    ) -> Result<Self> {
        let rank = comm.rank();
        if comm.size() != cfg.world() {
            return Err(Error::invalid(
                "number of ranks",
                comm.size(),
                format!(
                    "the config was validated for {} ranks: validate it for the communicator's size",
                    cfg.world()
                ),
            ));
        }
        let specs = model.param_specs();
        let n_params = model.params()?.len();
        let covered: usize = specs.iter().map(|s| s.range.len()).sum();
        if covered != n_params {
            return Err(Error::invalid(
                "the model's parameter specs",
                format!("{covered} elements"),
                format!("must cover the flat parameter buffer of {n_params} elements exactly"),
            ));
        }

        let mut control = Control::beside(&comm)?;
        control.check_same_values("flags", &cfg.config().shared_flags()?)?;
        let parameters = [("parameter count".to_string(), n_params.to_string())];
        control.check_same_values("models", &parameters)?;
        // Rank 0 writes every output file: it checks them before any step is spent.
        let outputs = if rank == 0 {
            crate::outputs::check_run_outputs(cfg.config())
        } else {
            Ok(())
        };
        control.agree("to check the output files", outputs)?;

        // Resume before the broadcast: rank 0's loaded parameters then reach everyone.
        let output = &cfg.config().output;
        let resumed = match (&output.checkpoint, output.resume) {
            (Some(path), true) => {
                let loaded = Checkpoint::load(path).and_then(|ck| {
                    ck.check_compatible(cfg.config(), n_params, path)?;
                    Ok(ck)
                });
                let ck = control.agree("to load the checkpoint", loaded)?;
                model.params_mut()?.copy_from_slice(&ck.params);
                Some(ck)
            }
            _ => None,
        };
        comm.broadcast(model.params_mut()?, 0)?;

        // Step numbers go on from a resumed checkpoint's: a window outside this run's
        // steps would record nothing (every rank holds the same step, so all fail alike).
        let first_step = resumed.as_ref().map_or(0, |ck| ck.step) + 1;
        crate::timeline::check_window(cfg, first_step)?;
        let timeline = TrainTimeline::start(cfg, &mut control, &specs)?;
        let events = timeline.as_ref().map(TrainTimeline::sink);
        let strategy = match model.pipeline_stage() {
            Some((info, _)) => Strategy::Pipeline(PipelineUpdate::new(cfg, comm, info, &specs)?),
            None => Strategy::with_events(cfg, comm, &specs, events)?,
        };
        let run = &cfg.config().run;
        let mut optimizer = match model.device_resident() {
            Some(device) => {
                device.start_optimizer(run.optimizer, cfg.learning_rate())?;
                None
            }
            // A pipeline stage keeps the state of its own parameters only.
            None => Some(Optimizer::new(
                run.optimizer,
                cfg.learning_rate(),
                model
                    .pipeline_stage()
                    .map_or(n_params, |(info, _)| info.own_params().len()),
            )),
        };
        let fp16 = cfg.config().exchange.fp16_gradients;
        let mut host_scaler = fp16.then(LossScaler::default);
        let mut step = 0;
        let mut resume_note = None;
        let mut last_checkpoint = None;
        if let Some(ck) = resumed {
            let moved = batches.resume(&ck.input);
            let note = control.agree("to move the input to the checkpoint's position", moved)?;
            let path = output.checkpoint.as_deref().unwrap_or(Path::new(""));
            resume_note = Some(match note {
                Some(note) => format!(
                    "resumed from step {} of {}; {note}",
                    ck.step,
                    path.display()
                ),
                None => format!("resumed from step {} of {}", ck.step, path.display()),
            });
            step = ck.step;
            last_checkpoint = output.checkpoint.clone().map(|p| (p, ck.step));
            let state = strategy.own_optimizer_state(ck.optimizer)?;
            match (optimizer.as_mut(), model.device_resident()) {
                (Some(optimizer), _) => {
                    optimizer.load_state(state)?;
                    strategy.localize_optimizer_state(optimizer);
                }
                (None, Some(device)) => device.load_optimizer_state(state)?,
                (None, None) => return Err(no_optimizer()),
            }
            if fp16 {
                host_scaler = Some(ck.loss_scaler.unwrap_or_default());
            }
        }
        // A model that updates on its device keeps the loss scale there when it can.
        let on_device = match (host_scaler, model.device_resident()) {
            (Some(s), Some(device)) => device.start_loss_scaler(s)?,
            _ => false,
        };
        let scaler = match host_scaler {
            Some(_) if on_device => Some(LossScaling::Device),
            s => s.map(LossScaling::Host),
        };
        let batch_size = if cfg.is_worker(rank) {
            cfg.local_batch_size(cfg.data_worker(rank))
        } else {
            0
        };
        Ok(Session {
            cfg,
            rank,
            control,
            strategy,
            optimizer,
            scaler,
            step,
            batch_size,
            input: batches.position(),
            resumed: resume_note,
            last_checkpoint,
            timeline,
        })
    }

    /// Writes the checkpoint (rank 0) with the full optimizer state; every rank learns
    /// whether it worked.
    ///
    /// # Errors
    /// The write's error on rank 0, [`Error::OtherRanksFailed`] elsewhere; transport errors.
    pub(super) fn save_checkpoint(
        &mut self,
        path: &Path,
        model: &mut dyn TrainableModel,
    ) -> Result<()> {
        // The parameter servers gather their shards' state on every rank, pipeline
        // stages on rank 0 (a stage on its device downloads its own first); any other
        // model that updates on its device hands its own over on rank 0, the rank that
        // writes.
        let pipelined = model.pipeline_stage().is_some();
        let gathered = match (&self.optimizer, model.device_resident()) {
            (Some(optimizer), _) => Some(self.strategy.gather_optimizer_state(optimizer)?),
            (None, Some(device)) if pipelined => {
                device.download_params()?;
                let own = device.optimizer_state()?;
                Some(self.strategy.gather_stage_optimizer_state(own)?)
            }
            (None, _) => None,
        };
        // One position per data worker: the stages of a pipeline read alike.
        let input = self
            .control
            .gather(&self.input)?
            .into_iter()
            .step_by(self.cfg.pipeline_stages())
            .collect();
        // A pipeline's stages gather their parameters on rank 0 (every rank takes part); a
        // device-resident model that is no pipeline stage downloads its own there, below.
        let gathered_params = match model.device_resident() {
            Some(_) if !pipelined => None,
            _ => Some(self.strategy.gather_params(model.params()?)?),
        };
        let local = if self.rank == 0 {
            let loss_scaler = self.loss_scaler(model);
            let state = match (gathered, model.device_resident()) {
                (Some(state), _) => Ok(state),
                (None, Some(device)) => device
                    .download_params()
                    .and_then(|()| device.optimizer_state()),
                (None, None) => Err(no_optimizer()),
            };
            state.and_then(|state| {
                let params = match gathered_params {
                    Some(params) => params,
                    None => model.params()?.to_vec(),
                };
                Checkpoint {
                    config: self.cfg.config().clone(),
                    step: self.step,
                    params,
                    optimizer: state,
                    loss_scaler: loss_scaler?,
                    input,
                }
                .save(path)
            })
        } else {
            Ok(())
        };
        self.control.agree("to write the checkpoint", local)?;
        self.last_checkpoint = Some((path.to_path_buf(), self.step));
        Ok(())
    }

    /// The dynamic loss scale as it stands (downloaded when the device keeps it); `None`
    /// with f32 gradients.
    ///
    /// # Errors
    /// Device errors; [`Error::Internal`] when the device that keeps it is gone.
    pub(super) fn loss_scaler(&self, model: &mut dyn TrainableModel) -> Result<Option<LossScaler>> {
        match self.scaler {
            None => Ok(None),
            Some(LossScaling::Host(s)) => Ok(Some(s)),
            Some(LossScaling::Device) => model
                .device_resident()
                .ok_or_else(|| {
                    Error::Internal("the device that keeps the loss scale is gone".into())
                })?
                .loss_scaler(),
        }
    }

    /// The error for a stop by `signal` during `during`, naming the last good checkpoint.
    pub(super) fn interrupted(&self, signal: i32, during: String) -> Error {
        let checkpoint = match (&self.last_checkpoint, &self.cfg.config().output.checkpoint) {
            (Some((path, step)), _) => format!(
                "the last good checkpoint is `{}` (step {step})",
                path.display()
            ),
            (None, Some(path)) => format!(
                "no checkpoint was written (`{}` was not written by this run)",
                path.display()
            ),
            (None, None) => "no checkpoint was written (no --checkpoint was given)".to_string(),
        };
        Error::Interrupted {
            signal,
            during,
            checkpoint,
        }
    }
}
