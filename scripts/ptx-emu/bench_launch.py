#!/usr/bin/env python3
"""Times one emulated kernel launch with this tree's ptx_emu.py against the ptx_emu.py of
a git revision (the baseline), taking turns, and prints both, their medians and the ratio.

The launch is ``gemm_f32_nt`` of ptx/gemm.ptx on one 256-thread block (m 24, n 32,
k 16: the size of the emulated training tests' GEMMs). Both emulators must give the same
output bits, or the script fails.

Usage (numpy needed: .tools/pyenv/bin/python after scripts/check-ptx-emu):
    .tools/pyenv/bin/python scripts/ptx-emu/bench_launch.py --baseline REV [--rounds 6] [--launches 10]
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
M, N, K = 24, 32, 16


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(emu, mod):
    """One gemm_f32_nt launch on fresh memory; returns C's bits."""
    mem = emu.GlobalMemory()
    rng = np.random.default_rng(0)
    a = mem.alloc(rng.standard_normal(M * K).astype(np.float32), "a", "r")
    b = mem.alloc(rng.standard_normal(N * K).astype(np.float32), "b", "r")
    c = mem.alloc(np.zeros(M * N, np.float32), "c", "w")
    names = [p for p, _ in mod.entries["gemm_f32_nt"].params]
    mod.launch("gemm_f32_nt", (1, 1, 1), (256, 1, 1), mem,
               dict(zip(names, [a, b, c, M, N, K, K, K, N, 1.0, 0.0])), approx="hash")
    return mem.array("c", np.uint32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision of the baseline emulator")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--launches", type=int, default=10, help="launches per timing")
    args = ap.parse_args()
    try:
        text = subprocess.run(["git", "-C", ROOT, "show", f"{args.baseline}:scripts/ptx-emu/ptx_emu.py"],
                              check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"bench_launch: no scripts/ptx-emu/ptx_emu.py at --baseline {args.baseline}: "
                 f"{e.stderr.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ptx_emu_baseline.py")
        with open(path, "w") as f:
            f.write(text)
        emus = {"baseline": load(path, "ptx_emu_baseline"),
                "ours": load(os.path.join(HERE, "ptx_emu.py"), "ptx_emu_ours")}
    ptx = os.path.join(ROOT, "ptx", "gemm.ptx")
    mods = {k: e.Module.from_file(ptx) for k, e in emus.items()}
    outs = {k: launch(emus[k], mods[k]) for k in emus}  # also warms both up
    if not np.array_equal(outs["baseline"], outs["ours"]):
        sys.exit("bench_launch: the two emulators give different output bits")
    times = {k: [] for k in emus}
    for _ in range(args.rounds):
        for k in emus:
            start = time.perf_counter()
            for _ in range(args.launches):
                launch(emus[k], mods[k])
            times[k].append((time.perf_counter() - start) / args.launches * 1e3)
    for k in emus:
        print(f"{k:8s} ms per launch: {' / '.join(f'{t:.1f}' for t in times[k])}"
              f"  (median {statistics.median(times[k]):.1f})")
    ratio = statistics.median(times["ours"]) / statistics.median(times["baseline"])
    print(f"ratio ours / baseline (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
