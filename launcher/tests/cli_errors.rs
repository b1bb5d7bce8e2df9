//! The `ringtrain` command's user errors: each names the flag and the value.

use std::process::{Command, Output};

/// Runs `ringtrain` with `args`. Each run gets a temporary directory of its own: a run
/// that starts MPI as a singleton has Open MPI create its session directory there, and
/// tests running side by side would otherwise race to create and remove the one they
/// share (`/tmp/ompi.<host>.<uid>`: "unable to create the desired directory ... File
/// exists").
fn ringtrain(args: &[&str]) -> Output {
    let tmp = tempfile::tempdir().expect("a temporary directory");
    Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args(args)
        .env("RUST_LOG", "off")
        .env("TMPDIR", tmp.path())
        .output()
        .expect("the ringtrain binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const TINY: &[&str] = &[
    "--num-units",
    "8",
    "--vocab-size",
    "50",
    "--src-max-len",
    "4",
    "--warmup-batches",
    "1",
    "--timed-batches",
    "2",
    "--threads",
    "1",
];

fn train(extra: &[&str]) -> Output {
    let mut args = vec!["train"];
    args.extend_from_slice(TINY);
    args.extend_from_slice(extra);
    ringtrain(&args)
}

#[test]
fn bad_flag_values_name_the_flag_and_the_value() {
    for (flag, value) in [
        ("--model", "transformer"),
        ("--variable-update", "allreduce9"),
        ("--encoder-type", "gru"),
        ("--source-lengths", "maybe"),
        ("--bi-layer-input", "both"),
        ("--direction", "sideways"),
        ("--optimizer", "lamb"),
        ("--device", "tpu"),
        ("--batch-size", "0"),
        ("--learning-rate", "-1"),
        ("--max-gradient-norm", "nan"),
    ] {
        let out = train(&[flag, value]);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        let err = stderr(&out);
        assert!(
            err.contains(flag) && err.contains(value),
            "{flag} {value}: {err}"
        );
    }
}

#[test]
fn config_conflicts_are_explained() {
    let out = train(&["--direction", "bi", "--num-encoder-layers", "3"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--num-encoder-layers") && err.contains('3'),
        "{err}"
    );
    let out = train(&["--num-decoder-layers", "3"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--num-decoder-layers"),
        "{err}"
    );
    let out = train(&["--resume"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--checkpoint"),
        "{err}"
    );
    let out = train(&["--gemm-precision", "f16"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--gemm-precision") && err.contains("use bf16"),
        "{err}"
    );
    let out = train(&["--gemm-precision", "f8"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--gemm-precision") && err.contains("f8"),
        "{err}"
    );
    let out = train(&["--data", "/nonexistent/train.en", "--model", "rnnlm"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("/nonexistent/train.en"),
        "{err}"
    );
}

#[test]
fn a_seed_name_and_a_flag_that_contradicts_it_fail_naming_both() {
    for (seed, flag, value, own) in [
        ("dynamic_rnn", "--source-lengths", "off", "stepwise"),
        ("cudnn_lstm", "--bi-layer-input", "own", "fused"),
    ] {
        let out = train(&["--encoder-type", seed, flag, value]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{seed} {flag} {value} was accepted");
        assert!(
            err.contains(flag)
                && err.contains(&format!("--encoder-type {seed}"))
                && err.contains(&format!("--encoder-type {own}")),
            "{err}"
        );
    }
}

/// The report's config and the model line name the semantics a seed's name resolves to.
#[test]
fn the_resolved_model_semantics_are_echoed() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let report = dir.path().join("report.json");
    let report_arg = report.to_string_lossy().into_owned();
    let out = train(&[
        "--encoder-type",
        "dynamic_rnn",
        "--direction",
        "bi",
        "--json-report",
        &report_arg,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&report).expect("the report");
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let config = &json["config"];
    assert_eq!(config["encoder_type"], "dynamic_rnn", "{text}");
    assert_eq!(config["source_lengths"], "on", "{text}");
    assert_eq!(config["bi_layer_input"], "own", "{text}");
    let model = json["model"].as_str().unwrap_or_default();
    assert!(
        model.contains("stepwise") && model.contains("source lengths on"),
        "{model}"
    );
}

#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    let out = train(&["--device", "cuda"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("cuda") && err.contains("feature"), "{err}");
}

#[test]
fn aliases_from_the_seeds_are_accepted_and_a_run_prints_the_table() {
    let out = train(&[
        "--encoder_type",
        "cudnn_lstm",
        "--variable_update",
        "replicated",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("| ranks | batch size |") && text.contains("total words/s:"),
        "{text}"
    );
    let out = train(&["--encoder-type", "dynamic_rnn", "--model", "rnnlm"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn help_explains_every_flag() {
    let out = ringtrain(&["train", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--model",
        "--variable-update",
        "--gradient-repacking",
        "--agg-small-grads-max-bytes",
        "--agg-small-grads-max-group",
        "--encoder-type",
        "--source-lengths",
        "--bi-layer-input",
        "--direction",
        "--num-encoder-layers",
        "--num-decoder-layers",
        "--num-units",
        "--vocab-size",
        "--batch-size",
        "--src-max-len",
        "--use-synthetic-data",
        "--warmup-batches",
        "--timed-batches",
        "--json-report",
        "--device",
        "--threads",
        "--data",
        "--optimizer",
        "--learning-rate",
        "--total-batch-size",
        "--fp16-gradients",
        "--checkpoint",
        "--resume",
        "--seed",
        "--timeline",
        "--timeline-steps",
        "--timeline-layer-bytes",
        "--overwrite-timeline",
    ] {
        assert!(text.contains(flag), "--help does not mention {flag}");
    }
}

#[test]
fn launch_without_mpirun_says_to_run_setup() {
    let out = ringtrain(&[
        "launch",
        "--np",
        "2",
        "--mpirun",
        "/nonexistent/mpirun",
        "--",
        "train",
    ]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("scripts/setup"),
        "{err}"
    );
    let out = ringtrain(&["launch", "--np", "0", "--", "train"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--np") && err.contains('0'),
        "{err}"
    );
}

#[test]
fn sizes_past_the_machine_fail_at_once_with_the_accepted_range_or_the_estimate() {
    let cases: [(&[&str], &[&str]); 5] = [
        (
            &["--timed-batches", "18446744073709551615"],
            &["--timed-batches", "accepted range is 1 to"],
        ),
        (
            &["--threads", "100000"],
            &["--threads", "accepted range is 0"],
        ),
        (
            &["--num-units", "2147483648"],
            &["--num-units", "2147483648", "too big"],
        ),
        (
            &["--vocab-size", "5000000", "--num-units", "4096"],
            &["needs about", "GiB", "biggest term is", "--vocab-size"],
        ),
        (
            &["--batch-size", "1000000000000", "--src-max-len", "1000000"],
            &["needs about", "biggest term is", "--batch-size"],
        ),
    ];
    for (flags, expected) in cases {
        // TINY, with the case's flags in place of its own.
        let mut args = vec!["train"];
        for pair in TINY.chunks(2) {
            if !flags.contains(&pair[0]) {
                args.extend_from_slice(pair);
            }
        }
        args.extend_from_slice(flags);
        let started = std::time::Instant::now();
        let out = ringtrain(&args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{flags:?}: {err}");
        for needle in expected {
            assert!(
                err.contains(needle),
                "{flags:?}: missing {needle:?} in {err}"
            );
        }
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{err}"
        );
        // Refused before anything big was allocated: a generous bound, not a timing.
        assert!(
            started.elapsed().as_secs() < 60,
            "{flags:?} took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn bench_allreduce_skips_sizes_below_one_element() {
    let out = ringtrain(&[
        "bench",
        "allreduce",
        "--min-bytes",
        "1",
        "--max-bytes",
        "3",
        "--small-tensors",
        "0",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    assert!(
        text.contains("skipped sizes below one f32 element") && text.contains("1, 2"),
        "{text}"
    );
}

#[test]
fn bench_allreduce_refuses_zero_iterations() {
    let out = ringtrain(&["bench", "allreduce", "--iters", "0"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--iters") && err.contains("`0`"),
        "{err}"
    );
}

#[test]
fn bench_allreduce_checks_memory_before_allocating() {
    // 1 TiB per buffer: more than any test machine has, refused before any allocation.
    let out = ringtrain(&["bench", "allreduce", "--max-bytes", "1024G"]);
    let err = stderr(&out);
    assert!(
        !out.status.success()
            && err.contains("--max-bytes 1099511627776")
            && err.contains("GiB are available"),
        "{err}"
    );
}

#[test]
fn stall_timeout_out_of_range_names_the_flag() {
    for value in ["-1", "99999999999", "soon"] {
        let flag = format!("--stall-timeout={value}");
        let out = train(&[&flag]);
        let err = stderr(&out);
        assert!(
            !out.status.success() && err.contains("--stall-timeout") && err.contains(value),
            "{value}: {err}"
        );
        let out = ringtrain(&["bench", "allreduce", &flag]);
        let err = stderr(&out);
        assert!(
            !out.status.success() && err.contains("--stall-timeout") && err.contains(value),
            "bench {value}: {err}"
        );
    }
    // `off` is accepted and a run completes.
    let out = train(&["--stall-timeout", "off"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Held-out input that cannot be evaluated fails at start, naming the file or the flag,
/// before a step is trained (no progress line is printed).
#[test]
fn bad_held_out_input_fails_before_training() {
    let corpus = ringtrain_data::BundledCorpus::in_repo();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let empty = dir.path().join("empty.xx");
    std::fs::write(&empty, "").expect("writable");
    let foreign = dir.path().join("foreign.txt");
    std::fs::write(&foreign, "zorp blit quax\nvum zorp\n").expect("writable");
    let path = |p: &std::path::Path| p.display().to_string();
    let nmt_data = [
        path(&corpus.nmt_train_src),
        path(&corpus.nmt_train_tgt),
        path(&corpus.nmt_vocab_src),
        path(&corpus.nmt_vocab_tgt),
    ]
    .join(",");
    let lm_data = [path(&corpus.lm_train), path(&corpus.lm_vocab)].join(",");
    let missing = dir.path().join("missing.en");
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (
            vec![
                "--data".into(),
                nmt_data.clone(),
                "--eval-data".into(),
                format!("{},{}", path(&missing), path(&corpus.nmt_dev_tgt)),
            ],
            vec!["missing.en".into()],
        ),
        (
            vec![
                "--data".into(),
                nmt_data.clone(),
                "--eval-data".into(),
                format!("{},{}", path(&corpus.nmt_dev_src), path(&empty)),
            ],
            vec!["empty.xx".into()],
        ),
        (
            vec![
                "--model".into(),
                "rnnlm".into(),
                "--data".into(),
                lm_data.clone(),
                "--eval-data".into(),
                path(&foreign),
            ],
            vec!["foreign.txt".into(), "--max-unk-percent".into()],
        ),
        (
            vec![
                "--data".into(),
                nmt_data.clone(),
                "--eval-every".into(),
                "3".into(),
            ],
            vec!["--eval-every".into(), "--eval-data".into()],
        ),
        (
            vec![
                "--model".into(),
                "rnnlm".into(),
                "--data".into(),
                lm_data.clone(),
                "--eval-data".into(),
                path(&corpus.lm_valid),
                "--target-perplexity".into(),
                "1".into(),
            ],
            vec!["--target-perplexity".into(), "above 1".into()],
        ),
        (
            vec!["--target-perplexity".into(), "inf".into()],
            vec!["--target-perplexity".into(), "finite".into()],
        ),
        (
            vec!["--eval-data".into(), path(&corpus.nmt_dev_src)],
            vec!["--eval-data".into(), "--data".into()],
        ),
    ];
    for (args, expected) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = train(&args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} was accepted");
        for text in &expected {
            assert!(err.contains(text.as_str()), "{args:?}: {err}");
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.contains("words/sec"), "{args:?} trained: {stdout}");
    }
}

#[test]
fn bad_timeline_flags_name_the_flag_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let trace = trace.to_str().unwrap();
    for (window, says) in [
        ("7..3", "comes before the first"),
        ("3", "expected A..B"),
        ("x..4", "expected A..B"),
        ("0..2", "numbered from 1"),
    ] {
        let out = train(&["--timeline", trace, "--timeline-steps", window]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{window} was accepted");
        assert!(
            err.contains("--timeline-steps") && err.contains(window) && err.contains(says),
            "{window}: {err}"
        );
    }
    let out = train(&["--timeline-steps", "1..2"]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("needs --timeline"),
        "{err}"
    );
    let missing = dir.path().join("missing").join("t.json");
    let out = train(&["--timeline", missing.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("--timeline") && err.contains("mkdir -p"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("words/s"));
}

#[test]
fn a_dry_run_plans_the_memory_and_the_largest_batch_and_trains_nothing() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let report = dir.path().join("report.json");
    let report_arg = report.display().to_string();
    let out = train(&[
        "--use-synthetic-data",
        "--batch-size",
        "16",
        "--dry-run",
        "--json-report",
        &report_arg,
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains("dry run at batch size 16 per rank (nothing is trained)"),
        "{text}"
    );
    assert!(text.contains("host: needs about"), "{text}");
    assert!(
        text.contains("parameters") && text.contains("Adam moments"),
        "{text}"
    );
    let largest: usize = text
        .lines()
        .find_map(|l| l.split("largest --batch-size that fits: ").nth(1))
        .and_then(|n| n.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no largest batch size in {text}"));
    // A tiny model on any machine that runs the tests fits far more than 16 sentences.
    assert!(largest > 16, "{text}");
    // Nothing trained: no step line, no report.
    assert!(!text.contains("step"), "{text}");
    assert!(!report.exists(), "a dry run wrote {}", report.display());
}
