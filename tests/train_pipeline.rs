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
    build_pipeline_stage, train, Batch, Checkpoint, EncoderType, ModelKind, OptimizerKind,
    OptimizerState, OverlapMode, TrainConfig, VariableUpdate,
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
        let mut model = build_pipeline_stage(&seeded, VOCAB, VOCAB, 0, 1, stage_comm)
            .expect("the stage builds");
        let mut data = batches(&run, run.data_worker(rank)).into_iter();
        let out = train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
        let report = &out.report;
        let resumed = if cfg.output.resume { STEPS as u64 } else { 0 };
        assert_eq!(report.steps, resumed + STEPS as u64);
        let pipeline = report
            .pipeline
            .as_ref()
            .expect("the report holds the pipeline");
        let k = cfg.exchange.pipeline_stages as f64;
        let m = cfg.exchange.micro_batches as f64;
        assert_eq!(pipeline.stages, cfg.exchange.pipeline_stages);
        assert!((pipeline.bubble_formula - (k - 1.0) / (m + k - 1.0)).abs() < 1e-12);
        assert_eq!(pipeline.per_stage.len(), ranks);
        assert!(
            (0.0..=1.0).contains(&pipeline.bubble_fraction),
            "{pipeline:?}"
        );
        // The batch's words are counted once, by the last stage.
        let timed = report.timed_batches as f64;
        let words = run.global_batch_size() as f64 * 2.0 * cfg.data.src_max_len as f64;
        if cfg.model.model == ModelKind::Nmt {
            assert_eq!(report.timed_words, timed * words, "{report:?}");
        }
        let (info, _) = model.pipeline_stage().expect("a pipeline stage");
        (info.own_params(), model.params().expect("params").to_vec())
    })
    .unwrap();
    let mut full = stages[0].1.clone();
    let k = cfg.exchange.pipeline_stages;
    for (rank, (range, params)) in stages.iter().enumerate() {
        if rank < k {
            full[range.clone()].copy_from_slice(&params[range.clone()]);
        } else {
            // The same stage of another replica holds the same parameters.
            let d = max_diff(&full[range.clone()], &params[range.clone()]);
            assert_eq!(
                d,
                0.0,
                "replica {} of stage {} diverged",
                rank / k,
                rank % k
            );
        }
    }
    full
}

/// Final parameters of one rank training on the whole batch (any step count: a resumed
/// run goes on from its checkpoint's step).
fn run_single(cfg: &TrainConfig) -> Vec<f32> {
    let run = cfg.validate(1).expect("a valid config");
    Communicator::run_local(1, |comm| {
        let mut model = initial_model(cfg, 100);
        let mut data = batches(&run, 0).into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
        model.params().expect("settled parameters").to_vec()
    })
    .unwrap()
    .remove(0)
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

/// K = 2 stages x D = 2 replicas: each stage all-reduces with the same stage of the
/// other replica (after backward, and overlapped through the fusion engine).
#[test]
fn two_stages_times_two_replicas_equal_one_rank() {
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let base = with(&config(model, VariableUpdate::Replicated), |c| {
            c.data.total_batch_size = Some(9);
            c.run.max_gradient_norm = 0.5;
        });
        let single = run(&base, 1);
        for overlap in [OverlapMode::Off, OverlapMode::On] {
            let hybrid = with(&base, |c| {
                c.exchange.pipeline_stages = 2;
                c.exchange.micro_batches = 2;
                c.exchange.overlap_backward = overlap;
                c.exchange.pipeline_schedule = PipelineSchedule::OneFOneB;
            });
            let d = max_diff(&run_pipeline(&hybrid, 4), &single[0]);
            assert!(d <= 1e-5, "{model} 2x2 ({overlap}) vs 1 rank differ by {d}");
        }
        // f16 on the wire between the replicas: close, not equal.
        let f16 = with(&base, |c| {
            c.exchange.pipeline_stages = 2;
            c.exchange.fp16_gradients = true;
        });
        let d = max_diff(&run_pipeline(&f16, 4), &single[0]);
        assert!(d <= 1e-2, "{model} 2x2 with f16 gradients differs by {d}");
    }
}

/// Checkpoints of a pipelined run hold every stage's parameters and optimizer state in
/// the unpipelined format: either kind of run resumes the other's.
#[test]
fn pipelined_and_unpipelined_checkpoints_resume_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let (single_ck, piped_ck) = (dir.path().join("single.ck"), dir.path().join("piped.ck"));
    let base = with(&config(ModelKind::Rnnlm, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 5;
        c.run.optimizer = OptimizerKind::Adam;
        c.run.learning_rate = Some(0.01);
    });
    let piped = |c: &mut TrainConfig| {
        c.exchange.pipeline_stages = 3;
        c.exchange.micro_batches = 2;
    };
    let single = run(
        &with(&base, |c| c.output.checkpoint = Some(single_ck.clone())),
        1,
    );
    let pipelined = run_pipeline(
        &with(&base, |c| {
            piped(c);
            c.output.checkpoint = Some(piped_ck.clone());
        }),
        3,
    );
    assert!(max_diff(&single[0], &pipelined) <= 1e-5);
    let a = Checkpoint::load(&single_ck).unwrap();
    let b = Checkpoint::load(&piped_ck).unwrap();
    assert!(
        max_diff(&a.params, &b.params) <= 1e-5,
        "the pipelined checkpoint lacks stages"
    );
    match (&a.optimizer, &b.optimizer) {
        (
            OptimizerState::Adam {
                m: m1,
                v: v1,
                step: s1,
            },
            OptimizerState::Adam {
                m: m2,
                v: v2,
                step: s2,
            },
        ) => {
            assert_eq!(s1, s2);
            assert!(max_diff(m1, m2) <= 1e-5 && max_diff(v1, v2) <= 1e-6);
        }
        other => panic!("Adam state expected: {other:?}"),
    }
    // Each resumes the other's checkpoint; both continue alike.
    let resume = |c: &mut TrainConfig, path: &std::path::Path| {
        c.output.checkpoint = Some(path.to_path_buf());
        c.output.resume = true;
    };
    let single_from_piped = run_single(&with(&base, |c| resume(c, &piped_ck)));
    let piped_from_single = run_pipeline(
        &with(&base, |c| {
            piped(c);
            resume(c, &single_ck);
        }),
        3,
    );
    let d = max_diff(&single_from_piped, &piped_from_single);
    assert!(d <= 1e-5, "resumed runs differ by {d}");
    assert!(
        max_diff(&single_from_piped, &single[0]) > 1e-4,
        "the resumed runs trained"
    );
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
            build_pipeline_stage(&run, VOCAB, VOCAB, 0, 1, stage_comm).expect("the stage builds");
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

/// The report of every rank of a pipelined run (ranks are threads).
fn pipeline_reports(cfg: &TrainConfig, ranks: usize) -> Vec<ringtrain::train::RunReport> {
    let run = cfg.validate(ranks).expect("a valid pipeline config");
    Communicator::run_local(ranks, |comm| {
        let stage_comm = comm.duplicate().expect("duplicate");
        let mut model =
            build_pipeline_stage(&run, VOCAB, VOCAB, 0, 1, stage_comm).expect("the stage builds");
        let mut data = batches(&run, run.data_worker(comm.rank())).into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {})
            .unwrap()
            .report
    })
    .unwrap()
}

/// 1F1B holds at most `min(K - stage, M)` micro-batches' activations on a stage, GPipe
/// all M: K = 2, M = 4 (equal micro-batches of 2 examples), both models.
#[test]
fn one_f_one_b_holds_fewer_activations_than_gpipe() {
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let base = with(&config(model, VariableUpdate::Replicated), |c| {
            c.data.batch_size = 8;
            c.exchange.pipeline_stages = 2;
            c.exchange.micro_batches = 4;
        });
        let peaks = |schedule: PipelineSchedule| {
            let report =
                pipeline_reports(&with(&base, |c| c.exchange.pipeline_schedule = schedule), 2)
                    .remove(0);
            let pipeline = report.pipeline.expect("the report holds the pipeline");
            let mut stages: Vec<(usize, usize, f64)> = pipeline
                .per_stage
                .iter()
                .map(|f| (f.stage, f.peak_activation_slots, f.peak_activation_bytes))
                .collect();
            stages.sort_by_key(|s| s.0);
            assert_eq!(
                pipeline.peak_activation_slots,
                stages.iter().map(|s| s.1).max().unwrap_or(0)
            );
            stages
        };
        let gpipe = peaks(PipelineSchedule::Gpipe);
        let one_f_one_b = peaks(PipelineSchedule::OneFOneB);
        let slots = |p: &[(usize, usize, f64)]| p.iter().map(|s| s.1).collect::<Vec<_>>();
        assert_eq!(slots(&gpipe), [4, 4], "{model} gpipe");
        assert_eq!(slots(&one_f_one_b), [2, 1], "{model} 1f1b");
        for (g, o) in gpipe.iter().zip(&one_f_one_b) {
            assert!(
                o.2 > 0.0,
                "{model}: the stage's activation bytes are counted"
            );
            let ratio = g.2 / o.2;
            let expected = g.1 as f64 / o.1 as f64;
            assert!(
                (ratio - expected).abs() < 1e-9,
                "{model} stage {}: bytes ratio {ratio} vs slots ratio {expected}",
                g.0
            );
        }
    }
}

/// Each stage's optimizer keeps the state of its own parameters only (Adam's m and v
/// the length of its range), and the ranges cover the model once.
#[test]
fn a_stage_keeps_optimizer_state_for_its_own_range_only() {
    let cfg = with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 4;
        c.run.optimizer = OptimizerKind::Adam;
        c.run.learning_rate = Some(0.01);
        c.exchange.pipeline_stages = 3;
        c.exchange.micro_batches = 2;
    });
    let whole = with(&cfg, |c| {
        c.exchange.pipeline_stages = 1;
        c.exchange.micro_batches = 1;
    });
    let total = initial_model(&whole, 100).params().expect("settled").len();
    let run = cfg.validate(3).expect("valid");
    let per_stage = Communicator::run_local(3, |comm| {
        let stage_comm = comm.duplicate().expect("duplicate");
        let mut model =
            build_pipeline_stage(&run, VOCAB, VOCAB, 0, 1, stage_comm).expect("the stage builds");
        let mut data = batches(&run, 0).into_iter();
        let report = train(&run, comm, model.as_mut(), &mut data, &mut |_| {})
            .unwrap()
            .report;
        let (info, _) = model.pipeline_stage().expect("a stage");
        let figures = report.pipeline.expect("pipeline").per_stage;
        let mine = figures
            .iter()
            .find(|f| f.stage == info.stage)
            .expect("this stage's figures")
            .optimizer_state_elements;
        (info.own_params().len(), mine)
    })
    .unwrap();
    for (stage, (range, elements)) in per_stage.iter().enumerate() {
        assert_eq!(elements, &Some(*range), "stage {stage}");
        assert!(*range < total, "stage {stage} owns part of the model");
    }
    assert_eq!(per_stage.iter().map(|s| s.0).sum::<usize>(), total);
}

/// `--pipeline-balance time`: rank 0 times the units, every stage takes the same split
/// (stages that disagreed would exchange tensors of the wrong size and fail), and the
/// run still computes the unpipelined update.
#[test]
fn a_split_balanced_by_measured_time_equals_one_rank() {
    use ringtrain::train::config::PipelineBalance;
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let base = with(&config(model, VariableUpdate::Replicated), |c| {
            c.data.batch_size = 4;
        });
        let single = run(&base, 1);
        let timed = with(&base, |c| {
            c.exchange.pipeline_stages = 3;
            c.exchange.micro_batches = 2;
            c.exchange.pipeline_balance = PipelineBalance::Time;
        });
        let d = max_diff(&run_pipeline(&timed, 3), &single[0]);
        assert!(d <= 1e-5, "{model} balanced by time differs by {d}");
        let report = pipeline_reports(&timed, 3).remove(0);
        assert!(
            report.strategy.contains("balanced by measured time"),
            "{}",
            report.strategy
        );
    }
}
