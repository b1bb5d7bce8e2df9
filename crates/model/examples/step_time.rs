//! Times CPU training steps (forward + backward) of the NMT model at the benchmark
//! configuration: vocab 8000, emb 256, hidden 256, 2 layers (bi encoder), length 30,
//! batch 64. Prints ms per step and words/s (source + target words) for each thread count.
//!
//! Run: `cargo run --release -p ringtrain-model --example step_time -- [steps] [fused|stepwise] [threads...]`
//! (defaults: 5 timed steps after 2 warm-up steps, fused, 1 and 2 threads).

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_model::{CpuBackend, LstmImpl, Model, NmtBatchView, NmtConfig, NmtModel};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: usize = match args.first() {
        Some(s) => s.parse().map_err(|e| format!("steps `{s}`: {e}"))?,
        None => 5,
    };
    let lstm: LstmImpl = match args.get(1) {
        Some(s) => s.parse()?,
        None => LstmImpl::Fused,
    };
    let mut threads: Vec<usize> = Vec::new();
    for s in args.iter().skip(2) {
        threads.push(s.parse().map_err(|e| format!("threads `{s}`: {e}"))?);
    }
    if threads.is_empty() {
        threads = vec![1, 2];
    }
    let config = NmtConfig {
        lstm,
        ..NmtConfig::benchmark()
    };
    let (batch, len) = (64usize, 30usize);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let src: Vec<u32> = (0..batch * len)
        .map(|_| rng.gen_range(0..config.src_vocab as u32))
        .collect();
    let tgt_in: Vec<u32> = (0..batch * len)
        .map(|_| rng.gen_range(0..config.tgt_vocab as u32))
        .collect();
    let tgt_out: Vec<u32> = (0..batch * len)
        .map(|_| rng.gen_range(0..config.tgt_vocab as u32))
        .collect();
    let mask = vec![1.0f32; batch * len];
    let data = NmtBatchView {
        batch,
        src_len: len,
        tgt_len: len,
        src: &src,
        tgt_in: &tgt_in,
        tgt_out: &tgt_out,
        tgt_mask: &mask,
        src_lengths: None,
    };
    let words_per_step = (2 * batch * len) as f64;
    println!(
        "NMT {lstm:?} LSTM, vocab 8000, emb 256, hidden 256, 2 layers bi, length 30, batch 64"
    );
    for &t in &threads {
        let mut model = NmtModel::new(CpuBackend::new(t)?, config.clone(), 1)?;
        let mut launches = 0;
        for _ in 0..2 {
            launches = model.forward_backward(&data, &mut |_, _| {})?.launches;
        }
        let start = Instant::now();
        for _ in 0..steps {
            model.forward_backward(&data, &mut |_, _| {})?;
        }
        let per_step = start.elapsed().as_secs_f64() / steps as f64;
        println!(
            "threads {t}: {:.1} ms/step, {:.0} words/s, {launches} launches/step",
            per_step * 1e3,
            words_per_step / per_step
        );
    }
    Ok(())
}
