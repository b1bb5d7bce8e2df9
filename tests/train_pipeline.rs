//! Pipeline parallelism must not change the mathematics: K stages × M micro-batches end
//! with the parameters of 1 rank training on the whole batch (both models, both
//! schedules, fused and stepwise, an odd M that does not divide the batch), and a stage
//! that fails ends every stage with an error instead of a hang. Ranks are threads over
//! the collective's local transport.

mod training_runs;

use std::time::{Duration, Instant};

use ringtrain::collective::Communicator;
use ringtrain::train::config::PipelineSchedule;
use ringtrain::train::{
    build_pipeline_stage, train, Batch, EncoderType, ModelKind, OptimizerKind, TrainConfig,
    VariableUpdate,
};
use training_runs::{batches, config, initial_model, max_diff, run, with, STEPS, VOCAB};

/// Final parameters of a pipelined run over `ranks` threads, each stage's own range
/// taken from that stage.
fn run_pipeline(cfg: &TrainConfig, ranks: usize) -> Vec<f32> {
    let run = cfg.validate(ranks).expect("a valid pipeline config");
    let stages = Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        let seeded = with(cfg, |c| c.run.seed = 100 + rank as u64)
            .validate(ranks)
            .expect("valid");
        let stage_comm = comm.duplicate().expect("duplicate");
        let mut model =
            build_pipeline_stage(&seeded, VOCAB, VOCAB, 1, stage_comm).expect("the stage builds");
        let mut data = batches(&run, run.data_worker(rank)).into_iter();
        let out = train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
        assert_eq!(out.report.steps as usize, STEPS);
        let (info, _) = model.pipeline_stage().expect("a pipeline stage");
        (info.own_params(), model.params().expect("params").to_vec())
    })
    .unwrap();
    let mut full = stages[0].1.clone();
    for (range, params) in &stages {
        full[range.clone()].copy_from_slice(&params[range.clone()]);
    }
    full
}

fn check(model: ModelKind, stages: usize, adam: bool) {
    let base = with(&config(model, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 7;
        if adam {
            c.run.optimizer = OptimizerKind::Adam;
            c.run.learning_rate = Some(0.01);
            // Small enough that clipping acts: the norm must be the global one.
            c.run.max_gradient_norm = 0.5;
        }
    });
    for lstm in [EncoderType::Fused, EncoderType::Stepwise] {
        let whole = with(&base, |c| c.model.encoder_type = lstm);
        let single = run(&whole, 1);
        for schedule in [PipelineSchedule::Gpipe, PipelineSchedule::OneFOneB] {
            let piped = with(&whole, |c| {
                c.exchange.pipeline_stages = stages;
                c.exchange.micro_batches = 3;
                c.exchange.pipeline_schedule = schedule;
            });
            let params = run_pipeline(&piped, stages);
            let d = max_diff(&params, &single[0]);
            assert!(
                d <= 1e-5,
                "{model} {lstm} {schedule} {stages} stages x 3 micro-batches vs 1 rank differ by {d}"
            );
        }
    }
    let start = initial_model(&base, 100);
    assert!(
        max_diff(start.params().expect("settled"), &run(&base, 1)[0]) > 1e-3,
        "{model}: training did not change the parameters"
    );
}

#[test]
fn nmt_two_stages_equal_one_rank_with_the_whole_batch() {
    check(ModelKind::Nmt, 2, false);
}

#[test]
fn rnnlm_two_stages_equal_one_rank_with_the_whole_batch() {
    check(ModelKind::Rnnlm, 2, false);
}

#[test]
fn three_stages_with_adam_and_global_clipping_equal_one_rank() {
    check(ModelKind::Nmt, 3, true);
    check(ModelKind::Rnnlm, 3, true);
}

#[test]
fn a_split_by_hand_equals_one_rank() {
    let base = with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 4
    });
    let single = run(&base, 1);
    let piped = with(&base, |c| {
        c.exchange.pipeline_stages = 2;
        c.exchange.micro_batches = 2;
        c.exchange.pipeline_split = vec![1, 3];
    });
    let d = max_diff(&run_pipeline(&piped, 2), &single[0]);
    assert!(d <= 1e-5, "split 1,3 differs by {d}");
}

#[test]
fn a_failing_stage_ends_every_stage_with_an_error() {
    let cfg = with(&config(ModelKind::Rnnlm, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 4;
        c.exchange.pipeline_stages = 2;
        c.exchange.micro_batches = 2;
        // The backstop: a stage left waiting gives up after this long.
        c.exchange.stall_timeout = 20.0;
    });
    let run = cfg.validate(2).expect("valid");
    let started = Instant::now();
    let results = Communicator::run_local(2, |comm| {
        let rank = comm.rank();
        comm.set_stall_timeout(run.stall_timeout());
        let stage_comm = comm.duplicate().expect("duplicate");
        let mut model =
            build_pipeline_stage(&run, VOCAB, VOCAB, 1, stage_comm).expect("the stage builds");
        let mut data: Vec<ringtrain::data::Result<Batch>> = batches(&run, 0);
        if rank == 1 {
            // The last stage's second batch is for the other model: its step fails.
            let nmt = with(&cfg, |c| {
                c.model.model = ModelKind::Nmt;
                c.exchange.pipeline_stages = 1;
                c.exchange.micro_batches = 1;
            })
            .validate(1)
            .expect("valid");
            data[1] = batches(&nmt, 0).remove(1);
        }
        let mut data = data.into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {})
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the stages hung: {results:?}"
    );
    let last = results[1].as_deref().unwrap_or("no error");
    assert!(last.contains("--model"), "{last}");
    let first = results[0].as_deref().unwrap_or("no error");
    assert!(
        first.contains("rank 1"),
        "stage 0 must name the stage it lost: {first}"
    );
}
