#!/usr/bin/env python3
"""Runs every entry of every ptx/*.ptx through the emulator (ptx_emu.py) on small
random inputs and compares the results with numpy references that implement the
definitions of the CPU kernels in crates/kernels (layouts and conventions in the
crate docs, crates/kernels/src/lib.rs; each function in its module there), of the
model backend's CPU ops (crates/model/src/backend/cpu.rs) and of the GEMM as
documented in crates/cuda/src/gemm.rs.

Usage:  python3 scripts/ptx-emu/check_all.py [--ptx-dir DIR] [--only NAME ...] [--exact-approx]

* Several shapes per entry, including 1 and sizes that are not multiples of the
  tile / vector width, several launch configurations (block sizes, grids small
  enough that the grid-stride loops iterate), and misaligned pointers where the
  kernel has alignment-dependent paths.
* Output buffers are poisoned (NaN, or NaN bit patterns for f16 / bf16) and
  declared write-only, so a kernel that reads an output, or skips an element,
  fails.  Inputs are read-only.  The emulator itself reports out-of-bounds,
  misaligned and racy accesses (see ptx_emu.py).
* Approximate PTX instructions (ex2.approx, lg2.approx, ...) are perturbed within
  their documented error (pass --exact-approx to round them exactly instead).

Error measures and bounds, per output, "err" in the table is the largest over all
shapes and outputs of the entry:
  gemm_*               max|C - ref| / max|ref|, ref in float64 from the exact
                       inputs; bound 1e-5 (f32 accumulation over k <= 100).
  lstm_*               max |x - ref| / max(1, |ref|), ref in float64 from the
                       f32 pre-activations; bound 4e-6 (ex2.approx-based
                       sigmoid / tanh, see ptx/lstm.ptx).
  softmax forward      lse, loss: |x - ref| / max(1, |ref|); bound 4e-6
                       (ptx/softmax.ptx states 2e-6 * max(1, |lse|) + 1e-6).
  softmax backward     |g - ref| / |scale * mask|; bound 4e-6.
  casts, sum_into, has_non_finite, sgd, momentum, scale, clip scale:
                       bit-exact ("err" is the fraction of differing elements;
                       NaN matches any NaN); the non-finite flag must be exact
                       and a flag that is already set must stay set.
  adam / adamw         max|x - ref| / max|ref| per output; bound 2e-6 (the GPU
                       raises beta to the step by repeated squaring, the CPU
                       with pow).  Infinite parameters and -0.0 gradients with
                       weight_decay 0 must match exactly (the decay term is
                       skipped, as in the CPU kernels and PyTorch).
  sum_of_squares       |acc - ref| / ref, ref exact in float64; bound 1e-12.
  model_ops.ptx        (twins of crates/model/src/backend/cpu.rs)
    fill, gather_rows, scatter_add_rows, column_sums, add_row_bias, binary_*,
    in_place_*, column_sums_partial / _combine (against float32 chunk sums):
                       bit-exact against float32 references that add in the CPU's
                       order (rows r = 0, 1, ...); repeated ids, an id outside the
                       table (gather: NaN row; scatter: segment skipped), -0.0 and
                       Inf / NaN inputs included.
    unary_sigmoid/tanh max |x - ref| / max(1, |ref|), ref in float64; bound 4e-6
                       (the ex2.approx math of ptx/lstm.ptx).
    sum_partials       |fsum(partials) - exact sum| / sum|x|; bound 2^-24 + 4096 * 2^-52
                       (ptx/model_ops.ptx: the f32 rounding of each block's f64 partial).
    transpose          bit-exact against numpy's transpose of the strided source
                       (row stride > cols, Inf / NaN / -0.0 included).

Exit status 1 if any entry fails, has no check here, or an emulator error occurs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from ptx_emu import EmuError, GlobalMemory, Module  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---------------------------------------------------------------------------
# Reference rounding (independent of the emulator's conversions)
# ---------------------------------------------------------------------------


def round_to_format(x, mant_bits, min_exp, max_exp):
    """float32 array -> float64 values rounded to nearest even in a binary format
    with ``mant_bits`` fraction bits, normal exponents [min_exp, max_exp]
    (subnormals below), overflow to infinity.  NaN stays NaN."""
    x = np.asarray(x, np.float32).astype(np.float64)
    out = np.empty_like(x)
    fin = np.isfinite(x)
    out[~fin] = x[~fin]
    v = x[fin]
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    # log2 may be off by one at exact powers of two: fix the exponent exactly
    e = np.where(2.0 ** e > a, e - 1, e)
    e = np.where(2.0 ** (e + 1) <= a, e + 1, e)
    e = np.maximum(e, min_exp)
    quantum = 2.0 ** (e - mant_bits)
    q = np.rint(v / quantum) * quantum  # rint: round half to even
    largest = (2.0 - 2.0 ** -mant_bits) * 2.0 ** max_exp
    q = np.where(np.abs(q) > largest, np.copysign(np.inf, v), q)
    out[fin] = q
    return out


def ref_f16_bits(x):
    r = round_to_format(x, 10, -14, 15)
    with np.errstate(invalid="ignore"):
        bits = r.astype(np.float16).view(np.uint16)  # exact: r is representable
    return np.where(np.isnan(r), np.uint16(0x7E00), bits)


def ref_bf16_bits(x):
    r = round_to_format(x, 7, -126, 127)
    bits = (r.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact
    return np.where(np.isnan(r), np.uint16(0x7FC0), bits)


def f16_bits_to_f32(b):
    return np.asarray(b, np.uint16).view(np.float16).astype(np.float32)


def bf16_bits_to_f32(b):
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def half_is_nan(bits, ty):
    bits = np.asarray(bits, np.uint16)
    if ty == "f16":
        return ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0)
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


def bits_mismatch(got, ref, ty):
    """Fraction of differing 16-bit patterns (any NaN matches any NaN)."""
    gn, rn = half_is_nan(got, ty), half_is_nan(ref, ty)
    bad = np.where(gn | rn, gn != rn, got != ref)
    return bad.mean() if len(bad) else 0.0


def f32_mismatch(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    gn, rn = np.isnan(got), np.isnan(ref)
    bad = np.where(gn | rn, gn != rn, got.view(np.uint32) != ref.view(np.uint32))
    return bad.mean() if len(bad) else 0.0


def rel_err_norm(got, ref):
    """max|got - ref| / max|ref| over the finite reference values; inf when a
    non-finite reference value (Inf, NaN) is not matched exactly (any NaN matches)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.size == 0:
        return 0.0
    if (np.isnan(got) != np.isnan(ref)).any():
        return math.inf
    ok = np.isfinite(ref)
    if (got[~ok & ~np.isnan(ref)] != ref[~ok & ~np.isnan(ref)]).any() or not np.isfinite(got[ok]).all():
        return math.inf
    scale = max(np.abs(ref[ok]).max(initial=0.0), 1e-30)
    return float(np.abs(got[ok] - ref[ok]).max(initial=0.0) / scale)


def rel_err_floor1(got, ref):
    """max |got - ref| / max(1, |ref|), elementwise."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.size == 0:
        return 0.0
    if (np.isnan(got) != np.isnan(ref)).any() or (np.isinf(got) != np.isinf(ref)).any():
        return math.inf
    ok = np.isfinite(ref)
    return float((np.abs(got[ok] - ref[ok]) / np.maximum(1.0, np.abs(ref[ok]))).max(initial=0.0))


# ---------------------------------------------------------------------------
# Launch helper
# ---------------------------------------------------------------------------


class Launch:
    """Buffers of one launch; arguments are matched to PTX parameter names."""

    def __init__(self, mod, entry, opts):
        self.mod, self.entry, self.opts = mod, entry, opts
        self.mem = GlobalMemory()
        self.args = {}

    def buf(self, name, array, access="rw", offset=0):
        self.args[name] = self.mem.alloc(array, name, access, offset)

    def run(self, grid, block, **scalars):
        ent = self.mod.entries[self.entry]
        args = {}
        given = dict(self.args, **scalars)
        for pname, _ in ent.params:
            short = pname[len(self.entry) + 1:] if pname.startswith(self.entry + "_") else pname
            if short not in given:
                raise EmuError(f"{self.entry}: the check supplies no argument for parameter {pname}")
            args[pname] = given[short]
        self.opts["launches"] += 1
        self.mod.launch(self.entry, grid, block, self.mem, args, seed=self.opts["seed"],
                        approx=self.opts["approx"], coverage=self.opts["coverage"])

    def out(self, name, dtype):
        return self.mem.array(name, dtype)


DATA_SEED = [1]  # set from --seed


def rng_for(entry, shape_index):
    """A generator seeded from --seed, the entry name and the shape (reproducible runs)."""
    return np.random.default_rng([DATA_SEED[0], sum(map(ord, entry)), shape_index])


# ---------------------------------------------------------------------------
# gemm.ptx
# ---------------------------------------------------------------------------

NAN16 = {"f16": 0x7E00, "bf16": 0x7FC0}


def _gemm_stored(rng, rows, cols, ld, ty):
    """Random [rows, cols] in a tight allocation of (rows-1)*ld + cols elements with
    NaN padding; returns (flat storage, exact values as float64)."""
    n = max((rows - 1) * ld + cols, 0)
    if ty == "f32":
        flat = np.full(max(n, 4), np.nan, np.float32)
        vals = rng.standard_normal((rows, cols)).astype(np.float32)
        for r in range(rows):
            flat[r * ld:r * ld + cols] = vals[r]
        return flat, vals.astype(np.float64)
    flat = np.full(max(n, 8), NAN16[ty], np.uint16)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    bits = ref_f16_bits(x) if ty == "f16" else ref_bf16_bits(x)
    for r in range(rows):
        flat[r * ld:r * ld + cols] = bits[r]
    vals = f16_bits_to_f32(bits) if ty == "f16" else bf16_bits_to_f32(bits)
    return flat, vals.astype(np.float64)


def check_gemm(mod, entry, opts):
    ty, tr = entry.split("_")[1:]
    tile = 64 if ty == "f32" else 128
    # (m, n, k, extra lda, extra ldb, extra ldc, alpha, beta, c byte offset)
    shapes = [(1, 1, 1, 0, 0, 0, 1.0, 0.0, 0),
              (70, 75, 21, 1, 3, 2, 1.0, 0.0, 0),
              (130, 70, 40, 0, 0, 1, -1.0, 0.5, 4),
              (65, 131, 33, 2, 0, 4, 0.5, 2.0, 0),
              (5, 7, 0, 0, 0, 0, 1.0, 1.5, 0),
              (9 * tile + 1, 9, 3, 0, 0, 0, 1.0, 0.0, 0)]  # > 8 block rows: tile grouping
    if ty != "f32":
        shapes[2] = (130, 140, 40, 0, 0, 1, -1.0, 0.5, 4)
        shapes[3] = (33, 250, 100, 8, 0, 0, 2.0, 0.0, 8)
    results = []
    for si, (m, n, k, xa, xb, xc, alpha, beta, coff) in enumerate(shapes):
        rng = rng_for(entry, si)
        lda = (k if tr[0] == "n" else m) + xa
        ldb = (n if tr[1] == "n" else k) + xb
        if ty != "f32":  # tensor-core contract: lda, ldb multiples of 8
            lda, ldb = -(-max(lda, 1) // 8) * 8, -(-max(ldb, 1) // 8) * 8
        ldc = n + xc
        L = Launch(mod, entry, opts)
        if tr[0] == "n":
            aflat, A = _gemm_stored(rng, m, k, lda, ty)
        else:
            aflat, At = _gemm_stored(rng, k, m, lda, ty)
            A = At.T
        if tr[1] == "n":
            bflat, B = _gemm_stored(rng, k, n, ldb, ty)
        else:
            bflat, Bt = _gemm_stored(rng, n, k, ldb, ty)
            B = Bt.T
        cflat = np.full((m - 1) * ldc + n, np.nan, np.float32)
        C0 = np.zeros((m, n))
        if beta != 0:
            C0 = rng.standard_normal((m, n)).astype(np.float32)
            for r in range(m):
                cflat[r * ldc:r * ldc + n] = C0[r]
            C0 = C0.astype(np.float64)
        # with k == 0, A and B must not be read at all
        L.buf("a", aflat, "w" if k == 0 else "r")
        L.buf("b", bflat, "w" if k == 0 else "r")
        L.buf("c", cflat, "w" if beta == 0 else "rw", offset=coff)
        L.run((-(-n // tile), -(-m // tile), 1), (256, 1, 1), m=m, n=n, k=k, lda=lda, ldb=ldb,
              ldc=ldc, alpha=alpha, beta=beta)
        out = L.out("c", np.float32)
        got = np.stack([out[r * ldc:r * ldc + n] for r in range(m)]).astype(np.float64)
        ref = alpha * (A @ B) + beta * C0 if k else beta * C0
        err = rel_err_norm(got, ref)
        for r in range(m - 1):  # the padding between rows of C stays untouched (NaN)
            if not np.isnan(out[r * ldc + n:(r + 1) * ldc]).all():
                raise EmuError(f"{entry}: wrote C padding (row {r}, ldc {ldc})")
        results.append((f"m{m} n{n} k{k} ld+({xa},{xb},{xc}) a{alpha} b{beta} c+{coff}", err))
    return results, 1e-5


# ---------------------------------------------------------------------------
# lstm.ptx
# ---------------------------------------------------------------------------

LSTM_SHAPES = [(1, 1), (3, 5), (2, 37), (5, 130)]
LSTM_LAUNCH = [((1, 1, 1), (256, 1, 1)), ((2, 1, 1), (96, 1, 1)), ((3, 1, 1), (256, 1, 1)),
               ((2, 1, 1), (128, 1, 1))]


def _sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-x))


def _lstm_gate_inputs(rng, batch, hidden):
    g = (rng.standard_normal((batch, 4 * hidden)) * 3).astype(np.float32)
    flat = g.ravel()
    k = max(1, flat.size // 10)  # some saturating pre-activations
    flat[rng.integers(0, flat.size, k)] = rng.choice([-30.0, -21.0, 19.0, 25.0, 40.0], k)
    return g


def _lstm_forward_ref(pre, c_prev, hidden):
    pre = pre.astype(np.float64)
    i = _sigmoid64(pre[:, :hidden])
    f = _sigmoid64(pre[:, hidden:2 * hidden])
    g = np.tanh(pre[:, 2 * hidden:3 * hidden])
    o = _sigmoid64(pre[:, 3 * hidden:])
    c = f * c_prev + i * g
    h = o * np.tanh(c)
    return c, h, np.concatenate([i, f, g, o], 1)


def check_lstm_forward(mod, entry, opts, step_variant=False):
    results = []
    for si, (batch, hidden) in enumerate(LSTM_SHAPES):
        rng = rng_for(entry, si)
        grid, block = LSTM_LAUNCH[si]
        bias = rng.standard_normal(4 * hidden).astype(np.float32)
        c_prev = (rng.standard_normal((batch, hidden)) * 2).astype(np.float32)
        L = Launch(mod, entry, opts)
        nan = np.full(batch * hidden, np.nan, np.float32)
        if step_variant:
            steps = 3
            step = si % steps
            proj = np.stack([_lstm_gate_inputs(rng, batch, hidden) for _ in range(steps)])
            rec = rng.standard_normal((batch, 4 * hidden)).astype(np.float32)
            pre = (proj[step] + rec) + bias  # f32, in this order (as the CPU kernel)
            L.buf("input_proj", proj, "r")
            L.buf("recurrent", rec, "r")
        else:
            gates = _lstm_gate_inputs(rng, batch, hidden)
            pre = gates + bias
            L.buf("gates", gates, "r")
        L.buf("bias", bias, "r")
        L.buf("c_prev", c_prev, "r")
        L.buf("c", nan, "w")
        L.buf("h", nan, "w")
        L.buf("act", np.full(4 * batch * hidden, np.nan, np.float32), "w")
        extra = dict(step=step, steps=steps) if step_variant else {}
        L.run(grid, block, batch=batch, hidden=hidden, **extra)
        c, h, act = _lstm_forward_ref(pre, c_prev.astype(np.float64), hidden)
        err = max(rel_err_floor1(L.out("c", np.float32), c.ravel()),
                  rel_err_floor1(L.out("h", np.float32), h.ravel()),
                  rel_err_floor1(L.out("act", np.float32), act.ravel()))
        results.append((f"batch{batch} H{hidden} grid{grid[0]}x{block[0]}" +
                        (f" step{step}/{steps}" if step_variant else ""), err))
    return results, 4e-6


def check_lstm_forward_step(mod, entry, opts):
    return check_lstm_forward(mod, entry, opts, step_variant=True)


def check_lstm_backward(mod, entry, opts):
    results = []
    for si, (batch, hidden) in enumerate(LSTM_SHAPES):
        rng = rng_for(entry, si)
        grid, block = LSTM_LAUNCH[si]
        pre = _lstm_gate_inputs(rng, batch, hidden)
        c_prev = (rng.standard_normal((batch, hidden)) * 2).astype(np.float32)
        c64, _, act64 = _lstm_forward_ref(pre, c_prev.astype(np.float64), hidden)
        act = act64.astype(np.float32)
        c = c64.astype(np.float32)
        dh = rng.standard_normal((batch, hidden)).astype(np.float32)
        dc = rng.standard_normal((batch, hidden)).astype(np.float32)
        L = Launch(mod, entry, opts)
        for name, arr in (("act", act), ("c_prev", c_prev), ("c", c), ("dh", dh), ("dc", dc)):
            L.buf(name, arr, "r")
        L.buf("dgates", np.full(4 * batch * hidden, np.nan, np.float32), "w")
        L.buf("dc_prev", np.full(batch * hidden, np.nan, np.float32), "w")
        L.run(grid, block, batch=batch, hidden=hidden)
        a = act.astype(np.float64)
        i, f, g, o = (a[:, k * hidden:(k + 1) * hidden] for k in range(4))
        tc = np.tanh(c.astype(np.float64))
        dh64, dc64 = dh.astype(np.float64), dc.astype(np.float64)
        dct = dc64 + dh64 * o * (1 - tc * tc)
        dg = np.concatenate([dct * g * (i * (1 - i)), dct * c_prev * (f * (1 - f)),
                             dct * i * (1 - g * g), dh64 * tc * (o * (1 - o))], 1)
        err = max(rel_err_floor1(L.out("dgates", np.float32), dg.ravel()),
                  rel_err_floor1(L.out("dc_prev", np.float32), (dct * f).ravel()))
        results.append((f"batch{batch} H{hidden} grid{grid[0]}x{block[0]}", err))
    return results, 4e-6


# ---------------------------------------------------------------------------
# softmax.ptx
# ---------------------------------------------------------------------------

def _softmax_inputs(rng, rows, vocab, bad_label_row):
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    if rows > 1:
        logits[1] *= 7.0  # larger magnitudes (up to ~30)
        np.clip(logits[1], -30, 30, out=logits[1])
    labels = rng.integers(0, vocab, rows).astype(np.uint32)
    mask = rng.choice(np.array([1.0, 1.0, 0.0, 0.5, -0.25], np.float32), rows).astype(np.float32)
    if rows > 4:
        logits[4] = (rng.uniform(-1.0, 1.0, vocab) * 1e4).astype(np.float32)  # CPU: finite to 1e4
    if rows > 2:
        mask[2] = 0.0
        labels[2] = vocab + 5  # masked row: its label is not checked
    if bad_label_row is not None and rows > bad_label_row:
        mask[bad_label_row] = 1.0
        labels[bad_label_row] = vocab  # out of range with a non-zero mask -> NaN loss
    return logits, labels, mask


SOFTMAX_CASES = {
    # variant: list of (rows, vocab, grid, block, logits byte offset)
    "warp": [(1, 1, (1, 1, 1), (32, 1, 1), 0), (5, 7, (1, 1, 1), (64, 1, 1), 0),
             (9, 33, (2, 1, 1), (64, 1, 1), 4), (4, 100, (1, 1, 1), (256, 1, 1), 0),
             (2, 1000, (1, 1, 1), (64, 1, 1), 0)],
    "block": [(1, 1, (1, 1, 1), (32, 1, 1), 0), (3, 5, (2, 1, 1), (64, 1, 1), 4),
              (5, 257, (2, 1, 1), (128, 1, 1), 8), (3, 1030, (2, 1, 1), (256, 1, 1), 4),
              (2, 50003, (1, 1, 1), (512, 1, 1), 4)],  # the NMT vocabulary size, ragged
}


def _lse_ref(logits):
    x = logits.astype(np.float64)
    m = x.max(1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(1, keepdims=True))).ravel()


def check_softmax_forward(mod, entry, opts):
    variant = entry.rsplit("_", 1)[1]
    results = []
    for si, (rows, vocab, grid, block, off) in enumerate(SOFTMAX_CASES[variant]):
        rng = rng_for(entry, si)
        logits, labels, mask = _softmax_inputs(rng, rows, vocab, bad_label_row=3)
        L = Launch(mod, entry, opts)
        L.buf("logits", logits, "r", offset=off)
        L.buf("labels", labels, "r")
        L.buf("mask", mask, "r")
        L.buf("loss", np.full(rows, np.nan, np.float32), "w")
        L.buf("lse", np.full(rows, np.nan, np.float32), "w")
        L.run(grid, block, rows=rows, vocab=vocab)
        lse = _lse_ref(logits)
        loss = np.zeros(rows)
        for r in range(rows):
            if mask[r] != 0:
                loss[r] = (mask[r] * (lse[r] - logits[r, labels[r]])
                           if labels[r] < vocab else np.nan)
        err = max(rel_err_floor1(L.out("lse", np.float32), lse),
                  rel_err_floor1(L.out("loss", np.float32), loss))
        results.append((f"rows{rows} vocab{vocab} grid{grid[0]}x{block[0]} logits+{off}", err))
    return results, 4e-6


def check_softmax_backward(mod, entry, opts):
    variant = entry.rsplit("_", 1)[1]
    results = []
    for si, (rows, vocab, grid, block, off) in enumerate(SOFTMAX_CASES[variant]):
        rng = rng_for(entry, si)
        logits, labels, mask = _softmax_inputs(rng, rows, vocab, bad_label_row=None)
        lse = _lse_ref(logits).astype(np.float32)
        scale = 0.75
        L = Launch(mod, entry, opts)
        L.buf("logits", logits, "rw", offset=off)
        L.buf("lse", lse, "r")
        L.buf("labels", labels, "r")
        L.buf("mask", mask, "r")
        L.run(grid, block, scale=scale, rows=rows, vocab=vocab)
        got = L.out("logits", np.float32).reshape(rows, vocab).astype(np.float64)
        p = np.exp(logits.astype(np.float64) - lse.astype(np.float64)[:, None])
        onehot = np.zeros((rows, vocab))
        err = 0.0
        for r in range(rows):
            if mask[r] == 0:
                if (got[r] != 0).any() or np.isnan(got[r]).any():
                    raise EmuError(f"{entry}: masked row {r} has a non-zero gradient")
                continue
            onehot[r, labels[r]] = 1.0
            ref = (p[r] - onehot[r]) * scale * mask[r]
            if np.isnan(got[r]).any():
                err = math.inf
            else:
                err = max(err, float(np.abs(got[r] - ref).max() / abs(scale * mask[r])))
        results.append((f"rows{rows} vocab{vocab} grid{grid[0]}x{block[0]} logits+{off}", err))
    return results, 4e-6


# ---------------------------------------------------------------------------
# fp16.ptx
# ---------------------------------------------------------------------------

# (n, grid, block, byte offset of the 32-bit side, byte offset of the 16-bit side)
CAST_CASES = [(1, (1, 1, 1), (256, 1, 1), 0, 0), (7, (1, 1, 1), (64, 1, 1), 0, 2),
              (37, (2, 1, 1), (32, 1, 1), 4, 6), (300, (2, 1, 1), (64, 1, 1), 0, 0),
              (1003, (3, 1, 1), (256, 1, 1), 8, 4), (64, (1, 1, 1), (96, 1, 1), 4, 0),
              (3, (1, 1, 1), (32, 1, 1), 0, 2)]  # fewer elements than the alignment head


def _cast_source(rng, n, ty, special):
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    if ty == "bf16" and n >= 4:
        # exact ties between two bf16 values (round to even), and near-ties
        base = rng.integers(0x3F000000, 0x40800000, n // 4).astype(np.uint32) & 0xFFFF0000
        x[: n // 4] = (base | 0x8000).view(np.float32)
    if ty == "f16" and n >= 4:
        # f16 ties, subnormal results and overflow after scaling
        m = rng.integers(0, 1024, n // 4)
        x[: n // 4] = ((1024 + m) * 2.0 ** -10 + 2.0 ** -11).astype(np.float32)
        x[n // 4: n // 4 + 2] = np.float32(3e-6)  # f16 subnormal range after scale 1
    if special and n >= 3:
        x[n // 2] = np.inf if ty == "f16" else np.nan
        x[-1] = np.float32(7e4) if ty == "f16" else np.float32(3e38)
    return x


def check_cast_to_half(mod, entry, opts):
    ty = "f16" if "_f16_" in entry else "bf16"
    conv = ref_f16_bits if ty == "f16" else ref_bf16_bits
    results = []
    for si, (n, grid, block, off32, off16) in enumerate(CAST_CASES):
        rng = rng_for(entry, si)
        special = si in (2, 4)
        src = _cast_source(rng, n, ty, special)
        scale = np.float32(1.0) if si % 2 else np.float32(256.0 if ty == "f16" else 1024.0)
        if ty == "f16" and si % 2 == 0:
            src = (src / np.float32(256.0)).astype(np.float32)
        L = Launch(mod, entry, opts)
        L.buf("src", src, "r", offset=off32)
        L.buf("dst", np.full(n, NAN16[ty], np.uint16), "w", offset=off16)
        flag0 = 1 if si == 5 else 0  # a set flag must stay set (the kernel never clears it)
        L.buf("flag", np.array([flag0], np.uint32), "rw")
        L.run(grid, block, scale=float(scale), n=n)
        scaled = (src * scale).astype(np.float32)
        ref = conv(scaled)
        got = L.out("dst", np.uint16)
        err = bits_mismatch(got, ref, ty)
        exp_mask = 0x7C00 if ty == "f16" else 0x7F80
        want_flag = max(flag0, int(((ref & exp_mask) == exp_mask).any()))
        flag = int(L.out("flag", np.uint32)[0])
        if flag != want_flag:
            raise EmuError(f"{entry}: flag {flag}, expected {want_flag} (n {n})")
        results.append((f"n{n} grid{grid[0]}x{block[0]} src+{off32} dst+{off16} scale{scale:g} "
                        f"flag{want_flag}", err))
    return results, 0.0


def check_cast_from_half(mod, entry, opts):
    ty = "f16" if entry.startswith("f16") else "bf16"
    results = []
    for si, (n, grid, block, off32, off16) in enumerate(CAST_CASES):
        rng = rng_for(entry, si)
        bits = rng.integers(0, 1 << 16, n).astype(np.uint16)  # every pattern class
        inv = np.float32(1.0 / 1024.0) if si % 2 else np.float32(0.3)
        L = Launch(mod, entry, opts)
        L.buf("src", bits, "r", offset=off16)
        L.buf("dst", np.full(n, np.nan, np.float32), "w", offset=off32)
        L.run(grid, block, inv_scale=float(inv), n=n)
        wide = f16_bits_to_f32(bits) if ty == "f16" else bf16_bits_to_f32(bits)
        ref = (wide * inv).astype(np.float32)
        err = f32_mismatch(L.out("dst", np.float32), ref)
        results.append((f"n{n} grid{grid[0]}x{block[0]} src+{off16} dst+{off32}", err))
    return results, 0.0


def check_cast_to_f16_loss_scaled(mod, entry, opts):
    """The loss scale is read from device memory and multiplies the host factor."""
    results = []
    for si, (n, grid, block, off32, off16) in enumerate(CAST_CASES):
        rng = rng_for(entry, si)
        src = (_cast_source(rng, n, "f16", si in (2, 4)) / np.float32(4096.0)).astype(np.float32)
        loss = np.float32(2.0 ** (12 + si % 3))
        factor = np.float32(1.0 / (3 + si))
        L = Launch(mod, entry, opts)
        L.buf("src", src, "r", offset=off32)
        L.buf("loss_scale", np.array([loss, 7.0], np.float32), "r")
        L.buf("dst", np.full(n, NAN16["f16"], np.uint16), "w", offset=off16)
        flag0 = 1 if si == 5 else 0
        L.buf("flag", np.array([flag0], np.uint32), "rw")
        L.run(grid, block, factor=float(factor), n=n)
        ref = ref_f16_bits((src * np.float32(factor * loss)).astype(np.float32))
        err = bits_mismatch(L.out("dst", np.uint16), ref, "f16")
        want_flag = max(flag0, int(((ref & 0x7C00) == 0x7C00).any()))
        flag = int(L.out("flag", np.uint32)[0])
        if flag != want_flag:
            raise EmuError(f"{entry}: flag {flag}, expected {want_flag} (n {n})")
        results.append((f"n{n} grid{grid[0]}x{block[0]} src+{off32} dst+{off16} scale{loss:g} "
                        f"flag{want_flag}", err))
    return results, 0.0


def check_cast_from_f16_loss_unscaled(mod, entry, opts):
    """dst = f32(src) * (factor / loss scale), the scale read from device memory."""
    results = []
    for si, (n, grid, block, off32, off16) in enumerate(CAST_CASES):
        rng = rng_for(entry, si)
        bits = rng.integers(0, 1 << 16, n).astype(np.uint16)
        loss = np.float32(2.0 ** (10 + si)) if si % 2 else np.float32(3.0)
        factor = np.float32(0.3) if si % 3 else np.float32(1.0)
        L = Launch(mod, entry, opts)
        L.buf("src", bits, "r", offset=off16)
        L.buf("loss_scale", np.array([loss], np.float32), "r")
        L.buf("dst", np.full(n, np.nan, np.float32), "w", offset=off32)
        L.run(grid, block, factor=float(factor), n=n)
        ref = (f16_bits_to_f32(bits) * np.float32(factor / loss)).astype(np.float32)
        err = f32_mismatch(L.out("dst", np.float32), ref)
        results.append((f"n{n} grid{grid[0]}x{block[0]} src+{off16} dst+{off32} scale{loss:g}", err))
    return results, 0.0


def check_loss_scale_update(mod, entry, opts):
    """A sequence of steps against the host's LossScaler::update, word for word."""
    F32_MAX_HALF = np.float32(np.finfo(np.float32).max / np.float32(2.0))
    cases = [  # (scale, clean, interval, skipped, overflows, grid, block)
        (65536.0, 0, 3, 0, [1, 0, 0, 0, 0, 1, 0], (1, 1, 1), (1, 1, 1)),
        (2.0, 1, 2, 5, [1, 1, 1, 0, 0, 0], (2, 1, 1), (64, 1, 1)),
        (float(F32_MAX_HALF), 0, 1, 0, [0, 0, 1], (1, 1, 1), (32, 1, 1)),
        (8.0, 0, 0, 2 ** 33, [0, 1], (1, 1, 1), (1, 1, 1)),
    ]
    results = []
    for scale, clean, interval, skipped, overflows, grid, block in cases:
        state = np.zeros(6, np.uint32)
        state[0] = np.array([scale], np.float32).view(np.uint32)[0]
        state[1], state[2] = clean, interval
        state[4:6] = np.array([skipped], np.uint64).view(np.uint32)
        s, c, k = np.float32(scale), clean, skipped
        for overflow in overflows:
            L = Launch(mod, entry, opts)
            L.buf("state", state, "rw")
            L.run(grid, block, overflow=overflow)
            state = L.out("state", np.uint32).copy()
            if overflow:
                s, c, k = max(np.float32(s * np.float32(0.5)), np.float32(1.0)), 0, k + 1
            else:
                c += 1
                if c >= interval:
                    s, c = min(np.float32(s * np.float32(2.0)), F32_MAX_HALF), 0
            got = (state[:1].view(np.float32)[0], int(state[1]), int(state[2]),
                   int(state[4:6].view(np.uint64)[0]))
            if got != (s, c, interval, k):
                raise EmuError(f"{entry}: state {got}, expected {(s, c, interval, k)}")
        results.append((f"scale{scale:g} interval{interval} {len(overflows)} steps", 0.0))
    return results, 0.0


def check_sum_into_half(mod, entry, opts):
    ty = entry.rsplit("_", 1)[1]
    conv = ref_f16_bits if ty == "f16" else ref_bf16_bits
    widen = f16_bits_to_f32 if ty == "f16" else bf16_bits_to_f32
    results = []
    for si, (n, grid, block, off_a, off_b) in enumerate(CAST_CASES):
        rng = rng_for(entry, si)
        a = conv((rng.standard_normal(n) * 4).astype(np.float32))
        b = conv((rng.standard_normal(n) * 4).astype(np.float32))
        if n >= 3 and si == 2:
            a[0] = 0x7C00 if ty == "f16" else 0x7F80  # +inf
            b[1] = 0x7E00 if ty == "f16" else 0x7FC0  # NaN
        L = Launch(mod, entry, opts)
        L.buf("acc", a, "rw", offset=off_a & ~1)
        L.buf("src", b, "r", offset=off_b)
        L.run(grid, block, n=n)
        ref = conv((widen(a) + widen(b)).astype(np.float32))
        err = bits_mismatch(L.out("acc", np.uint16), ref, ty)
        results.append((f"n{n} grid{grid[0]}x{block[0]} acc+{off_a & ~1} src+{off_b}", err))
    return results, 0.0


def check_has_non_finite(mod, entry, opts):
    results = []
    for si, (n, grid, block, off32, _) in enumerate(CAST_CASES):
        rng = rng_for(entry, si)
        for special in (None, np.inf, -np.inf, np.nan):
            x = rng.standard_normal(n).astype(np.float32)
            if special is not None:
                x[rng.integers(0, n)] = special
            flag0 = 1 if si == 5 and special is None else 0  # a set flag stays set
            L = Launch(mod, entry, opts)
            L.buf("x", x, "r", offset=off32)
            L.buf("flag", np.array([flag0], np.uint32), "rw")
            L.run(grid, block, n=n)
            want = max(flag0, int(not np.isfinite(x).all()))
            got = int(L.out("flag", np.uint32)[0])
            if got != want:
                raise EmuError(f"{entry}: flag {got}, expected {want} (n {n}, special {special})")
        results.append((f"n{n} grid{grid[0]}x{block[0]} x+{off32} (finite, +inf, -inf, NaN)", 0.0))
    return results, 0.0


# ---------------------------------------------------------------------------
# optim.ptx
# ---------------------------------------------------------------------------

OPT_CASES = [(1, (1, 1, 1), (256, 1, 1)), (5, (2, 1, 1), (32, 1, 1)),
             (259, (2, 1, 1), (64, 1, 1)), (1000, (3, 1, 1), (256, 1, 1))]
F = np.float32


def _vec(rng, n, s=1.0):
    return (rng.standard_normal(n) * s).astype(np.float32)


def _special_params(p, g, si):
    """In the second shape: infinite parameters and -0.0 gradients. The CPU kernels
    skip the weight-decay term when weight_decay == 0 (as PyTorch does), so these
    must come out exactly as the reference says (Inf stays Inf, the sign of zero)."""
    if si == 1 and len(p) >= 3:
        p[0], p[1] = np.inf, -np.inf
        g[2] = -0.0
    return p, g


def check_sgd(mod, entry, opts):
    results = []
    for si, (n, grid, block) in enumerate(OPT_CASES):
        rng = rng_for(entry, si)
        p, g = _special_params(_vec(rng, n), _vec(rng, n), si)
        lr, wd = F(0.05), (F(0.0) if si % 2 else F(0.01))
        L = Launch(mod, entry, opts)
        L.buf("params", p, "rw")
        L.buf("grads", g, "r")
        L.run(grid, block, lr=float(lr), weight_decay=float(wd), n=n)
        d = g + wd * p if wd != 0 else g
        ref = p - lr * d
        err = f32_mismatch(L.out("params", np.float32), ref)
        results.append((f"n{n} grid{grid[0]}x{block[0]} wd{wd:g}", err))
    return results, 0.0


def check_sgd_momentum(mod, entry, opts):
    results = []
    combos = [(0.0, 0.0, 0, 1), (0.01, 0.1, 0, 0), (0.01, 0.0, 1, 0), (0.0, 0.0, 1, 1)]
    for si, (n, grid, block) in enumerate(OPT_CASES):
        for wd, damp, nesterov, first in combos:
            rng = rng_for(entry, si)
            p, g = _special_params(_vec(rng, n), _vec(rng, n), si)
            buf = _vec(rng, n, 0.5)
            lr, mom, wd, damp = F(0.05), F(0.9), F(wd), F(damp)
            L = Launch(mod, entry, opts)
            L.buf("params", p, "rw")
            L.buf("grads", g, "r")
            # on the first step the old buffer must not influence the result: NaN poison
            L.buf("momentum_buf", buf if not first else np.full(n, np.nan, np.float32), "rw")
            L.run(grid, block, lr=float(lr), momentum=float(mom), dampening=float(damp),
                  weight_decay=float(wd), nesterov=nesterov, first_step=first, n=n)
            d = g + wd * p if wd != 0 else g
            one_minus_d = F(1.0 - float(damp))
            b_new = d if first else mom * buf + one_minus_d * d
            d2 = d + mom * b_new if nesterov else b_new
            ref_p = p - lr * d2
            err = max(f32_mismatch(L.out("params", np.float32), ref_p),
                      f32_mismatch(L.out("momentum_buf", np.float32), b_new))
            results.append((f"n{n} grid{grid[0]}x{block[0]} wd{wd:g} damp{damp:g} "
                            f"nesterov{nesterov} first{first}", err))
    return results, 0.0


def _adam_ref(p, g, m, v, lr, b1, b2, eps, wd, step, decoupled):
    b1_64, b2_64, lr64 = float(b1), float(b2), float(lr)
    bc1 = 1.0 - b1_64 ** step
    bc2 = 1.0 - b2_64 ** step
    step_size = F(lr64 / bc1)
    bc2_sqrt = F(math.sqrt(bc2))
    if decoupled:
        if wd != 0:
            p = p * F(1.0 - lr64 * float(wd))
    elif wd != 0:
        g = g + wd * p
    m = b1 * m + F(1.0 - b1_64) * g
    v = b2 * v + F(1.0 - b2_64) * g * g
    denom = np.sqrt(v) / bc2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, m, v


def check_adam(mod, entry, opts):
    decoupled = entry.startswith("adamw")
    results = []
    for si, (n, grid, block) in enumerate(OPT_CASES):
        for step, wd in ((1, 0.0), (7, 0.01), (1000, 0.1)):
            rng = rng_for(entry, si)
            p, g = _special_params(_vec(rng, n), _vec(rng, n, 0.1), si if wd == 0 else -1)
            m, v = _vec(rng, n, 0.01), np.abs(_vec(rng, n, 0.001)).astype(np.float32)
            lr, b1, b2, eps, wd = F(1e-3), F(0.9), F(0.999), F(1e-8), F(wd)
            L = Launch(mod, entry, opts)
            L.buf("params", p, "rw")
            L.buf("grads", g, "r")
            L.buf("m", m, "rw")
            L.buf("v", v, "rw")
            L.run(grid, block, lr=float(lr), beta1=float(b1), beta2=float(b2), eps=float(eps),
                  weight_decay=float(wd), step=step, n=n)
            rp, rm, rv = _adam_ref(p, g, m, v, lr, b1, b2, eps, wd, step, decoupled)
            err = max(rel_err_norm(L.out("params", np.float32), rp),
                      rel_err_norm(L.out("m", np.float32), rm),
                      rel_err_norm(L.out("v", np.float32), rv))
            results.append((f"n{n} grid{grid[0]}x{block[0]} step{step} wd{wd:g}", err))
    return results, 2e-6


def check_scale_f32(mod, entry, opts):
    results = []
    for si, (n, grid, block) in enumerate(OPT_CASES):
        rng = rng_for(entry, si)
        x = _vec(rng, n)
        factor = F(0.37) if si % 2 else F(3.0)
        L = Launch(mod, entry, opts)
        L.buf("buf", x, "rw")
        L.run(grid, block, factor=float(factor), n=n)
        err = f32_mismatch(L.out("buf", np.float32), x * factor)
        results.append((f"n{n} grid{grid[0]}x{block[0]} factor{factor:g}", err))
    return results, 0.0


def check_sum_of_squares(mod, entry, opts):
    results = []
    cases = [(1, (1, 1, 1), (32, 1, 1)), (5, (2, 1, 1), (64, 1, 1)),
             (259, (3, 1, 1), (96, 1, 1)), (3000, (2, 1, 1), (1024, 1, 1)),
             (1000, (3, 1, 1), (256, 1, 1))]
    for si, (n, grid, block) in enumerate(cases):
        rng = rng_for(entry, si)
        x = _vec(rng, n, 3.0)
        acc0 = 2.5 if si % 2 else 0.0
        L = Launch(mod, entry, opts)
        L.buf("x", x, "r")
        L.buf("acc", np.array([acc0], np.float64), "rw")
        L.run(grid, block, n=n)
        ref = acc0 + math.fsum(float(v) * float(v) for v in x)
        got = float(L.out("acc", np.float64)[0])
        err = abs(got - ref) / ref if ref else abs(got)
        results.append((f"n{n} grid{grid[0]}x{block[0]} acc0={acc0}", err))
    return results, 1e-12


def check_scale_by_clip_factor(mod, entry, opts):
    results = []
    for si, (n, grid, block) in enumerate(OPT_CASES):
        for max_norm in (F(0.5), F(1e6)):
            rng = rng_for(entry, si)
            x = _vec(rng, n)
            norm_sq = float(np.sum(x.astype(np.float64) ** 2)) + 1.0
            L = Launch(mod, entry, opts)
            L.buf("buf", x, "rw")
            L.buf("norm_sq", np.array([norm_sq]), "r")
            L.run(grid, block, max_norm=float(max_norm), n=n)
            total = math.sqrt(norm_sq)
            factor = F(min(float(max_norm) / (total + 1e-6), 1.0))
            ref = x * factor if factor < 1 else x
            err = f32_mismatch(L.out("buf", np.float32), ref)
            results.append((f"n{n} grid{grid[0]}x{block[0]} max_norm{max_norm:g}", err))
    return results, 0.0



# ---------------------------------------------------------------------------
# model_ops.ptx (twins of the ops in crates/model/src/backend/cpu.rs)
# ---------------------------------------------------------------------------

# (n, grid, block, element offset of every operand)
MODEL_EW_CASES = [(1, (1, 1, 1), (256, 1, 1), 0), (5, (2, 1, 1), (32, 1, 1), 1),
                  (259, (2, 1, 1), (64, 1, 1), 3), (1000, (3, 1, 1), (256, 1, 1), 0)]


def _with_specials(x, si):
    """Second shape on: Inf, -Inf, NaN, -0.0 and a large value among the inputs."""
    if si >= 1 and len(x) >= 5:
        x[0], x[1], x[2], x[3], x[4] = np.inf, -np.inf, np.nan, -0.0, F(40.0)
    return x


def check_fill(mod, entry, opts):
    results = []
    for si, (n, grid, block, off) in enumerate(MODEL_EW_CASES):
        value = F([1.5, -0.0, 0.0, -3.25e-3][si])
        L = Launch(mod, entry, opts)
        L.buf("dst", np.full(n, np.nan, np.float32), "w", offset=off * 4)
        L.run(grid, block, value=float(value), n=n)
        err = f32_mismatch(L.out("dst", np.float32), np.full(n, value, np.float32))
        results.append((f"n{n} grid{grid[0]}x{block[0]} value{value:g}", err))
    return results, 0.0


def check_model_unary(mod, entry, opts):
    op = entry.split("_", 1)[1]
    results = []
    for si, (n, grid, block, off) in enumerate(MODEL_EW_CASES):
        rng = rng_for(entry, si)
        x = _with_specials((rng.standard_normal(n) * 4).astype(np.float32), si)
        if n > 8:
            x[5:8] = [-30.0, 25.0, 1e-7]
        L = Launch(mod, entry, opts)
        L.buf("x", x, "r", offset=off * 4)
        L.buf("dst", np.full(n, np.nan, np.float32), "w")
        L.run(grid, block, n=n)
        x64 = x.astype(np.float64)
        ref = 1.0 / (1.0 + np.exp(-x64)) if op == "sigmoid" else np.tanh(x64)
        err = rel_err_floor1(L.out("dst", np.float32), ref)
        results.append((f"n{n} grid{grid[0]}x{block[0]} x+{off}", err))
    return results, 4e-6


def check_model_binary(mod, entry, opts):
    op = entry.split("_", 1)[1]
    results = []
    for si, (n, grid, block, off) in enumerate(MODEL_EW_CASES):
        rng = rng_for(entry, si)
        a = _with_specials(_vec(rng, n, 3.0), si)
        b = _vec(rng, n, 3.0)
        L = Launch(mod, entry, opts)
        L.buf("a", a, "r", offset=off * 4)
        L.buf("b", b, "r")
        L.buf("dst", np.full(n, np.nan, np.float32), "w", offset=(si % 2) * 4)
        L.run(grid, block, n=n)
        ref = a + b if op == "add" else a * b
        err = f32_mismatch(L.out("dst", np.float32), ref)
        results.append((f"n{n} grid{grid[0]}x{block[0]} a+{off}", err))
    return results, 0.0


def check_model_in_place(mod, entry, opts):
    op = entry[len("in_place_"):]
    results = []
    for si, (n, grid, block, off) in enumerate(MODEL_EW_CASES):
        rng = rng_for(entry, si)
        if op == "add":
            x = _vec(rng, n, 3.0)
        else:  # activations: sigmoid outputs in [0, 1], tanh outputs in [-1, 1]
            x = rng.uniform(0.0 if "sigmoid" in op else -1.0, 1.0, n).astype(np.float32)
        x = _with_specials(x, si)
        d = _vec(rng, n, 2.0)
        L = Launch(mod, entry, opts)
        L.buf("x", x, "r")
        L.buf("dst", d, "rw", offset=off * 4)
        L.run(grid, block, n=n)
        one = F(1.0)
        if op == "add":
            ref = d + x
        elif op == "mul_sigmoid_grad":
            ref = d * (x * (one - x))  # as the CPU: x*(1-x) first, then the product
        else:
            ref = d * (one - x * x)
        err = f32_mismatch(L.out("dst", np.float32), ref)
        results.append((f"n{n} grid{grid[0]}x{block[0]} dst+{off}", err))
    return results, 0.0


# (rows, cols, grid, block, src element offset)
MODEL_MATRIX_CASES = [(1, 1, (1, 1, 1), (32, 1, 1), 0), (3, 5, (1, 1, 1), (64, 1, 1), 2),
                      (7, 33, (2, 1, 1), (32, 1, 1), 1), (37, 40, (1, 1, 1), (32, 1, 1), 0),
                      (0, 6, (1, 1, 1), (32, 1, 1), 0), (4, 300, (2, 1, 1), (64, 1, 1), 3)]


def check_column_sums(mod, entry, opts):
    results = []
    for si, (rows, cols, grid, block, off) in enumerate(MODEL_MATRIX_CASES):
        for accumulate in (0, 1):
            rng = rng_for(entry, si)
            src = _vec(rng, rows * cols, 2.0)
            if rows * cols >= 4:
                src[3] = -0.0
            dst = _vec(rng, cols, 5.0)
            L = Launch(mod, entry, opts)
            L.buf("src", src if rows * cols else np.zeros(1, np.float32), "w" if rows == 0 else "r",
                  offset=off * 4)
            L.buf("dst", dst if accumulate else np.full(cols, np.nan, np.float32),
                  "rw" if accumulate else "w")
            L.run(grid, block, rows=rows, cols=cols, accumulate=accumulate)
            acc = dst.copy() if accumulate else np.zeros(cols, np.float32)
            for r in range(rows):  # the CPU's order: row after row, f32 additions
                acc = (acc + src[r * cols:(r + 1) * cols]).astype(np.float32)
            err = f32_mismatch(L.out("dst", np.float32), acc)
            results.append((f"rows{rows} cols{cols} grid{grid[0]}x{block[0]} acc{accumulate}", err))
    return results, 0.0


# (rows, cols, chunk_rows, grid, block)
CHUNKED_CASES = [(1, 1, 1, (1, 1, 1), (32, 1, 1)), (7, 5, 3, (1, 2, 1), (64, 1, 1)),
                 (37, 33, 8, (2, 3, 1), (32, 1, 1)), (64, 40, 64, (1, 1, 1), (32, 1, 1)),
                 (100, 70, 16, (1, 2, 1), (64, 1, 1))]


def _chunk_partials(src, rows, cols, chunk_rows):
    """float32 partial sums of each chunk of rows, rows added in order from 0."""
    chunks = -(-rows // chunk_rows)
    out = np.zeros((chunks, cols), np.float32)
    for k in range(chunks):
        acc = np.zeros(cols, np.float32)
        for r in range(k * chunk_rows, min((k + 1) * chunk_rows, rows)):
            acc = (acc + src[r * cols:(r + 1) * cols]).astype(np.float32)
        out[k] = acc
    return out


def check_column_sums_partial(mod, entry, opts):
    results = []
    for si, (rows, cols, chunk_rows, grid, block) in enumerate(CHUNKED_CASES):
        rng = rng_for(entry, si)
        src = _vec(rng, rows * cols, 2.0)
        chunks = -(-rows // chunk_rows)
        L = Launch(mod, entry, opts)
        L.buf("src", src, "r", offset=4 * (si % 2))
        L.buf("partials", np.full(chunks * cols, np.nan, np.float32), "w")
        L.run(grid, block, rows=rows, cols=cols, chunk_rows=chunk_rows)
        ref = _chunk_partials(src, rows, cols, chunk_rows).ravel()
        err = f32_mismatch(L.out("partials", np.float32), ref)
        results.append((f"rows{rows} cols{cols} chunk{chunk_rows} grid{grid[0]}x{grid[1]}", err))
    return results, 0.0


def check_column_sums_combine(mod, entry, opts):
    results = []
    for si, (rows, cols, chunk_rows, grid, block) in enumerate(CHUNKED_CASES):
        for accumulate in (0, 1):
            rng = rng_for(entry, si)
            chunks = -(-rows // chunk_rows)
            partials = _vec(rng, chunks * cols, 5.0)
            dst = _vec(rng, cols, 3.0)
            L = Launch(mod, entry, opts)
            L.buf("partials", partials, "r")
            L.buf("dst", dst if accumulate else np.full(cols, np.nan, np.float32),
                  "rw" if accumulate else "w", offset=4 * (si % 2))
            L.run((grid[0], 1, 1), block, chunks=chunks, cols=cols, accumulate=accumulate)
            acc = dst.copy() if accumulate else np.zeros(cols, np.float32)
            for k in range(chunks):  # chunk order
                acc = (acc + partials[k * cols:(k + 1) * cols]).astype(np.float32)
            err = f32_mismatch(L.out("dst", np.float32), acc)
            results.append((f"chunks{chunks} cols{cols} acc{accumulate}", err))
    return results, 0.0



def check_add_row_bias(mod, entry, opts):
    results = []
    for si, (rows, cols, grid, block, off) in enumerate(MODEL_MATRIX_CASES):
        rng = rng_for(entry, si)
        bias = _vec(rng, cols)
        dst = _vec(rng, rows * cols, 3.0)
        L = Launch(mod, entry, opts)
        L.buf("bias", bias, "r", offset=(si % 3) * 4)
        L.buf("dst", dst if rows else np.zeros(1, np.float32), "rw", offset=off * 4)
        L.run(grid, block, rows=rows, cols=cols)
        ref = (dst.reshape(rows, cols) + bias).ravel() if rows else np.zeros(1, np.float32)
        err = f32_mismatch(L.out("dst", np.float32), ref)
        results.append((f"rows{rows} cols{cols} grid{grid[0]}x{block[0]}", err))
    return results, 0.0


# (table_rows, width, ids count, grid, block)
EMB_CASES = [(1, 1, 1, (1, 1, 1), (32, 1, 1)), (5, 3, 7, (1, 1, 1), (64, 1, 1)),
             (11, 33, 20, (2, 1, 1), (64, 1, 1)), (50, 16, 64, (3, 1, 1), (128, 1, 1)),
             (4, 7, 0, (1, 1, 1), (32, 1, 1))]


def _emb_ids(rng, table_rows, count):
    ids = rng.integers(0, table_rows, count).astype(np.uint32)
    if count >= 6:
        ids[1] = ids[4] = ids[5] = ids[0]  # repeated ids: several rows into one table row
    return ids


def check_gather_rows(mod, entry, opts):
    results = []
    for si, (table_rows, width, count, grid, block) in enumerate(EMB_CASES):
        rng = rng_for(entry, si)
        table = _vec(rng, table_rows * width)
        ids = _emb_ids(rng, table_rows, count)
        bad = count >= 7 and si == 2
        if bad:
            ids[6] = table_rows  # out of range: the row must come out NaN, nothing read
        L = Launch(mod, entry, opts)
        L.buf("table", table, "r", offset=4 * (si % 2))
        L.buf("ids", ids if count else np.zeros(1, np.uint32), "r")
        L.buf("dst", np.full(max(count * width, 1), np.nan, np.float32), "w")
        L.run(grid, block, table_rows=table_rows, width=width, rows=count)
        got = L.out("dst", np.float32)
        t = table.reshape(table_rows, width)
        ref = np.full(max(count * width, 1), np.nan, np.float32)
        for r, i in enumerate(ids):
            if i < table_rows:
                ref[r * width:(r + 1) * width] = t[i]
        err = f32_mismatch(got, ref)
        results.append((f"table{table_rows}x{width} ids{count}" + (" bad id" if bad else ""), err))
    return results, 0.0


def scatter_segments(ids):
    """The launcher's grouping: a stable counting sort of the row indices by id.
    Returns (order, seg_start, seg_id) with segments in increasing id order."""
    ids = np.asarray(ids, np.uint32)
    uniq, counts = np.unique(ids, return_counts=True)
    order = np.argsort(ids, kind="stable").astype(np.uint32)
    seg_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    return order, seg_start, uniq.astype(np.uint32)


def check_scatter_add_rows(mod, entry, opts):
    results = []
    for si, (table_rows, width, count, grid, block) in enumerate(EMB_CASES):
        rng = rng_for(entry, si)
        table = _vec(rng, table_rows * width)
        ids = _emb_ids(rng, table_rows, count)
        src = _vec(rng, count * width, 3.0)
        if count * width >= 3:
            src[2] = -0.0
        order, seg_start, seg_id = scatter_segments(ids)
        skipped = si == 3
        if skipped:  # a segment whose id is outside the table is skipped, nothing touched
            seg_id = np.append(seg_id, np.uint32(table_rows + 3))
            order = np.append(order, np.uint32(0))
            seg_start = np.append(seg_start, seg_start[-1] + 1).astype(np.uint32)
        L = Launch(mod, entry, opts)
        L.buf("src", src if count else np.zeros(1, np.float32), "r", offset=4 * (si % 2))
        L.buf("order", order if len(order) else np.zeros(1, np.uint32), "r")
        L.buf("seg_start", seg_start, "r")
        L.buf("seg_id", seg_id if len(seg_id) else np.zeros(1, np.uint32), "r")
        L.buf("table", table, "rw")
        L.run(grid, block, table_rows=table_rows, width=width, segments=len(seg_id))
        ref = table.reshape(table_rows, width).copy()
        for r, i in enumerate(ids):  # the CPU's order: rows r = 0, 1, ...
            ref[i] = (ref[i] + src[r * width:(r + 1) * width]).astype(np.float32)
        err = f32_mismatch(L.out("table", np.float32), ref.ravel())
        results.append((f"table{table_rows}x{width} ids{count} segments{len(seg_id)}" +
                        (" bad segment" if skipped else ""), err))
    return results, 0.0


def check_transpose(mod, entry, opts):
    """dst[c*rows + r] = src[r*ld + c]: moves only, so bit-exact (NaN matches NaN)."""
    results = []
    cases = [(1, 1, 1, (1, 1, 1), (32, 1, 1)), (3, 5, 7, (1, 1, 1), (64, 1, 1)),
             (17, 9, 9, (2, 1, 1), (32, 1, 1)), (33, 40, 45, (3, 1, 1), (128, 1, 1))]
    for si, (rows, cols, ld, grid, block) in enumerate(cases):
        rng = rng_for(entry, si)
        src = _with_specials(_vec(rng, (rows - 1) * ld + cols, 3.0), si)
        L = Launch(mod, entry, opts)
        L.buf("src", src, "r", offset=4 * (si % 2))
        L.buf("dst", np.full(rows * cols, np.nan, np.float32), "w")
        L.run(grid, block, rows=rows, cols=cols, ld=ld)
        strided = np.lib.stride_tricks.as_strided(
            src, shape=(rows, cols), strides=(4 * ld, 4))
        ref = np.ascontiguousarray(strided.T).ravel()
        err = f32_mismatch(L.out("dst", np.float32), ref)
        results.append((f"{rows}x{cols} ld{ld} grid{grid[0]}x{block[0]}", err))
    return results, 0.0


SUM_PARTIALS_BOUND = 2.0 ** -24 + 4096 * 2.0 ** -52  # per unit of sum|x|, n <= 4096 here


def check_sum_partials(mod, entry, opts):
    """err = |sum of partials in f64 - exact sum| / sum|x|; bound 2^-24 + n 2^-52
    (ptx/model_ops.ptx)."""
    results = []
    cases = [(1, (1, 1, 1), (32, 1, 1)), (5, (2, 1, 1), (64, 1, 1)),
             (259, (3, 1, 1), (96, 1, 1)), (3000, (2, 1, 1), (1024, 1, 1)),
             (4096, (5, 1, 1), (256, 1, 1))]
    for si, (n, grid, block) in enumerate(cases):
        rng = rng_for(entry, si)
        x = _vec(rng, n, 3.0)
        if si == 4:
            x = (x * np.float32(1e4)).astype(np.float32)
            x[::2] += np.float32(1e6)  # large values that cancel poorly in f32
        L = Launch(mod, entry, opts)
        L.buf("x", x, "r", offset=4 * (si % 2))
        L.buf("partials", np.full(grid[0], np.nan, np.float32), "w")
        L.run(grid, block, n=n)
        parts = L.out("partials", np.float32)
        got = math.fsum(float(p) for p in parts)
        exact = math.fsum(float(v) for v in x)
        scale = math.fsum(abs(float(v)) for v in x)
        err = abs(got - exact) / scale if scale else abs(got)
        if not np.isfinite(parts).all():
            err = math.inf
        results.append((f"n{n} grid{grid[0]}x{block[0]}", err))
    return results, SUM_PARTIALS_BOUND

# ---------------------------------------------------------------------------
# Registry and driver
# ---------------------------------------------------------------------------

CHECKS = {
    "gemm.ptx": {f"gemm_{t}_{v}": check_gemm for t in ("f32", "f16", "bf16") for v in ("nn", "nt", "tn")},
    "lstm.ptx": {
        "lstm_pointwise_forward": check_lstm_forward,
        "lstm_pointwise_forward_step": check_lstm_forward_step,
        "lstm_pointwise_backward": check_lstm_backward,
    },
    "softmax.ptx": {
        "softmax_xent_forward_online_warp": check_softmax_forward,
        "softmax_xent_forward_online_block": check_softmax_forward,
        "softmax_xent_backward_warp": check_softmax_backward,
        "softmax_xent_backward_block": check_softmax_backward,
    },
    "fp16.ptx": {
        "f32_to_f16_scaled": check_cast_to_half,
        "f32_to_bf16_scaled": check_cast_to_half,
        "f16_to_f32_unscaled": check_cast_from_half,
        "bf16_to_f32_unscaled": check_cast_from_half,
        "sum_into_f16": check_sum_into_half,
        "sum_into_bf16": check_sum_into_half,
        "has_non_finite_f32": check_has_non_finite,
        "f32_to_f16_loss_scaled": check_cast_to_f16_loss_scaled,
        "f16_to_f32_loss_unscaled": check_cast_from_f16_loss_unscaled,
        "loss_scale_update": check_loss_scale_update,
    },
    "optim.ptx": {
        "sgd_step": check_sgd,
        "sgd_momentum_step": check_sgd_momentum,
        "adam_step": check_adam,
        "adamw_step": check_adam,
        "scale_f32": check_scale_f32,
        "sum_of_squares": check_sum_of_squares,
        "scale_by_clip_factor": check_scale_by_clip_factor,
    },
    "model_ops.ptx": {
        "fill": check_fill,
        "gather_rows": check_gather_rows,
        "scatter_add_rows": check_scatter_add_rows,
        "column_sums": check_column_sums,
        "column_sums_partial": check_column_sums_partial,
        "column_sums_combine": check_column_sums_combine,
        "add_row_bias": check_add_row_bias,
        "unary_sigmoid": check_model_unary,
        "unary_tanh": check_model_unary,
        "binary_add": check_model_binary,
        "binary_mul": check_model_binary,
        "in_place_add": check_model_in_place,
        "in_place_mul_sigmoid_grad": check_model_in_place,
        "in_place_mul_tanh_grad": check_model_in_place,
        "sum_partials": check_sum_partials,
        "transpose": check_transpose,
    },
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx-dir", default=os.path.join(ROOT, "ptx"))
    ap.add_argument("--only", nargs="*", default=[], help="entry or file names to run")
    ap.add_argument("--exact-approx", action="store_true",
                    help="round approximate instructions exactly instead of perturbing them")
    ap.add_argument("--seed", type=int, default=1,
                    help="seeds the inputs, the block order and the approximation errors")
    ap.add_argument("--prior", action="append", default=[], metavar="FILE:WHAT=STATUS",
                    help="result of a check run before this one, shown in the table "
                         "(STATUS ok or FAIL; FAIL makes the exit status 1)")
    args = ap.parse_args()
    DATA_SEED[0] = args.seed
    np.seterr(all="ignore")  # references meet Inf / NaN on purpose; results are compared explicitly
    rows, failed = [], False
    for prior in args.prior:
        what, _, status = prior.rpartition("=")
        fname, _, label = what.partition(":")
        rows.append((fname, label, "-", "-", "-", "-", status))
        failed |= status != "ok"
    t_start = time.time()
    files = sorted(f for f in os.listdir(args.ptx_dir) if f.endswith(".ptx"))
    for fname in sorted(set(CHECKS) | set(files)):
        if args.only and fname not in args.only and not any(e in args.only for e in CHECKS.get(fname, {})):
            continue
        path = os.path.join(args.ptx_dir, fname)
        if fname not in files:
            print(f"note: {fname} is not in {args.ptx_dir} yet; its entries are skipped")
            rows.append((fname, "(file missing)", "-", "-", "-", "-", "SKIP"))
            continue
        try:
            mod = Module.from_file(path)
        except EmuError as err:
            print(f"FAIL {fname}: cannot parse: {err}")
            rows.append((fname, "(parse)", "-", "-", "-", "-", "FAIL"))
            failed = True
            continue
        checks = CHECKS.get(fname, {})
        for entry in checks:
            if entry not in mod.entries:
                print(f"note: {fname} has no entry {entry} yet; skipped")
                rows.append((fname, entry, "-", "-", "-", "-", "SKIP"))
        for entry in mod.entries:
            if args.only and entry not in args.only and fname not in args.only:
                continue
            if entry not in checks:
                print(f"FAIL {fname}:{entry}: no emulator check exists for this entry")
                rows.append((fname, entry, "-", "-", "-", "-", "NO CHECK"))
                failed = True
                continue
            opts = {"approx": "exact" if args.exact_approx else "random", "seed": args.seed,
                    "coverage": set(), "launches": 0}
            t0 = time.time()
            try:
                results, tol = checks[entry](mod, entry, opts)
            except EmuError as err:
                print(f"FAIL {fname}:{entry}: {err}")
                rows.append((fname, entry, "-", "error", "-", "-", "FAIL"))
                failed = True
                continue
            except Exception:  # a bug in the check itself: report, keep going
                traceback.print_exc()
                rows.append((fname, entry, "-", "crash", "-", "-", "FAIL"))
                failed = True
                continue
            worst = max(e for _, e in results)
            ok = worst <= tol
            failed |= not ok
            cov = len(opts["coverage"]) / max(1, len(mod.entries[entry].insts))
            for label, e in results:
                flag = "" if e <= tol else "   <-- above bound"
                print(f"{fname:12s} {entry:34s} {label:58s} err {e:.2e}{flag}")
            print(f"{fname:12s} {entry:34s} {opts['launches']} launches, "
                  f"{100 * cov:.0f}% of instructions executed, {time.time() - t0:.1f}s")
            rows.append((fname, entry, str(len(results)), f"{worst:.2e}", f"{tol:.0e}" if tol else "exact",
                         f"{100 * cov:.0f}%", "ok" if ok else "FAIL"))
    print()
    print(f"PTX emulator checks ({time.time() - t_start:.0f}s; approximate instructions "
          f"{'exact' if args.exact_approx else 'perturbed within their documented error'})")
    hdr = ("file", "entry", "shapes", "max rel err", "bound", "covered", "status")
    widths = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    line = "  ".join(h.ljust(w) for h, w in zip(hdr, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print("max rel err: as defined per entry in check_all.py's docstring; for bound 'exact' it is "
          "the fraction of elements whose bits differ from the reference (NaN matches NaN).")
    print("result:", "FAIL" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
