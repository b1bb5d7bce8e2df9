#!/usr/bin/env python3
"""PyTorch baseline for the CPU matrix products: ``torch.mm`` at given shapes and layouts.

Each ``--shape M,N,K,LAYOUT`` is ``C[M, N] = op(A)·op(B)`` with LAYOUT ``NN`` (A stored
``[M, K]``, B ``[K, N]``), ``NT`` (B stored ``[N, K]`` and used transposed) or ``TN`` (A
stored ``[K, M]``), the transposed operand passed as a transposed view, as a model's
backward pass does. Operands are bf16 (``--dtype bf16``, f32 accumulation inside oneDNN)
or f32. The time of a shape is the median of calls repeated for ``--budget`` seconds.

Run ``python3 benches/torch_mm_cpu.py --threads 2 --shape 1920,1024,256,NN``: the last line
is one JSON object, ``{"torch": VERSION, "gflops": [G, ...]}``, one figure per shape in
order, for a Rust benchmark to parse.
"""

import argparse
import json
import sys
import time
import warnings

# torch warns at import when NumPy is absent; this benchmark does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    print("PyTorch is not installed: run scripts/bench-setup", file=sys.stderr)
    sys.exit(2)


def operands(m, n, k, layout, dtype):
    """A and B as the layout stores them, returned as the views the product reads."""
    gen = torch.Generator().manual_seed(0)
    if layout == "TN":
        a = torch.randn(k, m, generator=gen).to(dtype).t()
    else:
        a = torch.randn(m, k, generator=gen).to(dtype)
    if layout == "NT":
        b = torch.randn(n, k, generator=gen).to(dtype).t()
    else:
        b = torch.randn(k, n, generator=gen).to(dtype)
    return a, b


def seconds_per_call(a, b, budget):
    torch.mm(a, b)
    samples = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(samples) < 5:
        t = time.perf_counter()
        torch.mm(a, b)
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per shape")
    parser.add_argument(
        "--shape", action="append", required=True, help="M,N,K,LAYOUT (NN, NT or TN)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gflops = []
    for spec in args.shape:
        try:
            m, n, k, layout = spec.split(",")
            m, n, k = int(m), int(n), int(k)
        except ValueError:
            parser.error(f"--shape {spec}: expected M,N,K,LAYOUT such as 1920,1024,256,NN")
        if layout not in ("NN", "NT", "TN"):
            parser.error(f"--shape {spec}: the layout must be NN, NT or TN")
        a, b = operands(m, n, k, layout, dtype)
        gflops.append(2.0 * m * n * k / seconds_per_call(a, b, args.budget) * 1e-9)
    print(json.dumps({"torch": torch.__version__, "gflops": gflops}))


if __name__ == "__main__":
    main()
