//! `--resume` is a true continuation: K steps, a checkpoint, then K more steps resumed
//! from it end with the bits of 2K uninterrupted steps (parameters, optimizer state, loss
//! scale and every rank's input position), for SGD and Adam, `replicated` and
//! `parameter_server`, on synthetic data and on the shipped corpora. The RNNLM's carried
//! LSTM state is not checkpointed (a resumed run starts its next window from zeros), so
//! an RNNLM resume is exact at an epoch boundary, where the state resets anyway, and
//! otherwise continues the input exactly with other parameters. At another rank count the
//! input follows the documented rule. Ranks are threads over the collective's
//! local transport, driven through `run_rank` with the real input pipeline (prefetch
//! thread included).

use std::path::{Path, PathBuf};

use ringtrain_collective::Communicator;
use std::sync::Arc;

use ringtrain_data::{
    BatchSizing, BundledCorpus, EpochPosition, LmBatcher, LmCorpus, SyntheticPosition, Vocab,
};
use ringtrain_train::{
    local_rank, run_rank, Checkpoint, InputKind, InputPosition, ModelKind, OptimizerKind,
    RunReport, StreamPosition, TrainConfig, VariableUpdate,
};

#[derive(Clone, Copy, Debug)]
enum Data {
    Synthetic,
    Corpus,
}

fn config(
    model: ModelKind,
    data: Data,
    optimizer: OptimizerKind,
    update: VariableUpdate,
) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.model = model;
    cfg.model.num_units = 8;
    cfg.exchange.variable_update = update;
    cfg.run.optimizer = optimizer;
    cfg.run.threads = 1;
    cfg.run.seed = 3;
    cfg.output.display_every = 1;
    cfg.data.src_max_len = 6;
    let files = BundledCorpus::in_repo();
    match (data, model) {
        (Data::Synthetic, _) => {
            cfg.data.vocab_size = 30;
            cfg.data.batch_size = 4;
        }
        (Data::Corpus, ModelKind::Nmt) => {
            // Sentences cut to 6 tokens share one bucket: 300 pairs per rank make three
            // shuffled batches an epoch (128, 128, 44), so the runs cross epochs.
            cfg.data.batch_size = 128;
            cfg.data.data = vec![
                files.nmt_train_src,
                files.nmt_train_tgt,
                files.nmt_vocab_src,
                files.nmt_vocab_tgt,
            ];
        }
        (Data::Corpus, ModelKind::Rnnlm) => {
            cfg.data.batch_size = 8;
            cfg.data.data = vec![files.lm_train, files.lm_vocab];
        }
    }
    cfg
}

/// `cfg` for `steps` steps (one of them warm-up) writing `checkpoint`.
fn part(cfg: &TrainConfig, steps: usize, checkpoint: &Path, resume: bool) -> TrainConfig {
    let mut cfg = cfg.clone();
    cfg.run.warmup_batches = 1;
    cfg.run.timed_batches = steps - 1;
    cfg.output.checkpoint = Some(checkpoint.to_path_buf());
    cfg.output.resume = resume;
    cfg
}

/// Runs `cfg` on `ranks` ranks: rank 0's log lines and the report.
fn run(cfg: &TrainConfig, ranks: usize) -> (Vec<String>, RunReport) {
    let cfg = cfg.validate(ranks).expect("a valid test config");
    let mut results = Communicator::run_local(ranks, |comm| {
        let local = local_rank(&comm)?;
        let mut lines = Vec::new();
        let outcome = run_rank(&cfg, comm, local, &mut |line| lines.push(line.to_string()))?;
        Ok::<_, ringtrain_train::Error>((lines, outcome.report))
    })
    .expect("the local transport runs");
    results.remove(0).expect("rank 0 trains")
}

/// Everything of a checkpoint but the flags that wrote it.
fn state(path: &Path) -> (u64, Vec<u32>, String, Vec<Option<InputPosition>>) {
    let ck = Checkpoint::load(path).expect("a checkpoint");
    let bits = ck.params.iter().map(|x| x.to_bits()).collect();
    let optimizer = format!("{:?}", ck.optimizer);
    (ck.step, bits, optimizer, ck.input)
}

fn check_continuation(
    model: ModelKind,
    data: Data,
    optimizer: OptimizerKind,
    update: VariableUpdate,
) {
    let base = config(model, data, optimizer, update);
    check_continuation_of(&base, 4);
}

/// K steps and K more resumed end with the bits of 2K uninterrupted steps.
fn check_continuation_of(base: &TrainConfig, k: usize) {
    let (model, optimizer, update) = (
        base.model.model,
        base.run.optimizer,
        base.exchange.variable_update,
    );
    let what = format!("{model} {optimizer} {update} {} steps", 2 * k);
    let dir = tempfile::tempdir().unwrap();
    let straight: PathBuf = dir.path().join("straight.ckpt");
    let split: PathBuf = dir.path().join("split.ckpt");
    let base = base.clone();
    #[allow(non_snake_case)]
    let K = k;

    let (_, whole) = run(&part(&base, 2 * K, &straight, false), 2);
    let (_, first) = run(&part(&base, K, &split, false), 2);
    assert_eq!(first.steps, K as u64, "{what}");
    let halfway = state(&split);
    let (lines, second) = run(&part(&base, K, &split, true), 2);

    let expected = format!("resumed from step {K} of {}", split.display());
    assert!(
        lines.iter().any(|l| l.contains(&expected)),
        "{what}: no line says {expected:?}:\n{}",
        lines.join("\n")
    );
    // Step numbers go on from the checkpoint; warm-up and timing are this process's.
    assert_eq!(second.steps, 2 * K as u64, "{what}");
    assert_eq!(second.timed_batches, K - 1, "{what}");
    assert!(
        lines
            .iter()
            .any(|l| l.trim_start().starts_with(&format!("{}\t", 2 * K))),
        "{what}: no progress line for step {}:\n{}",
        2 * K,
        lines.join("\n")
    );

    let (a, b) = (state(&straight), state(&split));
    assert_eq!(a.0, b.0, "{what}: steps");
    assert!(
        a.1 == b.1,
        "{what}: parameters differ from the uninterrupted run"
    );
    assert_eq!(a.2, b.2, "{what}: optimizer state differs");
    assert_eq!(a.3, b.3, "{what}: input positions");
    // The comparison means something only if training moved on after the checkpoint.
    assert!(
        halfway.1 != b.1,
        "{what}: the resumed steps changed nothing"
    );
    assert_eq!(
        whole.final_loss.to_bits(),
        second.final_loss.to_bits(),
        "{what}: final loss"
    );
}

#[test]
fn nmt_synthetic_resume_continues_exactly() {
    for optimizer in [OptimizerKind::Sgd, OptimizerKind::Adam] {
        for update in [VariableUpdate::Replicated, VariableUpdate::ParameterServer] {
            check_continuation(ModelKind::Nmt, Data::Synthetic, optimizer, update);
        }
    }
}

#[test]
fn nmt_corpus_resume_continues_exactly_across_epochs() {
    for optimizer in [OptimizerKind::Sgd, OptimizerKind::Adam] {
        for update in [VariableUpdate::Replicated, VariableUpdate::ParameterServer] {
            check_continuation(ModelKind::Nmt, Data::Corpus, optimizer, update);
        }
    }
}

/// The shipped LM text in 2 x 256 columns: a few windows an epoch.
fn short_epoch_lm(optimizer: OptimizerKind, update: VariableUpdate) -> (TrainConfig, usize) {
    let mut cfg = config(ModelKind::Rnnlm, Data::Corpus, optimizer, update);
    cfg.data.batch_size = 256;
    let files = BundledCorpus::in_repo();
    let vocab = Vocab::lm_from_file(&files.lm_vocab).expect("the shipped vocabulary");
    let corpus = LmCorpus::load(&files.lm_train, &vocab).expect("the shipped text");
    let batcher = LmBatcher::new(
        Arc::new(corpus),
        BatchSizing::PerRank(256),
        cfg.data.src_max_len,
        0,
        2,
    )
    .expect("a batcher");
    (cfg, batcher.batches_per_epoch())
}

#[test]
fn rnnlm_resume_at_an_epoch_boundary_continues_exactly() {
    let (cfg, windows) = short_epoch_lm(OptimizerKind::Adam, VariableUpdate::Replicated);
    assert!((2..=12).contains(&windows), "{windows} windows an epoch");
    check_continuation_of(&cfg, windows);
}

/// Mid-epoch, the resumed run starts its window from zeros where the uninterrupted one
/// carried its state: the input continues exactly, the parameters differ.
#[test]
fn rnnlm_resume_mid_epoch_starts_the_state_from_zeros() {
    for (data, optimizer, update) in [
        (
            Data::Corpus,
            OptimizerKind::Adam,
            VariableUpdate::Replicated,
        ),
        (
            Data::Synthetic,
            OptimizerKind::Sgd,
            VariableUpdate::ParameterServer,
        ),
    ] {
        const K: usize = 4;
        let what = format!("{data:?} {optimizer} {update}");
        let dir = tempfile::tempdir().unwrap();
        let straight: PathBuf = dir.path().join("straight.ckpt");
        let split: PathBuf = dir.path().join("split.ckpt");
        let base = config(ModelKind::Rnnlm, data, optimizer, update);
        run(&part(&base, 2 * K, &straight, false), 2);
        run(&part(&base, K, &split, false), 2);
        let (_, second) = run(&part(&base, K, &split, true), 2);
        assert_eq!(second.steps, 2 * K as u64, "{what}");
        let (a, b) = (state(&straight), state(&split));
        assert_eq!(a.0, b.0, "{what}: steps");
        assert_eq!(a.3, b.3, "{what}: input positions");
        assert!(a.1 != b.1, "{what}: the carried state was restored");
    }
}

fn epoch_of(p: &Option<InputPosition>) -> EpochPosition {
    match p {
        Some(InputPosition {
            stream: StreamPosition::Epoch(e),
            ..
        }) => *e,
        other => panic!("expected a corpus position, found {other:?}"),
    }
}

fn synthetic_of(p: &Option<InputPosition>) -> SyntheticPosition {
    match p {
        Some(InputPosition {
            stream: StreamPosition::Synthetic(s),
            ..
        }) => *s,
        other => panic!("expected a synthetic position, found {other:?}"),
    }
}

#[test]
fn at_another_rank_count_a_corpus_restarts_its_epoch_with_new_shards() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.ckpt");
    let base = config(
        ModelKind::Nmt,
        Data::Corpus,
        OptimizerKind::Adam,
        VariableUpdate::Replicated,
    );
    // 2 ranks x 4 steps: 3 batches an epoch, so the checkpoint is in epoch 1, batch 1.
    run(&part(&base, 4, &path, false), 2);
    let saved = Checkpoint::load(&path).unwrap().input;
    assert_eq!(saved.len(), 2);
    assert_eq!(epoch_of(&saved[0]), EpochPosition { epoch: 1, batch: 1 });
    assert_eq!(saved[1].unwrap().kind, InputKind::Translation);

    // 1 rank: 600 pairs of one bucket in batches of 128 make 5 batches an epoch; two steps
    // from the start of epoch 1 end at epoch 1, batch 2.
    let (lines, report) = run(&part(&base, 2, &path, true), 1);
    let log = lines.join("\n");
    assert!(
        log.contains("resumed from step 4")
            && log.contains("2 worker(s)")
            && log.contains("epoch 1 restarts from its first batch"),
        "{log}"
    );
    assert_eq!(report.steps, 6);
    let after = Checkpoint::load(&path).unwrap().input;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].unwrap().workers, 1);
    assert_eq!(epoch_of(&after[0]), EpochPosition { epoch: 1, batch: 2 });
}

#[test]
fn at_another_rank_count_synthetic_ranks_continue_their_own_streams() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.ckpt");
    let base = config(
        ModelKind::Nmt,
        Data::Synthetic,
        OptimizerKind::Sgd,
        VariableUpdate::Replicated,
    );
    run(&part(&base, 3, &path, false), 2);
    let (lines, _) = run(&part(&base, 2, &path, true), 3);
    assert!(
        lines
            .join("\n")
            .contains("each rank continues its own synthetic stream"),
        "{}",
        lines.join("\n")
    );
    let after = Checkpoint::load(&path).unwrap().input;
    let batches: Vec<u64> = after.iter().map(|p| synthetic_of(p).batches).collect();
    assert_eq!(batches, [5, 5, 2], "ranks 0 and 1 continue, rank 2 starts");
}

#[test]
fn another_seed_restarts_the_epoch_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.ckpt");
    let base = config(
        ModelKind::Nmt,
        Data::Corpus,
        OptimizerKind::Sgd,
        VariableUpdate::Replicated,
    );
    run(&part(&base, 4, &path, false), 2);
    let mut reseeded = part(&base, 2, &path, true);
    reseeded.run.seed += 1;
    let (lines, _) = run(&reseeded, 2);
    let log = lines.join("\n");
    assert!(
        log.contains("another --seed") && log.contains("epoch 1 restarts"),
        "{log}"
    );
    let after = Checkpoint::load(&path).unwrap().input;
    assert_eq!(epoch_of(&after[1]), EpochPosition { epoch: 1, batch: 2 });
}
