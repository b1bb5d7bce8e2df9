//! CPU training-step throughput of the NMT model against PyTorch's CPU `nn.LSTM`
//! version of the same model, measured in the same run.
//!
//! Model: vocab 8000 each side, embedding and hidden 256, 2 encoder layers
//! (bidirectional: one per direction) + 2 decoder layers, fused LSTM, sequence length 30,
//! batch 64, Adam (lr 1e-3), global-norm clipping at 5, 2 threads. Throughput follows the
//! seeds' rule: 10 warm-up batches, then 20 timed; words = source + target.
//!
//! `cargo bench --bench train_step [-- --warmup-batches N --timed-batches N]`
//! The PyTorch side is `python3 benches/torch_nmt_cpu.py --json` (run scripts/bench-setup
//! first if torch is missing). Target: ringtrain ≥ 1.5× PyTorch.

use std::process::Command;

use ringtrain::collective::Communicator;
use ringtrain::train::{EncoderKind, LstmImpl, ModelKind, TrainConfig};

const TARGET_RATIO: f64 = 1.5;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn torch_words_per_sec(warmup: usize, timed: usize) -> Result<f64, String> {
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
            "--warmup-batches",
            &warmup.to_string(),
            "--timed-batches",
            &timed.to_string(),
        ])
        .output()
        .map_err(|e| {
            format!("could not run python3 ({e}): install Python 3, then run scripts/bench-setup")
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("PyTorch is not installed") || stderr.contains("No module named 'torch'")
        {
            return Err("PyTorch is not installed for python3: run scripts/bench-setup, then rerun this benchmark".into());
        }
        return Err(format!("benches/torch_nmt_cpu.py failed:\n{stderr}"));
    }
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("benches/torch_nmt_cpu.py printed no JSON line:\n{stdout}"))?;
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("bad JSON from the baseline: {e}"))?;
    v["words_per_sec"]
        .as_f64()
        .ok_or_else(|| format!("no words_per_sec in {line}"))
}

fn ringtrain_report(warmup: usize, timed: usize) -> Result<ringtrain::train::RunReport, String> {
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

fn main() {
    let warmup = arg("--warmup-batches", 10);
    let timed = arg("--timed-batches", 20);
    println!(
        "train_step: NMT vocab 8000, emb/hidden 256, 2+2 layers (bi encoder), fused LSTM, length 30, batch 64, \
         Adam, clip 5, 2 threads; {warmup} warm-up + {timed} timed batches"
    );
    let ours = match ringtrain_report(warmup, timed) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: ringtrain run failed: {e}");
            std::process::exit(1);
        }
    };
    let baseline = match torch_words_per_sec(warmup, timed) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let b = &ours.breakdown;
    println!("  baseline  pytorch cpu nn.LSTM : {baseline:>10.1} words/s");
    println!(
        "  ours      ringtrain (cpu)     : {:>10.1} words/s  (per step ms: forward {:.1}, backward {:.1}, optimizer {:.1})",
        ours.words_per_sec,
        b.forward * 1e3,
        b.backward * 1e3,
        b.optimizer * 1e3
    );
    let ratio = ours.words_per_sec / baseline;
    println!(
        "  ratio     ringtrain / pytorch : {ratio:.2}x  (target >= {TARGET_RATIO}x: {})",
        if ratio >= TARGET_RATIO {
            "met"
        } else {
            "NOT met"
        }
    );
}
