//! One rank of a run from a config: threads, input pipeline, model, training, report.

use ringtrain_collective::Communicator;

use crate::config::TrainConfig;
use crate::device::{cpu_threads, LocalRank};
use crate::error::{Error, Result};
use crate::input::InputPipeline;
use crate::model_adapter::build_model;
use crate::trainer::{train, LogSink, TrainOutcome};

/// Runs one rank: picks the device from the local rank, sizes the CPU thread pools,
/// builds the input pipeline and the model, trains, and (on rank 0) writes the JSON report.
pub fn run_rank(
    cfg: &TrainConfig,
    comm: Communicator,
    local: Option<LocalRank>,
    log: &mut LogSink<'_>,
) -> Result<TrainOutcome> {
    cfg.validate()?;
    cfg.validate_for_world(comm.size())?;
    let (local_rank, local_size) = local.map_or((0, 1), |l| (l.rank, l.size));
    let threads = cpu_threads(cfg.threads, local_size);
    // The optimizer and casts use rayon's global pool; the model has its own.
    // An already-initialised pool (a second run in one process) is fine to keep.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let workers = cfg.worker_count(comm.size());
    let rank = comm.rank();
    if rank == 0 {
        let source = match local.map(|l| l.source) {
            Some(crate::device::LocalRankSource::Env(var)) => format!("from {var}"),
            Some(crate::device::LocalRankSource::SharedMemorySplit) => {
                "from the MPI shared-memory split".to_string()
            }
            Some(crate::device::LocalRankSource::Default) | None => "single process".to_string(),
        };
        log(&format!(
            "ringtrain: device {} {local_rank} (local rank {local_rank} of {local_size}, {source}), {threads} CPU thread(s) per rank, transport {}",
            cfg.device,
            comm.transport_name()
        ));
    }
    let is_worker = rank < workers;
    let (mut batches, src_vocab, tgt_vocab): (
        Box<dyn Iterator<Item = ringtrain_data::Result<_>>>,
        _,
        _,
    ) = if is_worker {
        let input = InputPipeline::new(cfg, rank, workers)?;
        let (s, t) = (input.src_vocab_size, input.tgt_vocab_size);
        (Box::new(input.batches), s, t)
    } else {
        // A dedicated parameter server reads no data but needs the vocabulary sizes:
        // it builds the pipeline of worker 0 only to learn them.
        let input = InputPipeline::new(cfg, 0, workers)?;
        let (s, t) = (input.src_vocab_size, input.tgt_vocab_size);
        drop(input);
        (Box::new(std::iter::empty()), s, t)
    };
    let mut model = build_model(cfg, src_vocab, tgt_vocab, local_rank, threads)?;
    let outcome = train(cfg, comm, model.as_mut(), &mut batches, log)?;
    if rank == 0 {
        if let Some(path) = &cfg.json_report {
            outcome.report.write_json(path)?;
        }
    }
    if outcome.report.words_per_sec.is_nan() {
        return Err(Error::RankMismatch("the run measured no words".into()));
    }
    Ok(outcome)
}
