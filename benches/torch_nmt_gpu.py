#!/usr/bin/env python3
"""PyTorch baseline for the NMT training step on one CUDA GPU (cuDNN LSTMs).

Same model, loss, optimizer, synthetic data and words/s rule as torch_nmt_cpu.py (this
script imports them from there), with the benchmark's GPU defaults: vocab 50000, emb 512,
hidden 512, 4 encoder layers (2 per direction) + 4 decoder layers, length 100, batch 384.
``--amp bf16`` or ``--amp fp16`` runs the forward pass under autocast (fp16 with a
dynamic loss scale via GradScaler). Timing brackets the timed steps with
``torch.cuda.synchronize()``.

Memory: ``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated()`` over the run
(reset before it). ``--find-max-batch`` then searches the largest batch size that trains
(one step, Adam) without running out of device memory: doubling from ``--batch-size``,
then bisecting down to a multiple of 32 (``max_batch.py``, the search gpu-check runs for
ringtrain too); it is reported as ``max_batch_size``, and the search's tries and end as
``max_batch_search``. ``--max-batch-seconds`` bounds the search: it then stops where the
budget ran out, and ``max_batch_search`` says so.

Run ``python3 benches/torch_nmt_gpu.py --json``: the last line is one JSON object with
``words_per_sec``.
"""

import argparse
import copy
import dataclasses
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import max_batch  # noqa: E402
from torch_nmt_cpu import add_common_args, check_args, report, run_benchmark, torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(
        parser,
        dict(vocab_size=50000, emb=512, hidden=512, layers=4, src_len=100, batch_size=384),
    )
    parser.add_argument(
        "--amp",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="autocast precision for the forward pass (default: none, fp32)",
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument(
        "--find-max-batch",
        action="store_true",
        help="also search the largest batch size that fits (reported as max_batch_size)",
    )
    parser.add_argument(
        "--max-batch-seconds",
        type=float,
        help="time budget of that search; it stops where the budget runs out and says so",
    )
    args = parser.parse_args()
    check_args(args)
    if args.max_batch_seconds is not None and args.max_batch_seconds <= 0:
        parser.error(f"--max-batch-seconds {args.max_batch_seconds:g}: give a positive budget")
    if not torch.cuda.is_available():
        sys.exit(
            "error: no CUDA device is visible to PyTorch (torch.cuda.is_available() is "
            "False); run on a GPU machine with a CUDA build of torch, or use "
            "benches/torch_nmt_cpu.py"
        )
    if args.device < 0 or args.device >= torch.cuda.device_count():
        sys.exit(
            f"error: --device {args.device}: this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    torch.backends.cudnn.enabled = True
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    torch.cuda.reset_peak_memory_stats(device)
    result = run_benchmark(
        args, device, autocast_dtype=dtype, synchronize=torch.cuda.synchronize
    )
    result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if args.find_max_batch:
        found = max_batch.search(
            lambda batch, _left: (
                max_batch.FITS if fits(args, device, dtype, batch) else max_batch.OUT_OF_MEMORY
            ),
            args.batch_size,
            seconds=args.max_batch_seconds,
        )
        result["max_batch_size"] = found.largest
        result["max_batch_search"] = dataclasses.asdict(found)
    result["device"] = torch.cuda.get_device_name(device)
    result["amp"] = args.amp
    result["cudnn_version"] = torch.backends.cudnn.version()
    report(result, f"pytorch cuda ({args.amp})", args.json)


def fits(args, device, dtype, batch):
    """True when one training step at `batch` runs without running out of memory."""
    trial = copy.copy(args)
    trial.batch_size, trial.warmup_batches, trial.timed_batches = batch, 0, 1
    try:
        run_benchmark(trial, device, autocast_dtype=dtype, synchronize=torch.cuda.synchronize)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
