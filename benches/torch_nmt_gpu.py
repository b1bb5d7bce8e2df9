#!/usr/bin/env python3
"""PyTorch baseline for the NMT training step on one CUDA GPU (cuDNN LSTMs).

Same model, loss, optimizer, synthetic data and words/s rule as torch_nmt_cpu.py (this
script imports them from there), with the benchmark's GPU defaults: vocab 50000, emb 512,
hidden 512, 4 encoder layers (2 per direction) + 4 decoder layers, length 100, batch 384.
``--amp bf16`` or ``--amp fp16`` runs the forward pass under autocast (fp16 with a
dynamic loss scale via GradScaler). Timing brackets the timed steps with
``torch.cuda.synchronize()``.

Run ``python3 benches/torch_nmt_gpu.py --json``: the last line is one JSON object with
``words_per_sec``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
    args = parser.parse_args()
    check_args(args)
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
    result = run_benchmark(
        args, device, autocast_dtype=dtype, synchronize=torch.cuda.synchronize
    )
    result["device"] = torch.cuda.get_device_name(device)
    result["amp"] = args.amp
    result["cudnn_version"] = torch.backends.cudnn.version()
    report(result, f"pytorch cuda ({args.amp})", args.json)


if __name__ == "__main__":
    main()
