#!/usr/bin/env python3
"""PyTorch baseline for the NMT training step on the CPU.

The model is the benchmark's encoder-decoder LSTM without attention (see REFERENCE §1):

* source and target embeddings [vocab, emb];
* a bidirectional encoder with layers/2 stacked LSTM layers per direction; the second
  layer of a direction sees only that direction's first layer (two unidirectional
  ``nn.LSTM`` stacks, the backward one fed the reversed source);
* the final encoder states interleaved fw0, bw0, fw1, bw1, ... become the initial (h, c)
  of the ``layers``-layer decoder LSTM;
* an output projection hidden -> vocab without bias;
* the loss is the sum of masked softmax cross-entropy over target tokens;
* Adam, learning rate 1e-3, gradients clipped at global norm 5 (``--clip-norm 0`` turns it
  off).

Data are synthetic: uniform random ids, every sequence exactly ``--src-len`` long (source,
target input and target output), as in the benchmark's synthetic runs. Throughput follows
the benchmark's rule: words = source tokens + target tokens (2 * batch * length per step);
the first ``--warmup-batches`` steps are not timed; words/s = words in the timed steps /
wall time of the timed steps.

Run ``python3 benches/torch_nmt_cpu.py --json``: the last line is one JSON object with
``words_per_sec`` for a Rust benchmark to parse. Where PyTorch cannot run the model under
autocast bf16 on this CPU (oneDNN has a bf16 LSTM only for CPUs with bf16 instructions),
``--precision bf16`` exits with status 3, the JSON object then being ``{"unsupported":
reason}``.
"""

import argparse
import json
import resource
import sys
import time
import warnings

# torch warns at import when NumPy is absent; this benchmark does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

try:
    import torch
    from torch import nn
except ImportError:  # pragma: no cover - depends on the machine
    sys.stderr.write(
        "error: PyTorch is not installed; run scripts/bench-setup "
        "(python3 -m pip install torch) and try again\n"
    )
    sys.exit(2)


class NmtModel(nn.Module):
    """Encoder-decoder LSTM without attention, time-major tensors [len, batch]."""

    def __init__(self, vocab_size, emb, hidden, layers):
        super().__init__()
        if layers < 2 or layers % 2 != 0:
            raise ValueError(
                f"--layers {layers}: the bidirectional encoder needs an even number "
                "of layers (layers/2 per direction), at least 2"
            )
        self.layers = layers
        self.src_embedding = nn.Embedding(vocab_size, emb)
        self.tgt_embedding = nn.Embedding(vocab_size, emb)
        per_direction = layers // 2
        self.encoder_fw = nn.LSTM(emb, hidden, num_layers=per_direction)
        self.encoder_bw = nn.LSTM(emb, hidden, num_layers=per_direction)
        self.decoder = nn.LSTM(emb, hidden, num_layers=layers)
        self.projection = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, source, target_input):
        src = self.src_embedding(source)
        _, (h_fw, c_fw) = self.encoder_fw(src)
        _, (h_bw, c_bw) = self.encoder_bw(torch.flip(src, dims=[0]))
        # Interleave fw0, bw0, fw1, bw1, ... as the decoder's initial state.
        h0 = torch.stack([h_fw, h_bw], dim=1).reshape(self.layers, *h_fw.shape[1:])
        c0 = torch.stack([c_fw, c_bw], dim=1).reshape(self.layers, *c_fw.shape[1:])
        out, _ = self.decoder(self.tgt_embedding(target_input), (h0, c0))
        return self.projection(out)


def summed_masked_xent(logits, target_output, mask):
    """Sum over real target positions of the softmax cross-entropy."""
    per_token = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target_output.reshape(-1), reduction="none"
    )
    return (per_token * mask.reshape(-1)).sum()


def synthetic_batch(generator, vocab_size, length, batch, device):
    """Source, target input, target output [length, batch] uniform ids made on the device;
    mask all ones."""
    shape = (length, batch)
    ids = [
        torch.randint(0, vocab_size, shape, generator=generator, device=device)
        for _ in range(3)
    ]
    mask = torch.ones(shape, device=device)
    return ids[0], ids[1], ids[2], mask


def add_common_args(parser, defaults):
    parser.add_argument("--vocab-size", type=int, default=defaults["vocab_size"])
    parser.add_argument("--emb", type=int, default=defaults["emb"])
    parser.add_argument("--hidden", type=int, default=defaults["hidden"])
    parser.add_argument(
        "--layers",
        type=int,
        default=defaults["layers"],
        help="encoder layers = decoder layers (bi encoder: layers/2 per direction)",
    )
    parser.add_argument("--src-len", type=int, default=defaults["src_len"])
    parser.add_argument("--batch-size", type=int, default=defaults["batch_size"])
    parser.add_argument("--warmup-batches", type=int, default=10)
    parser.add_argument("--timed-batches", type=int, default=20)
    parser.add_argument("--clip-norm", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )


def check_args(args):
    for name in ("vocab_size", "emb", "hidden", "src_len", "batch_size", "timed_batches"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.warmup_batches < 0:
        sys.exit(f"error: --warmup-batches {args.warmup_batches}: must be 0 or more")
    if args.layers < 2 or args.layers % 2 != 0:
        sys.exit(
            f"error: --layers {args.layers}: must be even and at least 2 "
            "(the bi encoder has layers/2 per direction)"
        )


def run_benchmark(args, device, autocast_dtype=None, synchronize=lambda: None):
    """Trains on synthetic data; returns a dict of results (words_per_sec, ...)."""
    torch.manual_seed(args.seed)
    model = NmtModel(args.vocab_size, args.emb, args.hidden, args.layers).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = None
    if autocast_dtype == torch.float16:
        scaler = torch.amp.GradScaler(device.type)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    words_per_batch = 2 * args.batch_size * args.src_len
    losses = []

    def step():
        source, tgt_in, tgt_out, mask = synthetic_batch(
            generator, args.vocab_size, args.src_len, args.batch_size, device
        )
        optimizer.zero_grad(set_to_none=True)
        if autocast_dtype is not None:
            with torch.autocast(device_type=device.type, dtype=autocast_dtype):
                logits = model(source, tgt_in)
            loss = summed_masked_xent(logits.float(), tgt_out, mask)
        else:
            loss = summed_masked_xent(model(source, tgt_in), tgt_out, mask)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if args.clip_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return loss

    for _ in range(args.warmup_batches):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(args.timed_batches):
        losses.append(step())
    synchronize()
    elapsed = time.perf_counter() - start
    words = words_per_batch * args.timed_batches
    target_tokens = args.batch_size * args.src_len
    return {
        "words_per_sec": words / elapsed,
        "timed_seconds": elapsed,
        "timed_batches": args.timed_batches,
        "warmup_batches": args.warmup_batches,
        "words": words,
        "final_loss_per_token": float(losses[-1].item()) / target_tokens,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": args.vocab_size,
        "emb": args.emb,
        "hidden": args.hidden,
        "layers": args.layers,
        "src_len": args.src_len,
        "batch_size": args.batch_size,
        "torch_version": torch.__version__,
    }


def report(result, label, as_json):
    print(
        f"{label}: {result['words_per_sec']:.1f} words/s "
        f"({result['words']} words in {result['timed_batches']} batches, "
        f"{result['timed_seconds']:.3f} s; {result['warmup_batches']} warm-up batches not "
        f"counted; loss/token {result['final_loss_per_token']:.3f})"
    )
    if as_json:
        print(json.dumps(result, sort_keys=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(
        parser,
        dict(vocab_size=8000, emb=256, hidden=256, layers=2, src_len=30, batch_size=64),
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--precision",
        choices=["f32", "bf16"],
        default="f32",
        help="bf16: the forward under torch.autocast('cpu', dtype=torch.bfloat16)",
    )
    args = parser.parse_args()
    check_args(args)
    if args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: must be at least 1")
    torch.set_num_threads(args.threads)
    autocast = torch.bfloat16 if args.precision == "bf16" else None
    try:
        result = run_benchmark(args, torch.device("cpu"), autocast_dtype=autocast)
    except RuntimeError as e:
        # oneDNN builds its bf16 LSTM only for CPUs with bf16 instructions (AVX-512 BF16,
        # AMX); elsewhere it refuses the primitive, and this run cannot be measured.
        if autocast is None or "could not create a primitive" not in str(e):
            raise
        reason = (
            f"PyTorch {torch.__version__} cannot run this model under autocast bf16 on "
            f"this CPU (oneDNN: {str(e).splitlines()[0]})"
        )
        sys.stderr.write(f"error: {reason}\n")
        if args.json:
            print(json.dumps({"unsupported": reason}))
        sys.exit(3)
    result["threads"] = args.threads
    result["device"] = "cpu"
    result["precision"] = args.precision
    # Peak resident set of the whole process (Linux reports KiB).
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report(result, f"pytorch cpu {args.precision}", args.json)


if __name__ == "__main__":
    main()
