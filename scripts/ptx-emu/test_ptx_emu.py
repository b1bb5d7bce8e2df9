#!/usr/bin/env python3
"""Self-tests of ptx_emu.py: small hand-written kernels with known results, and
kernels with deliberate bugs that the emulator must report.

Run:  python3 scripts/ptx-emu/test_ptx_emu.py   (needs numpy; scripts/check-ptx-emu runs it)
"""
import os
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from fractions import Fraction  # noqa: E402

from ptx_emu import EmuError, GlobalMemory, Module, _fma_f32  # noqa: E402

HEAD = ".version 8.0\n.target sm_80\n.address_size 64\n"


def kernel(name, params, body):
    """A one-entry module; params: list of (name, type)."""
    plist = ",\n".join(f"    .param .{t} {n}" for n, t in params)
    return Module(f"{HEAD}.visible .entry {name}(\n{plist}\n)\n{{\n{body}\n}}\n", f"<{name}>")


REGS = """
    .reg .pred %p<8>;
    .reg .b16 %h<8>;
    .reg .b32 %r<32>;
    .reg .b64 %rd<16>;
    .reg .f32 %f<16>;
"""


def run(mod, name, grid, block, buffers, scalars=None, **kw):
    mem = GlobalMemory()
    args = dict(scalars or {})
    for bname, (arr, access) in buffers.items():
        args[bname] = mem.alloc(arr, bname, access)
    mod.launch(name, grid, block, mem, args, **kw)
    return mem


# out[tid] = sum_{i < tid % 5} i  (per-thread trip counts: divergent backward branch)
DIVERGENT_LOOP = REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    rem.u32 %r2, %r1, 5;
    mov.u32 %r3, 0;
    mov.u32 %r4, 0;
    setp.eq.u32 %p1, %r2, 0;
    @%p1 bra DONE;
LOOP:
    add.u32 %r4, %r4, %r3;
    add.u32 %r3, %r3, 1;
    setp.lt.u32 %p2, %r3, %r2;
    @%p2 bra LOOP;
DONE:
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r4;
    ret;
"""

# out[tid] = value of lane (lane ^ 5) / (lane + 3, clamped) / (lane - 2) / lane 7
SHFL = REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mul.lo.u32 %r2, %r1, 10;
    shfl.sync.bfly.b32 %r3, %r2, 5, 31, -1;
    shfl.sync.down.b32 %r4|%p1, %r2, 3, 31, -1;
    shfl.sync.up.b32 %r5, %r2, 2, 0, -1;
    shfl.sync.idx.b32 %r6, %r2, 7, 31, -1;
    mul.wide.u32 %rd2, %r1, 16;
    add.s64 %rd3, %rd1, %rd2;
    st.global.v4.u32 [%rd3], {%r3, %r4, %r5, %r6};
    ret;
"""

# shared exchange: thread t writes t, reads slot (t + 1) % n, with or without a barrier
SHARED_EXCHANGE = """
    .shared .align 4 .b32 buf[64];
""" + REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mov.u32 %r9, buf;
    shl.b32 %r2, %r1, 2;
    add.u32 %r3, %r9, %r2;
    st.shared.u32 [%r3], %r1;
    BARRIER
    add.u32 %r4, %r1, 1;
    rem.u32 %r4, %r4, 64;
    shl.b32 %r4, %r4, 2;
    add.u32 %r4, %r9, %r4;
    ld.shared.u32 %r5, [%r4];
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r5;
    ret;
"""

# shared reads then a write, all in one barrier interval: thread t fills slot t, then
# (after a barrier) reads slot FIRST, then slot SECOND, then BARRIER, then writes slot t.
# FIRST / SECOND are registers: %r1 (own slot t), %r6 ((t + 1) % 64) or %r9 (slot 0).
SHARED_READ_THEN_WRITE = """
    .shared .align 4 .b32 buf[64];
""" + REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mov.u32 %r9, 0;
    add.u32 %r6, %r1, 1;
    rem.u32 %r6, %r6, 64;
    mov.u32 %r10, buf;
    shl.b32 %r2, %r1, 2;
    add.u32 %r3, %r10, %r2;
    st.shared.u32 [%r3], %r1;
    bar.sync 0;
    shl.b32 %r11, FIRST, 2;
    add.u32 %r11, %r10, %r11;
    ld.shared.u32 %r12, [%r11];
    shl.b32 %r13, SECOND, 2;
    add.u32 %r13, %r10, %r13;
    ld.shared.u32 %r14, [%r13];
    BARRIER
    add.u32 %r15, %r12, %r14;
    st.shared.u32 [%r3], %r15;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r15;
    ret;
"""


def shared_read_then_write(first, second, barrier=""):
    body = (SHARED_READ_THEN_WRITE.replace("FIRST", first).replace("SECOND", second)
            .replace("BARRIER", barrier))
    mod = kernel("k", [("out", "u64")], body)
    return run(mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(64, np.uint32), "w")})


# grid-stride copy out[i] = in[i] for i < n
COPY = REGS + """
    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    mov.u32 %r6, %nctaid.x;
    mul.lo.u32 %r6, %r6, %r3;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra END;
AGAIN:
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd1, %rd3;
    add.s64 %rd5, %rd2, %rd3;
    ld.global.f32 %f1, [%rd4];
    st.global.f32 [%rd5], %f1;
    add.u32 %r5, %r5, %r6;
    setp.LIMIT.u32 %p2, %r5, %r1;
    @%p2 bra AGAIN;
END:
    ret;
"""

# per thread: fma, cvt to f16 / bf16 (round to nearest even), ex2.approx
NUMERICS = REGS + """
    ld.param.u64 %rd1, [x];
    ld.param.u64 %rd2, [out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 12;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.f32 %f1, [%rd4];
    ld.global.f32 %f2, [%rd4+4];
    ld.global.f32 %f3, [%rd4+8];
    fma.rn.f32 %f4, %f1, %f2, %f3;
    cvt.rn.f16.f32 %h1, %f1;
    cvt.rn.bf16.f32 %h2, %f1;
    mov.b32 %r2, {%h1, %h2};
    mul.wide.u32 %rd5, %r1, 8;
    add.s64 %rd6, %rd2, %rd5;
    st.global.f32 [%rd6], %f4;
    st.global.u32 [%rd6+4], %r2;
    ret;
"""


def _round_f32(x):
    """An exact non-zero rational rounded to the nearest float32 (ties to even), by
    comparing with the two float32 neighbours of its float64 approximation."""
    r = np.float32(float(x))
    best = r
    for cand in (np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf))):
        d_best, d_cand = abs(Fraction(float(best)) - x), abs(Fraction(float(cand)) - x)
        if d_cand < d_best or (d_cand == d_best and int(cand.view(np.uint32)) % 2 == 0):
            best = cand
    return best


class EmulatorSemantics(unittest.TestCase):
    def test_divergent_loop_reconverges(self):
        mod = kernel("k", [("out", "u64")], DIVERGENT_LOOP)
        mem = run(mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(64, np.uint32), "w")})
        t = np.arange(64) % 5
        np.testing.assert_array_equal(mem.array("out", np.uint32), t * (t - 1) // 2)

    def test_shfl_modes(self):
        mod = kernel("k", [("out", "u64")], SHFL)
        mem = run(mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(256, np.uint32), "w")})
        got = mem.array("out", np.uint32).reshape(64, 4)
        t = np.arange(64)
        lane, base = t & 31, t & ~31
        np.testing.assert_array_equal(got[:, 0], 10 * (base + (lane ^ 5)))
        down = np.where(lane + 3 <= 31, lane + 3, lane)
        np.testing.assert_array_equal(got[:, 1], 10 * (base + down))
        np.testing.assert_array_equal(got[:, 2], 10 * (base + np.where(lane >= 2, lane - 2, lane)))
        np.testing.assert_array_equal(got[:, 3], 10 * (base + 7))

    def test_shared_exchange_with_barrier(self):
        mod = kernel("k", [("out", "u64")], SHARED_EXCHANGE.replace("BARRIER", "bar.sync 0;"))
        mem = run(mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(64, np.uint32), "w")})
        np.testing.assert_array_equal(mem.array("out", np.uint32), (np.arange(64) + 1) % 64)

    def test_a_thread_may_overwrite_what_only_it_read(self):
        # read own slot twice (the second read finds the first one's record), then write it
        mem = shared_read_then_write("%r1", "%r1")
        np.testing.assert_array_equal(mem.array("out", np.uint32), 2 * np.arange(64))
        # after a barrier, what others read may be overwritten
        mem = shared_read_then_write("%r6", "%r9", "bar.sync 0;")
        t = np.arange(64)
        np.testing.assert_array_equal(mem.array("out", np.uint32), (t + 1) % 64)

    def test_grid_stride_loop_any_block(self):
        mod = kernel("k", [("src", "u64"), ("dst", "u64"), ("n", "u32")], COPY.replace("LIMIT", "lt"))
        x = np.arange(1000, dtype=np.float32)
        for grid, block in (((1, 1, 1), (32, 1, 1)), ((3, 1, 1), (96, 1, 1)), ((9, 1, 1), (128, 1, 1))):
            bufs = {"src": (x, "r"), "dst": (np.full(1000, np.nan, np.float32), "w")}
            mem = run(mod, "k", grid, block, bufs, {"n": 1000})
            np.testing.assert_array_equal(mem.array("dst", np.float32), x)

    def test_numerics_bit_exact(self):
        mod = kernel("k", [("x", "u64"), ("out", "u64")], NUMERICS)
        e = np.float32(2.0 ** -23)
        rows = np.array([
            [1 + e, 1 - e, -1.0],                       # fma keeps the -2^-46 a product+add loses
            [1 + 2.0 ** -11, 1.0, 0.0],                 # f16 tie -> even (1.0)
            [1 + 3 * 2.0 ** -11, 1.0, 0.0],             # f16 tie -> even (1 + 2^-9)
            [np.float32(1 + 2.0 ** -8), 1.0, 0.0],      # bf16 tie -> even (1.0)
            [70000.0, 1.0, 0.0],                        # f16 overflow -> inf
            [np.nan, 1.0, 0.0],
            [3.0, 4.0, 5.0],
            [2.0 ** -20, 1.0, 0.0],                     # f16 subnormal
        ], np.float32)
        n = len(rows)
        mem = run(mod, "k", (1, 1, 1), (n, 1, 1),
                  {"x": (rows, "r"), "out": (np.zeros(2 * n, np.uint32), "w")})
        out = mem.array("out", np.uint32).reshape(n, 2)
        fma = out[:, 0].view(np.float32)
        self.assertEqual(fma[0], np.float32(-(2.0 ** -46)))
        self.assertEqual(fma[6], np.float32(17.0))
        f16 = (out[:, 1] & 0xFFFF).astype(np.uint16)
        bf16 = (out[:, 1] >> 16).astype(np.uint16)
        self.assertEqual(f16[1], 0x3C00)
        self.assertEqual(f16[2], 0x3C02)
        self.assertEqual(f16[4], 0x7C00)
        self.assertTrue((f16[5] & 0x7C00) == 0x7C00 and (f16[5] & 0x3FF) != 0)
        self.assertEqual(f16[7], 0x0010)
        self.assertEqual(bf16[3], 0x3F80)
        self.assertEqual(bf16[0], 0x3F80)


    def test_fma_f32_rounds_once_and_keeps_the_sign_of_zero(self):
        # Exact zeros (of either sign), products that cancel, f32 subnormal results and
        # ordinary values, in one array so the fast and the exact path are both taken;
        # each lane is compared with the exact rational result rounded to f32 once.
        rng = np.random.default_rng(7)
        tiny = np.float32(2.0 ** -140)
        a = np.array([0.0, -0.0, 0.0, -0.0, 1.0, -1.0, 3.0, tiny, 1.5, 2.0 ** -70],
                     np.float32)
        b = np.array([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -2.0, 0.75, 1.0, 2.0 ** -70],
                     np.float32)
        c = np.array([0.0, -0.0, -0.0, 0.0, -1.0, 1.0, 6.0, 0.0, 0.0, 0.0], np.float32)
        a = np.concatenate([a, rng.standard_normal(54).astype(np.float32)])
        b = np.concatenate([b, rng.standard_normal(54).astype(np.float32)])
        c = np.concatenate([c, rng.standard_normal(54).astype(np.float32)])
        c[-10:] = 0.0  # zero addends beside non-zero products
        got = _fma_f32(a, b, c)
        for i in range(len(a)):
            exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
            if exact == 0:
                # IEEE 754: an exact zero sum is +0 in round-to-nearest unless both the
                # product and the addend are -0.
                neg = np.signbit(a[i]) != np.signbit(b[i]) and np.signbit(c[i])
                want = np.float32(-0.0) if neg else np.float32(0.0)
            else:
                want = _round_f32(exact)
            self.assertEqual(got[i].view(np.uint32), want.view(np.uint32), f"lane {i}")

    def test_atomics_vote_and_exit(self):
        # threads >= 40 exit; the rest add 1.5 to out[0] (f32 atomics), count into a shared
        # counter, and lane 0 of each warp stores the ballot of (tid odd) and vote.all(tid < 40)
        body = """
    .shared .align 4 .b32 count[1];
""" + REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mov.u32 %r9, count;
    setp.eq.u32 %p5, %r1, 0;
    @%p5 st.shared.u32 [%r9], 0;
    bar.sync 0;
    setp.ge.u32 %p1, %r1, 40;
    @%p1 exit;
    atom.global.add.f32 %f1, [%rd1], 0f3FC00000;
    atom.shared.add.u32 %r2, [%r9], 1;
    and.b32 %r3, %r1, 1;
    setp.ne.u32 %p2, %r3, 0;
    and.b32 %r4, %r1, 31;
    setp.eq.u32 %p3, %r4, 0;
    shr.u32 %r5, %r1, 5;
    setp.eq.u32 %p6, %r5, 0;
    selp.u32 %r6, -1, 255, %p6;
    vote.sync.ballot.b32 %r7, %p2, %r6;
    setp.lt.u32 %p4, %r1, 40;
    vote.sync.all.pred %p7, !%p4, %r6;
    selp.u32 %r8, 1, 0, %p7;
    mul.wide.u32 %rd2, %r5, 8;
    add.s64 %rd3, %rd1, %rd2;
    @%p3 st.global.v2.u32 [%rd3+8], {%r7, %r8};
    ret;
"""
        mod = kernel("k", [("out", "u64")], body)
        mem = run(mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(6, np.uint32), "rw")})
        out = mem.array("out", np.uint32)
        self.assertEqual(out[:1].view(np.float32)[0], np.float32(60.0))
        np.testing.assert_array_equal(out[2:6], [0xAAAAAAAA, 0, 0xAA, 0])


    def test_integer_semantics(self):
        # per thread t (x = t - 4): x / 3, x % 3 (truncating), x >> 1 (arithmetic),
        # cvt.rzi.s32.f32 of x * 0.75
        body = REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    sub.s32 %r2, %r1, 4;
    div.s32 %r3, %r2, 3;
    rem.s32 %r4, %r2, 3;
    shr.s32 %r5, %r2, 1;
    cvt.rn.f32.s32 %f1, %r2;
    mul.f32 %f1, %f1, 0f3F400000;
    cvt.rzi.s32.f32 %r6, %f1;
    mul.wide.u32 %rd2, %r1, 16;
    add.s64 %rd3, %rd1, %rd2;
    st.global.v4.u32 [%rd3], {%r3, %r4, %r5, %r6};
    ret;
"""
        mod = kernel("k", [("out", "u64")], body)
        mem = run(mod, "k", (1, 1, 1), (9, 1, 1), {"out": (np.zeros(36, np.int32), "w")})
        got = mem.array("out", np.int32).reshape(9, 4)
        x = np.arange(9) - 4
        np.testing.assert_array_equal(got[:, 0], np.trunc(x / 3))
        np.testing.assert_array_equal(got[:, 1], x - 3 * np.trunc(x / 3))
        np.testing.assert_array_equal(got[:, 2], x >> 1)
        np.testing.assert_array_equal(got[:, 3], np.trunc(x * 0.75))

    def test_wide_and_high_products(self):
        # per thread: a, c (32 bits each) and a 64-bit addend; out: mul.wide.u32,
        # mul.wide.s32, mad.wide.s32, mul.hi.u32, mul.hi.s32, mad.hi.u32 and mad.wide.u16
        # (the low halves of a and c; both with the addend's low 32 bits)
        body = REGS + """
    ld.param.u64 %rd1, [x];
    ld.param.u64 %rd2, [out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 16;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.u32 %r2, [%rd4];
    ld.global.u32 %r3, [%rd4+4];
    ld.global.u64 %rd5, [%rd4+8];
    cvt.u32.u64 %r4, %rd5;
    mul.wide.u32 %rd6, %r2, %r3;
    mul.wide.s32 %rd7, %r2, %r3;
    mad.wide.s32 %rd8, %r2, %r3, %rd5;
    mul.hi.u32 %r5, %r2, %r3;
    mul.hi.s32 %r6, %r2, %r3;
    mad.hi.u32 %r7, %r2, %r3, %r4;
    cvt.u16.u32 %h1, %r2;
    cvt.u16.u32 %h2, %r3;
    mad.wide.u16 %r8, %h1, %h2, %r4;
    mul.wide.u32 %rd9, %r1, 48;
    add.s64 %rd10, %rd2, %rd9;
    st.global.u64 [%rd10], %rd6;
    st.global.u64 [%rd10+8], %rd7;
    st.global.u64 [%rd10+16], %rd8;
    st.global.v4.u32 [%rd10+32], {%r5, %r6, %r7, %r8};
    ret;
"""
        words = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF, 3]
        rows = [(a, c, add) for a in words for c in words[::-1]
                for add in (0, 0xFFFFFFFFFFFFFFFF, 0x8000000000000000)]
        x = np.zeros(len(rows) * 4, np.uint32)
        for i, (a, c, add) in enumerate(rows):
            x[4 * i:4 * i + 4] = a, c, add & 0xFFFFFFFF, add >> 32
        mod = kernel("k", [("x", "u64"), ("out", "u64")], body)
        mem = run(mod, "k", (1, 1, 1), (len(rows), 1, 1),
                  {"x": (x, "r"), "out": (np.zeros(len(rows) * 12, np.uint32), "w")})
        got = mem.array("out", np.uint32).reshape(len(rows), 12)

        def signed(v):
            return v - (1 << 32) if v >= 1 << 31 else v

        for i, (a, c, add) in enumerate(rows):
            g = [int(v) for v in got[i]]
            wide = [g[0] | g[1] << 32, g[2] | g[3] << 32, g[4] | g[5] << 32]
            want = [a * c, (signed(a) * signed(c)) % (1 << 64),
                    (signed(a) * signed(c) + add) % (1 << 64), (a * c) >> 32,
                    ((signed(a) * signed(c)) >> 32) % (1 << 32),
                    (((a * c) >> 32) + (add & 0xFFFFFFFF)) % (1 << 32),
                    ((a & 0xFFFF) * (c & 0xFFFF) + (add & 0xFFFFFFFF)) % (1 << 32)]
            self.assertEqual(wide + g[8:12], want, f"a={a:#x} c={c:#x} add={add:#x}")


class EmulatorReportsBugs(unittest.TestCase):
    def assert_reports(self, fragment, fn):
        with self.assertRaises(EmuError) as ctx:
            fn()
        self.assertIn(fragment, str(ctx.exception))

    def test_missing_barrier_is_a_race(self):
        mod = kernel("k", [("out", "u64")], SHARED_EXCHANGE.replace("BARRIER", ""))
        self.assert_reports("race", lambda: run(mod, "k", (1, 1, 1), (64, 1, 1),
                                                {"out": (np.zeros(64, np.uint32), "w")}))

    def test_barrier_in_divergent_code(self):
        body = SHARED_EXCHANGE.replace("BARRIER", "setp.lt.u32 %p3, %r1, 32;\n    @%p3 bar.sync 0;")
        mod = kernel("k", [("out", "u64")], body)
        self.assert_reports("bar.sync reached by 32 of 64", lambda: run(
            mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(64, np.uint32), "w")}))

    def test_out_of_bounds_read(self):
        mod = kernel("k", [("src", "u64"), ("dst", "u64"), ("n", "u32")], COPY.replace("LIMIT", "le"))
        x = np.arange(100, dtype=np.float32)
        self.assert_reports("outside every buffer", lambda: run(
            mod, "k", (1, 1, 1), (64, 1, 1), {"src": (x, "r"), "dst": (np.zeros(100, np.float32), "w")},
            {"n": 100}))

    def test_read_of_write_only_buffer(self):
        mod = kernel("k", [("src", "u64"), ("dst", "u64"), ("n", "u32")], COPY.replace("LIMIT", "lt"))
        x = np.arange(10, dtype=np.float32)
        self.assert_reports("write-only", lambda: run(
            mod, "k", (1, 1, 1), (32, 1, 1), {"src": (x, "w"), "dst": (np.zeros(10, np.float32), "w")},
            {"n": 10}))

    def test_shfl_with_missing_lanes(self):
        body = SHFL.replace("shfl.sync.bfly.b32 %r3, %r2, 5, 31, -1;",
                            "setp.lt.u32 %p4, %r1, 16;\n    @%p4 shfl.sync.bfly.b32 %r3, %r2, 5, 31, -1;")
        mod = kernel("k", [("out", "u64")], body)
        self.assert_reports("member mask", lambda: run(mod, "k", (1, 1, 1), (32, 1, 1),
                                                       {"out": (np.zeros(128, np.uint32), "w")}))

    def test_overwriting_what_another_thread_read_is_a_race(self):
        # every thread's slot was read by its neighbour (first read of the interval, or a
        # second reader of bytes one thread already read), or by all threads (slot 0)
        for first, second in (("%r6", "%r1"), ("%r1", "%r6"), ("%r9", "%r1"), ("%r1", "%r9")):
            with self.subTest(first=first, second=second):
                self.assert_reports("write-after-read race",
                                    lambda: shared_read_then_write(first, second))

    def test_lanes_disagreeing_on_the_member_mask(self):
        body = SHFL.replace("shfl.sync.bfly.b32 %r3, %r2, 5, 31, -1;",
                            "selp.b32 %r7, -1, 0x7fffffff, %p5;\n    "
                            "shfl.sync.bfly.b32 %r3, %r2, 5, 31, %r7;").replace(
            "mul.lo.u32 %r2, %r1, 10;", "mul.lo.u32 %r2, %r1, 10;\n    setp.lt.u32 %p5, %r1, 40;")
        mod = kernel("k", [("out", "u64")], body)
        self.assert_reports("warp 1: lanes disagree on the member mask", lambda: run(
            mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(256, np.uint32), "w")}))

    def test_executing_lanes_outside_the_member_mask(self):
        body = SHFL.replace("shfl.sync.bfly.b32 %r3, %r2, 5, 31, -1;",
                            "shfl.sync.bfly.b32 %r3, %r2, 5, 31, 0xffff;")
        mod = kernel("k", [("out", "u64")], body)
        self.assert_reports("are not in the member mask 0xffff", lambda: run(
            mod, "k", (1, 1, 1), (64, 1, 1), {"out": (np.zeros(256, np.uint32), "w")}))

    def test_member_mask_of_a_partial_last_warp(self):
        # 48 threads: warp 1 has lanes 0..15 only. Its member mask (warp 0's is -1) may
        # name lanes that do not exist (-1), but not leave out lanes that execute (0xff).
        def run_with(last_warp_mask):
            body = REGS + f"""
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    setp.lt.u32 %p1, %r1, 32;
    selp.b32 %r5, -1, {last_warp_mask}, %p1;
    shfl.sync.bfly.b32 %r3, %r1, 1, 31, %r5;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r3;
    ret;
"""
            mod = kernel("k", [("out", "u64")], body)
            return run(mod, "k", (1, 1, 1), (48, 1, 1), {"out": (np.zeros(48, np.uint32), "w")})

        np.testing.assert_array_equal(run_with("-1").array("out", np.uint32), np.arange(48) ^ 1)
        self.assert_reports("warp 1: executing lanes [8, 9, 10, 11, 12, 13, 14, 15]",
                            lambda: run_with("0xff"))

    def test_write_write_race_between_blocks(self):
        # every block writes its block index to out[tid]
        body = REGS + """
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, %ctaid.x;
    mul.wide.u32 %rd2, %r1, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r2;
    ret;
"""
        mod = kernel("k", [("out", "u64")], body)
        self.assert_reports("write-write race", lambda: run(mod, "k", (2, 1, 1), (32, 1, 1),
                                                             {"out": (np.zeros(32, np.uint32), "w")}))

    def test_nc_read_of_written_data(self):
        body = COPY.replace("LIMIT", "lt").replace("ld.global.f32", "ld.global.nc.f32")
        mod = kernel("k", [("src", "u64"), ("dst", "u64"), ("n", "u32")], body)
        mem = GlobalMemory()
        a = mem.alloc(np.arange(64, dtype=np.float32), "buf", "rw")
        # dst = src + 4 bytes: element i+1 is written after element i was read through .nc
        with self.assertRaises(EmuError) as ctx:
            mod.launch("k", (1, 1, 1), (32, 1, 1), mem, {"src": a, "dst": a + 4, "n": 63})
        self.assertIn("ld.global.nc", str(ctx.exception))


if __name__ == "__main__":
    unittest.main(verbosity=1)
