//! One rank of a run from a validated config: threads, input pipeline, model, training,
//! report.

use ringtrain_collective::Communicator;
use ringtrain_kernels::gemm_bf16::{Bf16Path, KernelTimes};
use ringtrain_model::GemmPrecision;

use crate::config::ValidatedConfig;
use crate::device::{cpu_threads, LocalRank, LocalRankSource};
use crate::error::{Error, Result};
use crate::input::{BatchSource, InputPipeline};
use crate::report::HostFigures;
use crate::trainable::{build_model, build_pipeline_stage, check_memory, plan_memory, MemoryPlan};
use crate::trainer::{train_evaluating, LogSink, TrainOutcome};

/// Runs one rank: picks the device from the local rank, sizes the CPU thread pools,
/// builds the input pipeline and the model, trains, and (on rank 0) writes the JSON report.
///
/// # Errors
/// Everything setting up or training can fail with.
pub fn run_rank(
    cfg: &ValidatedConfig,
    comm: Communicator,
    local: LocalRank,
    log: &mut LogSink<'_>,
) -> Result<TrainOutcome> {
    // Every collective from here on, the control plane's included, waits at most this.
    comm.set_stall_timeout(cfg.stall_timeout());
    let threads = cpu_threads(cfg.config().run.threads, local.size);
    // The optimizer and casts use rayon's global pool; the model has its own.
    // An already-initialised pool (a second run in one process) is fine to keep.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let rank = comm.rank();
    if rank == 0 {
        let source = match local.source {
            LocalRankSource::Env(var) => format!("from {var}"),
            LocalRankSource::SharedMemorySplit => "from the MPI shared-memory split".to_string(),
            LocalRankSource::Default => "single process".to_string(),
        };
        log(&format!(
            "ringtrain: device {} {} (local rank {} of {}, {source}), {threads} CPU thread(s) per rank, transport {}",
            cfg.config().run.device,
            local.rank,
            local.rank,
            local.size,
            comm.transport_name()
        ));
        let run = &cfg.config().run;
        if run.device == crate::DeviceKind::Cpu && run.gemm_precision == GemmPrecision::Bf16 {
            log(&format!(
                "ringtrain: {}",
                bf16_path_note(Bf16Path::detect(), Bf16Path::avx512_times())
            ));
        }
    }
    // The pipeline's thread starts at the first batch, after a resume has moved it
    // and after the memory check below.
    let InputPipeline {
        notes,
        mut batches,
        src_vocab_size,
        tgt_vocab_size,
        held_out,
    } = input_of(cfg, rank)?;
    if rank == 0 {
        for note in notes {
            log(&format!("ringtrain: {note}"));
        }
    }
    let mut no_batches = std::iter::empty();
    let source: &mut dyn BatchSource = if cfg.is_worker(rank) {
        &mut batches
    } else {
        &mut no_batches
    };
    let device_estimate = check_memory(
        cfg,
        src_vocab_size,
        tgt_vocab_size,
        cfg.data_worker(rank),
        &local,
    )?;
    let mut model = if cfg.is_pipelined() {
        // The stages' activations travel on a communicator of their own.
        let stage_comm = comm.duplicate()?;
        build_pipeline_stage(
            cfg,
            src_vocab_size,
            tgt_vocab_size,
            local.rank,
            threads,
            stage_comm,
        )?
    } else {
        build_model(cfg, src_vocab_size, tgt_vocab_size, local.rank, threads)?
    };
    // A dedicated parameter server holds no part of the held-out set either.
    let held_out = held_out.filter(|_| cfg.is_worker(rank));
    let mut outcome = train_evaluating(cfg, comm, model.as_mut(), source, held_out.as_ref(), log)?;
    outcome.report.estimated_device_bytes = device_estimate;
    // What the scaling model needs to know whether the ranks shared the cores.
    outcome.report.host = Some(HostFigures {
        cores: crate::device::node_cores(),
        threads_per_rank: threads,
        ranks_on_node: local.size,
    });
    if rank == 0 {
        if let Some(path) = &cfg.config().output.json_report {
            outcome.report.write_json(path)?;
        }
    }
    // A run stopped at its target perplexity during the warm-up timed no batch.
    let stopped_early = outcome
        .report
        .time_to_quality
        .is_some_and(|q| q.reached && outcome.report.timed_batches == 0);
    if outcome.report.words_per_sec.is_nan() && !stopped_early {
        return Err(Error::Internal("the run measured no words".into()));
    }
    Ok(outcome)
}

/// Rank `rank`'s input pipeline. A dedicated parameter server reads no data but needs the
/// vocabulary sizes: it builds worker 0's pipeline only to learn them.
fn input_of(cfg: &ValidatedConfig, rank: usize) -> Result<InputPipeline> {
    let worker = if cfg.is_worker(rank) {
        cfg.data_worker(rank)
    } else {
        0
    };
    InputPipeline::new(cfg, worker)
}

/// `--dry-run` for one rank: reads its input (for the vocabularies) and plans its memory
/// at its batch size ([`MemoryPlan`]); trains nothing.
///
/// # Errors
/// The input pipeline's (unreadable corpora or vocabularies), a model too big to address,
/// GPU errors.
pub fn plan_rank(cfg: &ValidatedConfig, rank: usize, local: &LocalRank) -> Result<MemoryPlan> {
    let input = input_of(cfg, rank)?;
    plan_memory(
        cfg,
        input.src_vocab_size,
        input.tgt_vocab_size,
        cfg.data_worker(rank),
        local,
    )
}

/// What `--gemm-precision bf16` on the CPU does here: the bf16 matrix-product path this
/// CPU takes (with the kernel times that chose it, where it was chosen by timing), and
/// what to expect of it where the CPU has no bf16 instruction or a slow one.
pub(crate) fn bf16_path_note(path: Bf16Path, times: Option<KernelTimes>) -> String {
    let widened = "this CPU has no bf16 instruction: the operands are widened to f32, so the \
                   products run at about f32's speed";
    let expect = match (path, times) {
        (Bf16Path::Avx512Bf16, Some(t)) => format!(
            "bf16 instructions: their kernel took {:.2} µs per block here, f32 multiply-adds \
             of the widened operands {:.2} µs",
            t.avx512_bf16_ns / 1e3,
            t.avx512_fma_ns / 1e3
        ),
        (Bf16Path::Avx512Fma, Some(t)) => format!(
            "this CPU's bf16 instruction (VDPBF16PS) is slower than f32 multiply-adds: its \
             kernel took {:.2} µs per block here against {:.2} µs, so the operands are \
             widened to f32 and the products run at about f32's speed",
            t.avx512_bf16_ns / 1e3,
            t.avx512_fma_ns / 1e3
        ),
        (Bf16Path::Amx | Bf16Path::Avx512Bf16, _) => "bf16 instructions".to_string(),
        (Bf16Path::Avx2Fma | Bf16Path::Avx512Fma, _) => widened.to_string(),
        (Bf16Path::Portable, _) => "this CPU has neither bf16 instructions nor AVX2 and FMA: \
             the products are several times slower than in f32; --gemm-precision f32 is \
             faster here"
            .to_string(),
    };
    format!(
        "matrix products in bf16 on the `{}` path ({expect})",
        path.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bf16_note_names_the_path_and_what_a_path_without_bf16_instructions_costs() {
        for path in Bf16Path::ALL {
            let note = bf16_path_note(path, None);
            assert!(note.contains(&format!("`{}`", path.name())), "{note}");
            let slower = note.contains("no bf16 instruction") || note.contains("neither");
            assert_eq!(
                slower,
                matches!(
                    path,
                    Bf16Path::Avx2Fma | Bf16Path::Avx512Fma | Bf16Path::Portable
                ),
                "{note}"
            );
        }
        assert!(bf16_path_note(Bf16Path::Portable, None).contains("--gemm-precision f32"));
    }

    #[test]
    fn a_path_chosen_by_timing_is_noted_with_both_kernels_times() {
        let times = KernelTimes {
            avx512_bf16_ns: 1673.0,
            avx512_fma_ns: 970.0,
        };
        let fma = bf16_path_note(times.choice(), Some(times));
        assert!(fma.contains("`avx512-fma`"), "{fma}");
        assert!(fma.contains("VDPBF16PS) is slower"), "{fma}");
        assert!(fma.contains("1.67 µs") && fma.contains("0.97 µs"), "{fma}");
        let bf16 = bf16_path_note(Bf16Path::Avx512Bf16, Some(times));
        assert!(bf16.contains("`avx512-bf16`") && bf16.contains("bf16 instructions"));
        assert!(
            bf16.contains("1.67 µs") && !bf16.contains("slower"),
            "{bf16}"
        );
    }
}
