//! NMT training throughput on one GPU (CUDA backend) against PyTorch (cuDNN LSTMs) on the
//! same device, measured in the same run.
//!
//! Model: the seed benchmark's NMT configuration — vocab 50,000 each side, embedding and
//! hidden 512, 4 encoder layers (bidirectional: 2 per direction) + 4 decoder layers, fused
//! LSTM, source and target length 100, batch 384; Adam (lr 1e-3) and global-norm clipping
//! at 5 on the device, as `benches/torch_nmt_gpu.py` does. Words per batch = source +
//! target tokens (2 · 384 · 100); warm-up batches are not timed.
//!
//! Printed: words/s for f32 GEMMs and for bf16 GEMM operands (mixed precision, f32
//! accumulate, f32 master weights), each with PyTorch's figure (fp32, and `--amp bf16`) and
//! the ratio; the seed's P100 single-GPU figure (55,411 words/s) for context; the
//! per-step breakdown (forward + loss, backward, optimizer); launches per batch for the
//! fused and the stepwise LSTM. `RESULT` lines are tab-separated for scripts/gpu-check.
//!
//! Run on a GPU machine: `cuda_nmt [--quick] [--warmup-batches N] [--timed-batches N]`.
//! The PyTorch script is looked up in `$RINGTRAIN_BENCH_SCRIPTS`, next to the binary's
//! bundle (`gpu-bundle/`) and in the source tree's `benches/`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_cuda::{optim, GpuBuffer};
use ringtrain_model::GemmPrecision;
use ringtrain_model::{
    BiLayerInput, CudaBackend, EncoderKind, LstmImpl, Model, NmtBatchView, NmtConfig, NmtModel,
    SourceLengths,
};

/// The seed's single-GPU figure (P100, TensorFlow NMT), for context only.
const P100_SEED_WORDS_PER_SEC: f64 = 55_411.0;

struct Sizes {
    vocab: usize,
    units: usize,
    layers: usize,
    len: usize,
    batch: usize,
    warmup: usize,
    timed: usize,
}

fn flag_value(args: &[String], name: &str, default: usize) -> Result<usize, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a whole number, e.g. {name} {default}")),
    }
}

fn sizes() -> Result<Sizes, String> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let (vocab, units, layers, len, batch) = if quick {
        (5000, 256, 2, 30, 64)
    } else {
        (50_000, 512, 4, 100, 384)
    };
    Ok(Sizes {
        vocab,
        units,
        layers,
        len,
        batch,
        warmup: flag_value(&args, "--warmup-batches", if quick { 2 } else { 5 })?,
        timed: flag_value(&args, "--timed-batches", if quick { 3 } else { 10 })?.max(1),
    })
}

struct Data {
    src: Vec<u32>,
    tgt_in: Vec<u32>,
    tgt_out: Vec<u32>,
    mask: Vec<f32>,
}

impl Data {
    fn random(s: &Sizes, seed: u64) -> Data {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = s.len * s.batch;
        let mut ids = || {
            (0..n)
                .map(|_| rng.gen_range(0..s.vocab as u32))
                .collect::<Vec<_>>()
        };
        Data {
            src: ids(),
            tgt_in: ids(),
            tgt_out: ids(),
            mask: vec![1.0; n],
        }
    }

    fn view(&self, s: &Sizes) -> NmtBatchView<'_> {
        NmtBatchView {
            batch: s.batch,
            src_len: s.len,
            tgt_len: s.len,
            src: &self.src,
            tgt_in: &self.tgt_in,
            tgt_out: &self.tgt_out,
            tgt_mask: &self.mask,
            src_lengths: None,
        }
    }
}

fn config(s: &Sizes, lstm: LstmImpl) -> NmtConfig {
    NmtConfig {
        src_vocab: s.vocab,
        tgt_vocab: s.vocab,
        emb: s.units,
        hidden: s.units,
        layers: s.layers,
        encoder: EncoderKind::Bi,
        lstm,
        source_lengths: SourceLengths::Off,
        bi_layer_input: BiLayerInput::Own,
        init_scale: 0.1,
        forget_bias: 1.0,
    }
}

/// Adam state on the device.
struct Adam {
    m: GpuBuffer<f32>,
    v: GpuBuffer<f32>,
    norm_sq: GpuBuffer<f64>,
    step: u32,
}

fn err(what: &str) -> impl Fn(ringtrain_model::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn optimizer_step(model: &mut NmtModel<CudaBackend>, adam: &mut Adam) -> Result<(), String> {
    let gpu = model.backend().gpu().clone();
    let (params, grads) = model.params_and_grads_mut();
    optim::clip_by_global_norm(&gpu, &mut [grads.as_mut_slice()], 5.0, &mut adam.norm_sq)
        .map_err(|e| format!("clipping: {e}"))?;
    adam.step += 1;
    optim::adam_step(
        &gpu,
        params,
        &*grads,
        &mut adam.m,
        &mut adam.v,
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.0,
        adam.step,
    )
    .map_err(|e| format!("Adam step: {e}"))
}

struct Measured {
    words_per_sec: f64,
    forward_ms: f64,
    backward_ms: f64,
    optimizer_ms: f64,
    launches: u64,
}

fn measure(s: &Sizes, precision: GemmPrecision) -> Result<Measured, String> {
    let backend = CudaBackend::with_precision(0, precision).map_err(|e| format!("GPU 0: {e}"))?;
    let mut model =
        NmtModel::new(backend, config(s, LstmImpl::Fused), 1).map_err(|e| e.to_string())?;
    let total = model.layout().total_len();
    let gpu = model.backend().gpu().clone();
    let mut adam = Adam {
        m: gpu.zeros(total).map_err(|e| e.to_string())?,
        v: gpu.zeros(total).map_err(|e| e.to_string())?,
        norm_sq: gpu.zeros(1).map_err(|e| e.to_string())?,
        step: 0,
    };
    let data = Data::random(s, 7);
    let batch = data.view(s);
    let sync = |m: &NmtModel<CudaBackend>| m.backend().synchronize().map_err(|e| e.to_string());
    let mut launches = 0;
    for _ in 0..s.warmup {
        launches = model
            .forward_backward(&batch, &mut |_, _| {})
            .map_err(err("warm-up"))?
            .launches;
        optimizer_step(&mut model, &mut adam)?;
    }
    sync(&model)?;
    let start = Instant::now();
    for _ in 0..s.timed {
        let stats = model
            .forward_backward(&batch, &mut |_, _| {})
            .map_err(err("step"))?;
        launches = stats.launches;
        optimizer_step(&mut model, &mut adam)?;
    }
    sync(&model)?;
    let seconds = start.elapsed().as_secs_f64();
    let words = (2 * s.batch * s.len * s.timed) as f64;
    // Breakdown, each part synchronized on its own (separate runs, so the sum can exceed
    // the overlapped step time slightly).
    let runs = s.timed.min(3);
    let time = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        let t = Instant::now();
        for _ in 0..runs {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3 / runs as f64)
    };
    let forward_ms = time(&mut || {
        model.forward_loss(&batch).map_err(err("forward"))?;
        sync(&model)
    })?;
    let pass_ms = time(&mut || {
        model
            .forward_backward(&batch, &mut |_, _| {})
            .map_err(err("forward + backward"))?;
        sync(&model)
    })?;
    let optimizer_ms = time(&mut || {
        optimizer_step(&mut model, &mut adam)?;
        sync(&model)
    })?;
    Ok(Measured {
        words_per_sec: words / seconds,
        forward_ms,
        backward_ms: (pass_ms - forward_ms).max(0.0),
        optimizer_ms,
        launches,
    })
}

fn launches_per_batch(s: &Sizes, lstm: LstmImpl) -> Result<u64, String> {
    let backend = CudaBackend::new(0).map_err(|e| format!("GPU 0: {e}"))?;
    // Launch counts do not depend on the batch size: count with a small batch.
    let small = Sizes { batch: 8, ..*s };
    let mut model = NmtModel::new(backend, config(&small, lstm), 1).map_err(|e| e.to_string())?;
    let data = Data::random(&small, 3);
    let stats = model
        .forward_backward(&data.view(&small), &mut |_, _| {})
        .map_err(err("count"))?;
    Ok(stats.launches)
}

fn script() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("RINGTRAIN_BENCH_SCRIPTS") {
        dirs.push(d.into());
    }
    if let Ok(exe) = std::env::current_exe() {
        // gpu-bundle/bin/cuda_nmt -> gpu-bundle/
        if let Some(bundle) = exe.parent().and_then(|p| p.parent()) {
            dirs.push(bundle.to_path_buf());
        }
    }
    dirs.push(PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../benches"
    )));
    dirs.into_iter()
        .map(|d| d.join("torch_nmt_gpu.py"))
        .find(|p| p.is_file())
}

fn torch_words_per_sec(s: &Sizes, amp: &str) -> Result<f64, String> {
    let script =
        script().ok_or("benches/torch_nmt_gpu.py not found (set RINGTRAIN_BENCH_SCRIPTS)")?;
    let out = Command::new("python3")
        .arg(&script)
        .args(["--json", "--amp", amp, "--clip-norm", "5"])
        .args([
            "--vocab-size",
            &s.vocab.to_string(),
            "--emb",
            &s.units.to_string(),
        ])
        .args([
            "--hidden",
            &s.units.to_string(),
            "--layers",
            &s.layers.to_string(),
        ])
        .args([
            "--src-len",
            &s.len.to_string(),
            "--batch-size",
            &s.batch.to_string(),
        ])
        .args([
            "--warmup-batches",
            &s.warmup.to_string(),
            "--timed-batches",
            &s.timed.to_string(),
        ])
        .output()
        .map_err(|e| format!("could not run python3 ({e})"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{} exited with {}: {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let last = stdout.lines().last().unwrap_or("");
    let key = "\"words_per_sec\":";
    last.find(key)
        .map(|i| &last[i + key.len()..])
        .and_then(|rest| rest.trim_start().split([',', '}']).next())
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no words_per_sec in the script's last line: {last}"))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_nmt: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let s = sizes()?;
    println!(
        "NMT training on GPU 0: vocab {}, emb = hidden = {}, {}+{} layers (bi encoder), length {}, batch {}; \
         {} warm-up + {} timed batches, Adam + clip 5",
        s.vocab, s.units, s.layers, s.layers, s.len, s.batch, s.warmup, s.timed
    );
    println!("context: the seed's P100 single-GPU figure is {P100_SEED_WORDS_PER_SEC:.0} words/s");
    for (label, precision, amp) in [
        ("f32", GemmPrecision::F32, "none"),
        ("mixed-bf16", GemmPrecision::Bf16, "bf16"),
    ] {
        let ours = measure(&s, precision)?;
        let torch = torch_words_per_sec(&s, amp);
        println!(
            "{label:>10}: ringtrain {:.0} words/s | step breakdown: forward+loss {:.1} ms, backward {:.1} ms, \
             optimizer {:.1} ms | {} launches per batch | {:.2}x the P100 seed figure",
            ours.words_per_sec,
            ours.forward_ms,
            ours.backward_ms,
            ours.optimizer_ms,
            ours.launches,
            ours.words_per_sec / P100_SEED_WORDS_PER_SEC
        );
        match torch {
            Ok(t) => {
                println!(
                    "{label:>10}: PyTorch (amp {amp}) {t:.0} words/s; ratio ringtrain / PyTorch = {:.2}",
                    ours.words_per_sec / t
                );
                println!(
                    "RESULT\tnmt_train_{label}\twords/s\t{:.1}\t{t:.1}\t{:.3}",
                    ours.words_per_sec,
                    ours.words_per_sec / t
                );
            }
            Err(e) => {
                println!("{label:>10}: PyTorch baseline unavailable: {e}");
                println!(
                    "RESULT\tnmt_train_{label}\twords/s\t{:.1}\t-\t-",
                    ours.words_per_sec
                );
            }
        }
    }
    let fused = launches_per_batch(&s, LstmImpl::Fused)?;
    let stepwise = launches_per_batch(&s, LstmImpl::Stepwise)?;
    println!(
        "kernel launches per batch: fused {fused}, stepwise {stepwise} ({:.1}x fewer fused)",
        stepwise as f64 / fused as f64
    );
    println!(
        "RESULT\tnmt_launches_fused_vs_stepwise\tlaunches\t{fused}\t{stepwise}\t{:.3}",
        fused as f64 / stepwise as f64
    );
    Ok(())
}
