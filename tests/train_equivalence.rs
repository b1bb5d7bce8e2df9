//! Data parallelism must not change the mathematics: N ranks × batch B with replicated
//! averaging and SGD end with the parameters of 1 rank × batch N·B (NMT and RNNLM), and
//! the parameter-server strategy ends where replicated does. Ranks are threads over the
//! collective's local transport.

mod training_runs;

use ringtrain::train::{ModelKind, OverlapMode, VariableUpdate};
use training_runs::{config, initial_model, max_diff, run, with};

fn check_data_parallel(model: ModelKind) {
    let per_rank = with(&config(model, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 3
    });
    let single = run(&with(&per_rank, |c| c.data.batch_size = 6), 1);
    for overlap_backward in [OverlapMode::Off, OverlapMode::On] {
        let ranks = run(
            &with(&per_rank, |c| {
                c.exchange.overlap_backward = overlap_backward
            }),
            2,
        );
        assert_eq!(max_diff(&ranks[0], &ranks[1]), 0.0, "replicas diverged");
        let d = max_diff(&ranks[0], &single[0]);
        assert!(
            d <= 1e-5,
            "{model}: 2 ranks x 3 vs 1 rank x 6 differ by {d} (overlap {overlap_backward})"
        );
    }
    // The run must have moved the parameters for the comparison to mean anything.
    let start = initial_model(&per_rank, 100);
    assert!(
        max_diff(start.params().expect("settled"), &single[0]) > 1e-3,
        "{model}: training did not change the parameters"
    );
}

#[test]
fn nmt_two_ranks_equal_one_rank_with_the_whole_batch() {
    check_data_parallel(ModelKind::Nmt);
}

#[test]
fn rnnlm_two_ranks_equal_one_rank_with_the_whole_batch() {
    check_data_parallel(ModelKind::Rnnlm);
}

#[test]
fn nmt_uneven_total_batch_over_three_ranks_equals_one_rank() {
    let cfg = with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
        c.data.total_batch_size = Some(7)
    });
    let ranks = run(&cfg, 3); // 3, 2, 2
    let single = run(&cfg, 1);
    let d = max_diff(&ranks[2], &single[0]);
    assert!(
        d <= 1e-5,
        "total batch 7 over 3 ranks vs 1 rank differ by {d}"
    );
}

#[test]
fn parameter_server_gives_the_parameters_replicated_gives() {
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let repl = with(&config(model, VariableUpdate::Replicated), |c| {
            c.data.batch_size = 2
        });
        let a = run(&repl, 2);
        let b = run(
            &with(&repl, |c| {
                c.exchange.variable_update = VariableUpdate::ParameterServer
            }),
            2,
        );
        let d = max_diff(&a[0], &b[1]);
        assert!(
            d <= 1e-5,
            "{model}: parameter_server vs replicated differ by {d}"
        );
    }
}
