//! CPU training-step throughput of the NMT model against PyTorch's CPU `nn.LSTM`
//! version of the same model, measured in the same run.
//!
//! Model: vocab 8000 each side, embedding and hidden 256, 2 encoder layers
//! (bidirectional: one per direction) + 2 decoder layers, fused LSTM, sequence length 30,
//! batch 64, Adam (lr 1e-3), global-norm clipping at 5, 2 threads. Throughput follows the
//! seeds' rule: 10 warm-up batches, then 20 timed; words = source + target.
//!
//! Four runs, each in a process of its own so that its peak resident set is its own:
//! PyTorch f32, PyTorch with the forward under `torch.autocast("cpu", dtype=bfloat16)`,
//! ringtrain f32 and ringtrain `--gemm-precision bf16` (the bf16 path this CPU takes is
//! printed). It prints words/s and peak RSS of each, the ratios, and ends with the two
//! lines `ratio ringtrain bf16 / pytorch autocast bf16: R` and
//! `ratio ringtrain bf16 / pytorch f32: R`. PyTorch's autocast bf16 cannot run on a CPU
//! without bf16 instructions (oneDNN has no bf16 LSTM there): that run is then reported
//! as not measured, with PyTorch's reason, and its ratios as `n/a`.
//!
//! `cargo bench --bench train_step [-- --warmup-batches N --timed-batches N --rounds R]`
//! (3 rounds by default: the four runs one after the other, R times; each ratio is taken
//! within a round, and the medians are reported, since a shared machine drifts by tens of
//! percent over minutes; peak RSS is the largest of the rounds)
//! The PyTorch side is `python3 benches/torch_nmt_cpu.py --json [--precision bf16]` (run
//! scripts/bench-setup first if torch is missing). Targets: ringtrain bf16 ≥ 1.5× PyTorch
//! autocast bf16 and ≥ 2.5× PyTorch f32; ringtrain's peak RSS ≤ PyTorch's.

use std::process::Command;

use ringtrain::collective::Communicator;
use ringtrain::train::{EncoderKind, GemmPrecision, LstmImpl, ModelKind, TrainConfig};

/// ringtrain bf16 against PyTorch autocast bf16.
const TARGET_AUTOCAST: f64 = 1.5;
/// ringtrain bf16 against PyTorch f32.
const TARGET_F32: f64 = 2.5;

/// One run's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    words_per_sec: f64,
    peak_rss_bytes: f64,
}

/// The count after `name`, `default` when the flag is absent, at least `min`; a missing,
/// unreadable or too small value stops the benchmark before anything runs.
fn arg(name: &str, default: usize, min: usize) -> usize {
    let Some(value) = text_arg(name) else {
        if std::env::args().any(|a| a == name) {
            eprintln!("error: {name} needs a value (a whole number, at least {min})");
            std::process::exit(2);
        }
        return default;
    };
    match value.parse::<usize>() {
        Ok(n) if n >= min => n,
        _ => {
            eprintln!("error: {name} {value}: expected a whole number, at least {min}");
            std::process::exit(2);
        }
    }
}

/// A PyTorch run's figures, or `Err(Unsupported(reason))` where PyTorch cannot run it on
/// this CPU (autocast bf16 without bf16 instructions), or another error.
fn torch_run(warmup: usize, timed: usize, precision: &str) -> Result<Figures, RunError> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_nmt_cpu.py");
    let out = Command::new("python3")
        .args([
            script,
            "--json",
            "--threads",
            "2",
            "--vocab-size",
            "8000",
            "--emb",
            "256",
            "--hidden",
            "256",
            "--layers",
            "2",
            "--src-len",
            "30",
            "--batch-size",
            "64",
            "--clip-norm",
            "5",
            "--precision",
            precision,
            "--warmup-batches",
            &warmup.to_string(),
            "--timed-batches",
            &timed.to_string(),
        ])
        .output()
        .map_err(|e| {
            format!("could not run python3 ({e}): install Python 3, then run scripts/bench-setup")
        })?;
    if out.status.code() == Some(3) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some(reason) = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find_map(|v| v["unsupported"].as_str().map(str::to_string))
        {
            return Err(RunError::Unsupported(reason));
        }
    }
    let v = json_line(&out, "benches/torch_nmt_cpu.py")?;
    Ok(figures(&v)?)
}

/// Why a run gave no figures.
enum RunError {
    /// The run cannot be made on this CPU (the reason); the benchmark goes on without it.
    Unsupported(String),
    /// Anything else, which stops the benchmark.
    Failed(String),
}

impl From<String> for RunError {
    fn from(e: String) -> Self {
        RunError::Failed(e)
    }
}

/// The last JSON line a run printed, or its error.
fn json_line(out: &std::process::Output, what: &str) -> Result<serde_json::Value, String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("PyTorch is not installed") || stderr.contains("No module named 'torch'")
        {
            return Err("PyTorch is not installed for python3: run scripts/bench-setup, then rerun this benchmark".into());
        }
        return Err(format!("{what} failed:\n{stderr}"));
    }
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("{what} printed no JSON line:\n{stdout}"))?;
    serde_json::from_str(line).map_err(|e| format!("bad JSON from {what}: {e}"))
}

fn figures(v: &serde_json::Value) -> Result<Figures, String> {
    let field = |name: &str| v[name].as_f64().ok_or_else(|| format!("no {name} in {v}"));
    Ok(Figures {
        words_per_sec: field("words_per_sec")?,
        peak_rss_bytes: field("peak_rss_bytes")?,
    })
}

/// This process's peak resident set (`VmHWM`), in bytes.
fn peak_rss_bytes() -> Result<f64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("reading /proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kib| kib * 1024.0)
        .ok_or_else(|| "no VmHWM in /proc/self/status".to_string())
}

/// The ringtrain run itself (in the child process `--only-ringtrain PRECISION`).
fn ringtrain_report(
    warmup: usize,
    timed: usize,
    precision: GemmPrecision,
) -> Result<ringtrain::train::RunReport, String> {
    let mut cfg = TrainConfig::default();
    cfg.model.model = ModelKind::Nmt;
    cfg.model.encoder_type = LstmImpl::Fused.into();
    cfg.model.direction = EncoderKind::Bi;
    cfg.model.num_encoder_layers = 2;
    cfg.model.num_decoder_layers = 2;
    cfg.model.num_units = 256;
    cfg.data.vocab_size = 8000;
    cfg.data.batch_size = 64;
    cfg.data.src_max_len = 30;
    cfg.run.warmup_batches = warmup;
    cfg.run.timed_batches = timed;
    cfg.run.threads = 2;
    cfg.run.max_gradient_norm = 5.0;
    cfg.run.gemm_precision = precision;
    cfg.output.display_every = 0;
    let cfg = cfg.validate(1).map_err(|e| e.to_string())?;
    let results = Communicator::run_local(1, |comm| {
        let local = ringtrain::train::local_rank(&comm)?;
        ringtrain::train::run_rank(&cfg, comm, local, &mut |_| {}).map(|o| o.report)
    })
    .map_err(|e| e.to_string())?;
    results
        .into_iter()
        .next()
        .ok_or("no result")?
        .map_err(|e| e.to_string())
}

/// Runs ringtrain in `precision` in a child process (this benchmark, `--only-ringtrain`).
fn ringtrain_run(warmup: usize, timed: usize, precision: &str) -> Result<Figures, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
    let out = Command::new(exe)
        .args([
            "--only-ringtrain",
            precision,
            "--warmup-batches",
            &warmup.to_string(),
            "--timed-batches",
            &timed.to_string(),
        ])
        .output()
        .map_err(|e| format!("could not rerun this benchmark: {e}"))?;
    let v = json_line(&out, &format!("the ringtrain {precision} run"))?;
    let f = figures(&v)?;
    if let Some(line) = v["summary"].as_str() {
        println!("{line}");
    }
    Ok(f)
}

/// The child: one ringtrain run, a summary line and a JSON line.
fn only_ringtrain(precision: &str, warmup: usize, timed: usize) -> Result<(), String> {
    let p: GemmPrecision = precision
        .parse()
        .map_err(|e| format!("--only-ringtrain {precision}: {e}"))?;
    let report = ringtrain_report(warmup, timed, p)?;
    let b = &report.breakdown;
    let path = match p {
        GemmPrecision::Bf16 => format!(
            ", kernel path {}",
            ringtrain::kernels::gemm_bf16::Bf16Path::detect().name()
        ),
        _ => String::new(),
    };
    let summary = format!(
        "  ringtrain {precision:<5}: {:>10.1} words/s  (per step ms: forward {:.1}, backward {:.1}, optimizer {:.1}{path})",
        report.words_per_sec,
        b.forward * 1e3,
        b.backward * 1e3,
        b.optimizer * 1e3
    );
    let v = serde_json::json!({
        "words_per_sec": report.words_per_sec,
        "peak_rss_bytes": peak_rss_bytes()?,
        "summary": summary,
    });
    println!("{v}");
    Ok(())
}

fn text_arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn verdict(ratio: f64, target: f64) -> &'static str {
    if ratio >= target {
        "met"
    } else {
        "NOT met"
    }
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The four runs of one round, in the order they ran.
const RUNS: [&str; 4] = [
    "pytorch f32",
    "pytorch autocast bf16",
    "ringtrain f32",
    "ringtrain bf16",
];

fn main() {
    let warmup = arg("--warmup-batches", 10, 0);
    let timed = arg("--timed-batches", 20, 1);
    let rounds = arg("--rounds", 3, 1);
    if let Some(precision) = text_arg("--only-ringtrain") {
        if let Err(e) = only_ringtrain(&precision, warmup, timed) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        return;
    }
    println!(
        "train_step: NMT vocab 8000, emb/hidden 256, 2+2 layers (bi encoder), fused LSTM, length 30, batch 64, \
         Adam, clip 5, 2 threads; {warmup} warm-up + {timed} timed batches; each run in its own process; \
         {rounds} rounds of the four runs, one after the other (shared machines drift: the ratios \
         are taken within each round, and the medians reported)"
    );
    // The reason a run cannot be made on this CPU, once it has said so (it is not tried
    // again in later rounds).
    let mut unsupported: [Option<String>; 4] = Default::default();
    let mut run = |i: usize, f: &dyn Fn() -> Result<Figures, RunError>| {
        if unsupported[i].is_some() {
            return None;
        }
        match f() {
            Ok(v) => Some(v),
            Err(RunError::Unsupported(why)) => {
                println!("  {}: not measured on this CPU: {why}", RUNS[i]);
                unsupported[i] = Some(why);
                None
            }
            Err(RunError::Failed(e)) => {
                eprintln!("error: {}: {e}", RUNS[i]);
                std::process::exit(1);
            }
        }
    };
    // figures[round][run], in the order of RUNS; `None` for a run this CPU cannot make.
    let mut figures: Vec<[Option<Figures>; 4]> = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        let round_figures = [
            run(0, &|| torch_run(warmup, timed, "f32")),
            run(1, &|| torch_run(warmup, timed, "bf16")),
            run(2, &|| Ok(ringtrain_run(warmup, timed, "f32")?)),
            run(3, &|| Ok(ringtrain_run(warmup, timed, "bf16")?)),
        ];
        let w = round_figures.map(|f| f.map(|f| f.words_per_sec));
        let show = |x: Option<f64>, digits: usize| {
            x.map_or("n/a".to_string(), |x| format!("{x:.digits$}"))
        };
        let over = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
        println!(
            "  round {round}: words/s pytorch f32 {}, autocast bf16 {}, ringtrain f32 {}, bf16 {}; \
             ratios bf16 / autocast {}, bf16 / pytorch f32 {}",
            show(w[0], 1),
            show(w[1], 1),
            show(w[2], 1),
            show(w[3], 1),
            show(over(w[3], w[1]), 2),
            show(over(w[3], w[0]), 2)
        );
        figures.push(round_figures);
    }
    let words = |i: usize| {
        let all: Vec<f64> = figures
            .iter()
            .flat_map(|f| f[i])
            .map(|f| f.words_per_sec)
            .collect();
        (!all.is_empty()).then(|| median(all))
    };
    // The largest resident set of a run over the rounds.
    let rss = |i: usize| {
        figures
            .iter()
            .flat_map(|f| f[i])
            .map(|f| f.peak_rss_bytes)
            .reduce(f64::max)
    };
    // The median of the ratios within each round that has both runs.
    let ratio = |ours: usize, theirs: usize| {
        let all: Vec<f64> = figures
            .iter()
            .filter_map(|f| Some(f[ours]?.words_per_sec / f[theirs]?.words_per_sec))
            .collect();
        (!all.is_empty()).then(|| median(all))
    };
    // A figure, or why there is none.
    let why = |i: usize| {
        format!(
            "n/a ({} not measured: {})",
            RUNS[i],
            unsupported[i].as_deref().unwrap_or("no figures")
        )
    };
    let missing = |ours: usize, theirs: usize| if words(ours).is_none() { ours } else { theirs };
    // A ratio with two decimals, or why there is none.
    let line = |r: Option<f64>, ours: usize, theirs: usize| {
        r.map_or_else(|| why(missing(ours, theirs)), |r| format!("{r:.2}"))
    };
    println!(
        "  {:<24} {:>12} {:>14}",
        "run", "words/s (median)", "peak RSS MiB (largest)"
    );
    for (i, name) in RUNS.iter().enumerate() {
        match (words(i), rss(i)) {
            (Some(w), Some(r)) => {
                println!("  {name:<24} {w:>16.1} {:>22.1}", r / (1024.0 * 1024.0))
            }
            _ => println!("  {name:<24} {:>16} {:>22}", "n/a", "n/a"),
        }
    }
    for (ours, theirs, what) in [
        (2, 0, "ringtrain f32 / pytorch f32"),
        (3, 2, "ringtrain bf16 / ringtrain f32"),
    ] {
        println!(
            "  ratio {what}: {}",
            line(ratio(ours, theirs), ours, theirs)
        );
    }
    for (ours, theirs, what) in [(2, 0, "f32"), (3, 1, "bf16")] {
        match rss(ours).zip(rss(theirs)) {
            Some((a, b)) => println!(
                "  peak RSS ringtrain / pytorch, {what}: {:.2} (target <= 1: {})",
                a / b,
                if a <= b { "met" } else { "NOT met" }
            ),
            None => println!(
                "  peak RSS ringtrain / pytorch, {what}: {}",
                why(missing(ours, theirs))
            ),
        }
    }
    let target = |r: Option<f64>, target: f64| r.map_or("not measured", |r| verdict(r, target));
    let (autocast, f32_ratio) = (ratio(3, 1), ratio(3, 0));
    println!(
        "  targets: bf16 / autocast >= {TARGET_AUTOCAST} ({}), bf16 / pytorch f32 >= {TARGET_F32} ({})",
        target(autocast, TARGET_AUTOCAST),
        target(f32_ratio, TARGET_F32)
    );
    println!(
        "ratio ringtrain bf16 / pytorch autocast bf16: {}",
        line(autocast, 3, 1)
    );
    println!(
        "ratio ringtrain bf16 / pytorch f32: {}",
        line(f32_ratio, 3, 0)
    );
}
