#!/usr/bin/env python3
"""PyTorch baselines for ringtrain-cuda's GPU benchmarks, measured on the same device.

Prints tab-separated lines that scripts/gpu-check joins with the `RESULT` lines
of the gpu_throughput bench (same names):

    TORCH <name> <unit> <value>

* gemm_{bf16,f16}_{nn,nt,tn} and gemm_f32_nn at M = 38400, N = 2048 and 50000,
  K = 512: torch.matmul (cuBLAS) in TFLOP/s; f32 with TF32 disabled, so it is
  an f32 SIMT-vs-SIMT comparison like ours.
* softmax_xent_forward/backward at 38400 x 50000: torch.nn.functional.cross_entropy
  (reduction="none") forward, and its backward, converted to GB/s with the same
  byte counts the bench uses (an effective figure: torch writes log-probabilities).
* copy: dst.copy_(src) bandwidth (read + written bytes), a cross-check of the
  bench's own copy baseline.

Timing: CUDA events, warm-up runs, median of the timed runs.
Usage: python3 torch_gpu_baselines.py [--quick]
"""
import statistics
import sys

import torch
import torch.nn.functional as F


def median_ms(fn, runs, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(runs):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def emit(name, unit, value):
    print(f"TORCH\t{name}\t{unit}\t{value:.1f}", flush=True)


def gemm(dtype_name, trans, m, n, k, runs):
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype_name]
    dev = "cuda"
    # Stored layouts as in ptx/gemm.ptx: nn A[m,k] B[k,n]; nt B[n,k]; tn A[k,m].
    a = torch.randn((k, m) if trans == "tn" else (m, k), device=dev, dtype=dtype)
    b = torch.randn((n, k) if trans == "nt" else (k, n), device=dev, dtype=dtype)
    a_op = a.t() if trans == "tn" else a
    b_op = b.t() if trans == "nt" else b
    out_dtype = torch.float32
    if dtype_name == "f32":
        fn = lambda: torch.matmul(a_op, b_op)
    else:
        # Our kernels accumulate in f32 and write f32 C; ask cuBLAS for f32 output too.
        out = torch.empty((m, n), device=dev, dtype=out_dtype)
        if HAS_OUT_DTYPE:
            fn = lambda: torch.mm(a_op, b_op, out_dtype=out_dtype, out=out)
        else:  # older torch: C comes out in the input type (half the bytes written)
            fn = lambda: torch.matmul(a_op, b_op)
    ms = median_ms(fn, runs)
    emit(f"gemm_{dtype_name}_{trans} {m}x{n}x{k}", "TFLOP/s", 2.0 * m * n * k / (ms * 1e-3) / 1e12)


def softmax(rows, vocab, runs):
    logits = (torch.rand((rows, vocab), device="cuda") * 8 - 4).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    fwd_bytes = rows * vocab * 4 + rows * 16
    bwd_bytes = 2 * rows * vocab * 4 + rows * 12
    ms = median_ms(lambda: F.cross_entropy(logits, labels, reduction="none"), runs)
    emit(f"softmax_xent_forward {rows}x{vocab}", "GB/s", fwd_bytes / (ms * 1e-3) / 1e9)
    loss = F.cross_entropy(logits, labels, reduction="none")
    grad = torch.ones_like(loss)
    ms = median_ms(lambda: torch.autograd.grad(loss, logits, grad, retain_graph=True), runs)
    emit(f"softmax_xent_backward {rows}x{vocab}", "GB/s", bwd_bytes / (ms * 1e-3) / 1e9)


def copy(nbytes, runs):
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), runs)
    emit(f"copy {nbytes >> 20} MiB", "GB/s", 2 * nbytes / (ms * 1e-3) / 1e9)


def has_out_dtype():
    try:
        a = torch.ones((8, 8), device="cuda", dtype=torch.bfloat16)
        out = torch.empty((8, 8), device="cuda", dtype=torch.float32)
        torch.mm(a, a, out_dtype=torch.float32, out=out)
        return True
    except (TypeError, RuntimeError):
        return False


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    if not torch.cuda.is_available():
        sys.exit("torch_gpu_baselines: no CUDA device visible to PyTorch")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    HAS_OUT_DTYPE = has_out_dtype()
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"f32-output low-precision mm: {HAS_OUT_DTYPE}", flush=True)
    m = 384 if quick else 38400
    runs = 3 if quick else 10
    copy(1 << 30 if not quick else 1 << 24, runs)
    softmax(384 if quick else 38400, 50000, runs)
    for n in (2048, 50000):
        for trans in ("nn", "nt", "tn"):
            gemm("bf16", trans, m, n, 512, runs)
        gemm("f16", "nn", m, n, 512, runs)
        gemm("f32", "nn", m, n, 512, runs)
