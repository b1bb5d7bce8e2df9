#!/usr/bin/env python3
"""ptx_emu -- a lockstep SIMT emulator for the subset of PTX that ringtrain's
kernels (ptx/*.ptx) use, so they can be checked without a GPU.

It is a test tool: it runs a kernel launch on numpy arrays, one thread block at a
time, and reports anything the PTX ISA leaves undefined or that would make the
result depend on scheduling, as an ``EmuError`` naming the entry, the PTX source
line and the instruction.  Numerical results are then compared with numpy
references by ``check_all.py``.

Usage::

    mod = Module.from_file("ptx/lstm.ptx")
    mem = GlobalMemory()
    x = mem.alloc(np.arange(10, dtype=np.float32), "x", access="r")
    y = mem.alloc(np.full(10, np.nan, np.float32), "y", access="w")
    mod.launch("kernel", grid=(2, 1, 1), block=(256, 1, 1), mem=mem,
               args={"x": x, "y": y, "n": 10})
    out = mem.array("y", np.float32)

Execution model
---------------
* Every register is a numpy array with one element per thread of the block
  (raw bit patterns, ``uint64``).  Registers start as all-ones bits (NaN for
  floats, -1 for integers), so a value used before it is written shows up as NaN
  in an output or as an out-of-bounds address.
* Threads have their own program counters.  Each step executes the instruction
  with the smallest program counter among the live threads, for every live thread
  that is at it (lockstep with "minimum-PC" reconvergence): threads that branch
  forward wait at the target until the others catch up; threads looping back run
  their extra iterations while the others wait after the loop.  Any thread may
  diverge on any branch.  ``ret`` / ``exit`` retire the executing threads.
* ``bar.sync`` / ``barrier.sync`` must be reached by every thread of the block at
  the same instruction; a barrier in divergent code, or after some threads of the
  block have exited, is reported (undefined behaviour in PTX; stricter than some
  hardware).  Warp-synchronous instructions (``shfl.sync``, ``vote.sync``,
  ``bar.warp.sync``, ``ldmatrix``, ``mma``) require every lane named by the
  member mask (the whole warp for ``.aligned`` ones) to execute them together.
* Blocks of a launch run one after another, in a shuffled order (seeded), so a
  result that depends on block order shows up as a mismatch between runs.

Memory and race checks
----------------------
* Global memory: each buffer is an exact-size allocation in its own address
  range with unmapped gaps; any access outside a buffer is an error, as is a
  misaligned access, a read of a buffer declared write-only (``access="w"``, e.g.
  C when beta == 0) or a write to a read-only one.  Within one launch, two
  threads storing *different* bytes to the same address is an error (a write-
  write race; identical values, e.g. every thread setting a flag to 1, are
  allowed), and so is a thread reading bytes written by another thread of the
  same block without a barrier in between, and so is any overlap between bytes
  read through ``ld.global.nc`` and bytes stored in the same launch.
  ``GlobalMemory.map(base, view, name)`` adds a buffer at a chosen address
  whose bytes are a caller-owned uint8 view (the emulated CUDA driver in
  scripts/emu-cuda maps its device memory file this way); the same exact-size
  checks apply.  Reads of data written by another
  block are not checked (blocks run sequentially here).  Atomics (``atom``,
  ``red``) are applied one thread after another in thread order.
* Shared memory: per byte, the last writer and the reader(s) are tracked with the
  barrier epoch (block-wide ``bar.sync``) and a per-warp epoch (``bar.warp.sync``);
  read-after-write, write-after-read and write-after-write between different
  threads of one epoch are reported, as are out-of-range and misaligned
  accesses.  Shared memory starts as 0xAB garbage.  ``cp.async`` copies land
  only at ``cp.async.wait_group`` / ``wait_all``; touching their destination
  before that is reported.

Arithmetic
----------
* Integer operations wrap modulo their width; ``div``/``rem`` by zero is reported.
* f32 / f64 ``add``, ``sub``, ``mul``, ``div.rn``, ``sqrt.rn``, ``rcp.rn`` and
  conversions are numpy's IEEE round-to-nearest-even operations, so they are
  bit-exact.  ``fma`` is exact too: for f32 the f64 product of two f32 is exact
  and the sum's rounding error is recovered with TwoSum to settle f64 results
  that land on an f32 rounding midpoint; f64 ``fma`` uses exact rational
  arithmetic per element (slow, fine for the few f64 operations in the kernels).
  ``.ftz`` flushes subnormal inputs and
  results to signed zero; ``.sat`` clamps to [0, 1].  Other rounding modes on
  arithmetic (``.rz``, ``.rm``, ``.rp``) are rejected.
* ``cvt``: float <-> float with ``.rn`` (f16 through numpy, bf16 by explicit
  round-to-nearest-even), integer rounding ``.rni/.rzi/.rmi/.rpi`` with the
  PTX saturation of float -> integer (NaN -> 0), int <-> int widening and
  truncation, ``f16x2`` / ``bf16x2`` packing (first source in the upper half).
  NaN results of conversions are canonical NaNs (payloads are not modelled).
* Approximate instructions are computed exactly in float64 and then moved by a
  pseudo-random amount up to their documented maximum error (``approx="random"``,
  the default; ``approx="exact"`` rounds the exact value instead):
  ``ex2.approx`` relative 2^-22, ``lg2.approx`` absolute 2^-22.6 plus relative
  2^-22, ``rcp.approx`` / ``sqrt.approx`` relative 2^-23, ``rsqrt.approx``
  relative 2^-22.9, ``div.approx`` / ``div.full`` relative 2^-22,
  ``tanh.approx`` relative 2^-10.987, ``sin/cos.approx`` absolute 2^-20.9.
  ``approx="hash"`` moves them by the same bounds, but by an amount that is a
  fixed function of the exact result and ``approx_seed``, so equal inputs give
  equal outputs in every launch, as on a real device (``"random"`` draws a new
  error per evaluation, so two identical computations may differ).
* ``min`` / ``max`` on floats return the non-NaN operand (``.NaN`` propagates).
* ``mma.sync.m16n8k16`` (f16 / bf16 inputs, f32 accumulate) is computed in
  float64 and rounded once; ``ldmatrix`` (.x1/.x2/.x4, .trans) follows the ISA's
  fragment layout.

Instructions implemented
------------------------
ld / st (.param, .global, .shared, generic; .v2 / .v4; 8..64-bit types; cache
and ordering qualifiers ignored), mov (incl. vector pack/unpack), cvta, cvt,
add sub mul (.lo .hi .wide) mad (.lo .hi .wide) fma div rem min max neg abs
and or xor not cnot shl shr popc clz brev copysign, setp (all comparisons, with
.and/.or/.xor combining and ``p|q`` destinations), selp, testp, rcp sqrt rsqrt
ex2 lg2 tanh sin cos, bra (.uni), ret, exit, bar.sync / barrier.sync (barrier 0,
whole block), bar.warp.sync, membar / fence (no-ops: memory is sequentially
consistent here), shfl.sync (.up .down .bfly .idx, with the ISA's clamp / segment
mask and ``d|p`` destinations), vote.sync (.all .any .uni .ballot), atom / red
(.global / .shared; add min max inc dec and or xor exch cas), cp.async (.ca/.cg
with src-size, commit_group, wait_group, wait_all), ldmatrix, mma.sync
m16n8k16 row.col f32.{f16,bf16}.  Anything else is reported as unsupported.

Not modelled
------------
Weak memory ordering (every access is immediately visible: a missing fence
between blocks is not found), concurrency between blocks (they run one after
another), named barriers / bar.arrive / barrier thread counts other than the
whole block, .local / .const / texture memory, .func and call, f16 / f16x2
arithmetic, rounding modes other than .rn on arithmetic, NaN payloads, timing.
"""
from __future__ import annotations

import re
from fractions import Fraction

import numpy as np

__all__ = ["EmuError", "Module", "GlobalMemory", "f32_to_bf16_bits", "bf16_bits_to_f32"]


class EmuError(Exception):
    """A kernel did something undefined, racy or out of bounds (or unsupported here)."""


# ---------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------

_SIZES = {}
for _t, _s in [("b8", 1), ("u8", 1), ("s8", 1), ("b16", 2), ("u16", 2), ("s16", 2),
               ("f16", 2), ("bf16", 2), ("b32", 4), ("u32", 4), ("s32", 4), ("f32", 4),
               ("f16x2", 4), ("bf16x2", 4), ("b64", 8), ("u64", 8), ("s64", 8), ("f64", 8)]:
    _SIZES[_t] = _s

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_FLOAT = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF, 8: 0xFFFFFFFFFFFFFFFF}


def _is_float(ty):
    return ty in ("f16", "f32", "f64", "bf16")


def _is_signed(ty):
    return ty.startswith("s")


def _as_type(size, ty):
    """How ``bits_as`` reads uint64 bits as type ``ty``: (narrow unsigned dtype or None,
    view dtype or None)."""
    narrow = _UINT[size] if size < 8 else None
    if ty in _FLOAT:
        return narrow, _FLOAT[ty]
    if _is_signed(ty):
        return narrow, _SINT[size]
    return narrow, None


_AS = {t: _as_type(s, t) for t, s in _SIZES.items()}


def bits_as(bits, ty):
    """Reinterprets uint64 register bits as a numpy array of PTX type ``ty``."""
    narrow, view = _AS[ty]
    low = bits.astype(narrow) if narrow is not None else bits
    return low.view(view) if view is not None else low  # unsigned, bit types, bf16 bits


def to_bits(val, ty):
    """numpy values of PTX type ``ty`` -> uint64 register bits (zero-extended)."""
    size = _SIZES[ty]
    if ty in _FLOAT:
        return np.asarray(val, _FLOAT[ty]).view(_UINT[size]).astype(np.uint64)
    v = np.asarray(val)
    if v.dtype.kind == "f":
        raise EmuError(f"float value stored as {ty}")
    if size == 8:
        return v.astype(np.int64).view(np.uint64) if v.dtype.kind == "i" else v.astype(np.uint64)
    return (v.astype(np.int64) & _MASK[size]).astype(np.uint64)


def f32_to_bf16_bits(x):
    """float32 array -> bf16 bits, round to nearest even, NaN -> canonical 0x7FFF."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(x, np.float32)), np.uint16(0x7FFF), r)


def bf16_bits_to_f32(b):
    """bf16 bits -> float32 (exact)."""
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32)


def _f32_to_f16_bits(x):
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.asarray(x, np.float32).astype(np.float16).view(np.uint16)
    return np.where(np.isnan(np.asarray(x, np.float32)), np.uint16(0x7FFF), h)


def _ftz(x):
    """Flushes subnormals of a float32/float64 array to signed zero."""
    tiny = np.finfo(x.dtype).tiny
    return np.where((np.abs(x) < tiny) & (x != 0), np.copysign(np.zeros_like(x), x), x)


_LOW29, _HALF29 = np.uint64(0x1FFFFFFF), np.uint64(0x10000000)
_ABS64, _ONE64 = np.uint64(0x7FFFFFFFFFFFFFFF), np.uint64(1)
_F32_TINY_BITS = np.uint64((1023 - 126) << 52)  # float64 bits of 2**-126


def _fma_f32(a, b, c):
    """Correctly rounded float32 a*b + c (a, b, c float32 arrays)."""
    p = a.astype(np.float64) * b  # exact
    s = p + c
    # Rounding s to float32 can differ from rounding p + c only where s lies exactly
    # halfway between two float32 values: in the normal range its 29 low mantissa bits
    # are then 1 followed by zeros; below it (float32 subnormals) more bits count, so
    # every such s takes the exact path too, except 0: a float64 sum that rounds to 0 is
    # exactly 0 (sums of floats are multiples of the smallest subnormal), and its sign
    # follows the same IEEE rule in float64 as in float32. Otherwise one rounding is the
    # answer.  (|s| bits - 1 wraps for 0, so 0 is not below the bound.)
    u = s.view(np.uint64)
    if not np.count_nonzero(((u & _LOW29) == _HALF29) | (((u & _ABS64) - _ONE64) < _F32_TINY_BITS)):
        return s.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        c64 = c.astype(np.float64)
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)  # TwoSum: s + err == p + c exactly
        r = s.astype(np.float32)
        # Only when s is exactly halfway between two f32 values can err change the result.
        toward = np.where(err > 0, np.float32(np.inf), np.float32(-np.inf))
        other = np.nextafter(r, toward)
        mid = (r.astype(np.float64) + other.astype(np.float64)) * 0.5
        fix = np.isfinite(s) & (err != 0) & (mid == s)
    return np.where(fix, other, r)


def _fma_f64(a, b, c):
    """Correctly rounded float64 a*b + c: exact rational arithmetic per element
    (Python's int / int division rounds correctly); non-finite cases via numpy."""
    with np.errstate(all="ignore"):
        r = a * b + c
    fin = np.isfinite(a) & np.isfinite(b) & np.isfinite(c) & np.isfinite(r)
    for i in np.nonzero(fin)[0]:
        v = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        r[i] = float(v) if v != 0 else r[i]  # keep IEEE's sign of an exact zero
    return r


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------

_SREG = re.compile(r"^%(tid|ntid|ctaid|nctaid)\.([xyz])$")
_ADDR = re.compile(r"^\[\s*([%\w$.]+)\s*(?:\+\s*(-?(?:0x[0-9a-fA-F]+|\d+)))?\s*\]$")


class Operand:
    """One parsed operand: kind in reg, sreg, imm, sym, addr, vec, pair, label, sink."""
    __slots__ = ("kind", "name", "value", "items", "off", "fty")

    def __init__(self, kind, name=None, value=None, items=None, off=0, fty=None):
        self.kind, self.name, self.value, self.items, self.off, self.fty = kind, name, value, items, off, fty

    def __repr__(self):
        return f"{self.kind}:{self.name or self.value or self.items}"


def _split_operands(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _parse_operand(tok):
    tok = tok.strip()
    if tok.startswith("{"):
        return Operand("vec", items=[_parse_operand(t) for t in _split_operands(tok[1:-1])])
    if tok.startswith("["):
        m = _ADDR.match(tok)
        if not m:
            raise EmuError(f"unsupported address operand {tok}")
        return Operand("addr", name=m.group(1), off=int(m.group(2) or "0", 0))
    if "|" in tok:
        a, b = tok.split("|")
        return Operand("pair", items=[_parse_operand(a), _parse_operand(b)])
    if tok == "_":
        return Operand("sink")
    if tok.startswith("!%"):
        return Operand("reg", name=tok)  # negated predicate (setp combine, vote)
    if tok.startswith("%"):
        if _SREG.match(tok) or tok in ("%laneid", "%warpid", "%nwarpid", "%warpsize"):
            return Operand("sreg", name=tok)
        return Operand("reg", name=tok)
    if re.match(r"^0[fF][0-9a-fA-F]{8}$", tok):
        return Operand("imm", value=int(tok[2:], 16), fty="f32")
    if re.match(r"^0[dD][0-9a-fA-F]{16}$", tok):
        return Operand("imm", value=int(tok[2:], 16), fty="f64")
    if re.match(r"^-?(0[xX][0-9a-fA-F]+|\d+)[uU]?$", tok):
        return Operand("imm", value=int(tok.rstrip("uU"), 0))
    if re.match(r"^-?\d+\.\d*([eE][-+]?\d+)?$", tok):
        return Operand("imm", value=float(tok), fty="dec")
    if re.match(r"^[A-Za-z_$][\w$]*$", tok):
        return Operand("sym", name=tok)
    raise EmuError(f"cannot parse operand {tok!r}")


class Inst:
    """A decoded instruction."""
    __slots__ = ("pred", "neg", "op", "parts", "ops", "line", "text", "memo")

    def __init__(self, pred, neg, op, ops, line, text):
        self.pred, self.neg, self.op, self.ops, self.line, self.text = pred, neg, op, ops, line, text
        self.parts = op.split(".")
        self.memo = None  # what a handler decoded from the instruction once, for later runs


class Entry:
    """One .entry: parameters, instructions, labels, shared declarations."""

    def __init__(self, name, params, insts, labels, shared, reg_types, directives):
        self.name, self.params, self.insts, self.labels = name, params, insts, labels
        self.shared, self.reg_types, self.directives = shared, reg_types, directives


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.split("\n"))


def _parse_decl_names(rest):
    """'%r<4>, %p' -> ['%r0'.. '%r3', '%p']"""
    names = []
    for item in rest.split(","):
        item = item.strip()
        m = re.match(r"^(%?[\w$]+)<(\d+)>$", item)
        if m:
            names += [f"{m.group(1)}{i}" for i in range(int(m.group(2)))]
        elif item:
            names.append(item)
    return names


def _parse_shared(stmt):
    """'.shared .align 16 .b8 name[123]' -> (name, bytes, align)"""
    m = re.match(r"^(?:\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)"
                 r"\s*(?:\[(\d*)\])?", stmt)
    if not m:
        raise EmuError(f"cannot parse shared declaration {stmt!r}")
    align, ty, name, count = m.groups()
    size = _SIZES[ty]
    n = int(count) if count else (0 if count == "" else 1)
    return name, n * size, int(align or size)


class Module:
    """A parsed PTX file."""

    def __init__(self, text, path="<ptx>"):
        self.path = path
        self.entries = {}
        self.shared = []  # module-scope .shared declarations
        src = _strip_comments(text)
        pos = 0
        for m in re.finditer(r"\.entry\s+([\w$]+)\s*\(", src):
            name = m.group(1)
            # module-scope shared declarations between entries
            for sm in re.finditer(r"^\s*((?:\.extern\s+)?\.shared[^;]*);", src[pos:m.start()], re.M):
                self.shared.append(_parse_shared(sm.group(1).strip()))
            close = src.index(")", m.end())
            params = []
            for p in src[m.end():close].split(","):
                p = p.split()
                if p:
                    params.append((p[-1], p[p.index(".param") + 1].lstrip(".")))
            brace = src.index("{", close)
            depth, i = 0, brace
            while True:
                if src[i] == "{":
                    depth += 1
                elif src[i] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                i += 1
            directives = src[close + 1:brace].split()
            body_start_line = src.count("\n", 0, brace + 1) + 1
            self.entries[name] = self._parse_body(name, params, src[brace + 1:i], body_start_line, directives)
            pos = i + 1

    @classmethod
    def from_file(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(f.read(), path)

    def _parse_body(self, name, params, body, first_line, directives):
        insts, labels, shared, reg_types = [], {}, [], {}
        line = first_line
        for raw in re.split(r"(;)", body):
            if raw == ";":
                continue
            lead = raw[:len(raw) - len(raw.lstrip())]
            stmt_line = line + lead.count("\n")
            line += raw.count("\n")
            stmt = raw.strip()
            # braces opening / closing nested scopes carry no meaning here
            while stmt[:1] in ("{", "}"):
                rest = stmt[1:]
                stmt_line += rest[:len(rest) - len(rest.lstrip())].count("\n")
                stmt = rest.lstrip()
            while True:
                lm = re.match(r"^([A-Za-z_$][\w$]*)\s*:\s*", stmt)
                if not lm:
                    break
                labels[lm.group(1)] = len(insts)
                stmt_line += lm.group(0).count("\n")
                stmt = stmt[lm.end():]
            if not stmt:
                continue
            if stmt.startswith(".reg"):
                m = re.match(r"^\.reg\s+\.(\w+)\s+(.*)$", stmt, re.S)
                for n in _parse_decl_names(m.group(2)):
                    reg_types[n] = m.group(1)
                continue
            if stmt.startswith(".shared") or stmt.startswith(".extern"):
                shared.append(_parse_shared(stmt))
                continue
            if stmt.startswith("."):
                if stmt.startswith(".local") or stmt.startswith(".global") or stmt.startswith(".const"):
                    raise EmuError(f"{name}: unsupported declaration {stmt!r}")
                continue
            pred, neg = None, False
            if stmt.startswith("@"):
                p, stmt = stmt.split(None, 1)
                neg = p.startswith("@!")
                pred = p.lstrip("@!")
            parts = stmt.split(None, 1)
            ops = [_parse_operand(t) for t in _split_operands(parts[1])] if len(parts) > 1 else []
            insts.append(Inst(pred, neg, parts[0], ops, stmt_line, " ".join(stmt.split())))
        return Entry(name, params, insts, labels, shared, reg_types, directives)

    def launch(self, entry, grid, block, mem, args, dynamic_shared=0, seed=0, approx="random",
               max_steps=20_000_000, coverage=None, approx_seed=None):
        """Runs one launch of ``entry`` over ``grid`` x ``block`` on ``mem``.

        ``args`` maps parameter names to values: buffer addresses (ints), ints for
        .u32/.s32/.u64 and Python floats for .f32/.f64 parameters.  ``coverage``,
        when a set, receives the indices of the instructions executed.
        ``approx``: "random", "hash" or "exact" (see Arithmetic in the module
        docs); ``approx_seed`` keys the "hash" errors (default: ``seed``).
        """
        if approx not in ("random", "hash", "exact"):
            raise EmuError(f"approx={approx!r}: use 'random', 'hash' or 'exact'")
        if entry not in self.entries:
            raise EmuError(f"{self.path}: no entry {entry}")
        ent = self.entries[entry]
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        params = {}
        for pname, pty in ent.params:
            if pname not in args:
                raise EmuError(f"{entry}: argument {pname} missing")
            v = args[pname]
            if pty in ("f32", "f64"):
                params[pname] = int(to_bits(np.array([v], _FLOAT[pty]), pty)[0])
            else:
                params[pname] = int(v) & _MASK[_SIZES[pty]]
        extra = set(args) - {p for p, _ in ent.params}
        if extra:
            raise EmuError(f"{entry}: unknown arguments {sorted(extra)}")
        nthreads = block[0] * block[1] * block[2]
        for d in ("maxntid", "reqntid"):
            if f".{d}" in ent.directives:
                i = ent.directives.index(f".{d}")
                dims = []
                for tok in ent.directives[i + 1:i + 4]:
                    if not tok.rstrip(",").isdigit():
                        break
                    dims.append(int(tok.rstrip(",")))
                limit = int(np.prod(dims))
                too_big = d == "maxntid" and nthreads > limit
                if too_big or (d == "reqntid" and tuple(dims) != block[:len(dims)]):
                    raise EmuError(f"{entry}: block {block} violates .{d} {dims}")
        rng = np.random.default_rng(seed)
        mem.begin_launch()
        blocks = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]
        order = rng.permutation(len(blocks))
        # Overflow, NaN and division by zero are results here (IEEE values), not errors.
        with np.errstate(all="ignore"):
            for bi in order:
                b = _Block(self, ent, params, mem, blocks[bi], grid, block, dynamic_shared, rng,
                           approx, max_steps, int(bi))
                b.approx_seed = seed if approx_seed is None else approx_seed
                b.run()
                if coverage is not None:
                    coverage |= b.executed


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

class _Buffer:
    """One global-memory buffer.  ``data`` is a uint8 array: a private copy
    (``GlobalMemory.alloc``) or a view of memory owned elsewhere
    (``GlobalMemory.map``).  The per-byte race-tracking arrays of the current
    launch are created on first use and dropped by ``reset``, so buffers that a
    launch does not touch cost nothing."""

    _TRACK = ("writer", "w_blk", "w_ep", "written", "nc_read")

    def __init__(self, name, base, data, access):
        self.name, self.base, self.data, self.access = name, base, data, access
        self.end = base + len(data)
        self.tracked = False

    def _track(self):
        n = len(self.data)
        self.__dict__["writer"] = np.full(n, -1, np.int64)  # global thread id of the last store
        self.__dict__["w_blk"] = np.full(n, -1, np.int64)
        self.__dict__["w_ep"] = np.full(n, -1, np.int64)
        self.__dict__["written"] = np.zeros(n, bool)  # stored to in this launch (any thread)
        self.__dict__["nc_read"] = np.zeros(n, bool)  # read through ld.global.nc in this launch
        self.tracked = True

    def __getattr__(self, attr):  # only called for attributes not set yet
        if attr in _Buffer._TRACK:
            self._track()
            return self.__dict__[attr]
        raise AttributeError(attr)

    def reset(self):
        """Forgets the race-tracking state (start of a launch)."""
        if self.tracked:
            for attr in _Buffer._TRACK:
                del self.__dict__[attr]
            self.tracked = False


class GlobalMemory:
    """Device global memory: named, exact-size buffers separated by unmapped gaps."""

    def __init__(self):
        self.bufs = []  # sorted by base address
        self.next = 1 << 32
        self._bounds = None  # cached (bases, ends) arrays of ``bufs``

    def _insert(self, buf):
        for b in self.bufs:
            if buf.base < b.end + 1 and b.base < buf.end + 1:
                raise EmuError(f"buffer {buf.name} [{buf.base:#x}, {buf.end:#x}) overlaps or "
                               f"touches {b.name} [{b.base:#x}, {b.end:#x})")
        bases = [b.base for b in self.bufs]
        self.bufs.insert(int(np.searchsorted(np.array(bases, np.int64), buf.base)), buf)
        self._bounds = None

    def alloc(self, array, name, access="rw", offset=0):
        """Copies ``array`` into a new buffer and returns its address.

        ``access``: "r" (kernel must not write), "w" (kernel must not read) or "rw".
        ``offset``: bytes added to a 256-byte aligned base (to test alignment paths).
        """
        data = np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8).copy()
        base = self.next + offset
        buf = _Buffer(name, base, data, access)
        self._insert(buf)
        self.next = max(self.next, (base + len(data) + 4096 + 255) // 256 * 256)
        return base

    def map(self, base, view, name, access="rw"):
        """Adds a buffer at address ``base`` whose bytes are ``view`` itself (a
        contiguous uint8 numpy array, e.g. a slice of a shared memory mapping):
        kernel stores go straight to ``view``.  The buffer is exact-size like
        ``alloc``'s; it must not overlap or touch another buffer."""
        view = np.asarray(view)
        if view.dtype != np.uint8 or view.ndim != 1 or not view.flags.c_contiguous:
            raise EmuError(f"map({name}): the view must be a contiguous 1-D uint8 array")
        self._insert(_Buffer(name, int(base), view, access))
        return int(base)

    def unmap(self, base):
        """Removes the buffer that starts at ``base`` (added by ``map`` or ``alloc``)."""
        for i, b in enumerate(self.bufs):
            if b.base == base:
                del self.bufs[i]
                self._bounds = None
                return
        raise KeyError(f"no buffer at {base:#x}")

    def buffer(self, name):
        for b in self.bufs:
            if b.name == name:
                return b
        raise KeyError(name)

    def array(self, name, dtype):
        """The current contents of buffer ``name`` as a numpy array of ``dtype``."""
        return self.buffer(name).data.view(dtype).copy()

    def set_access(self, name, access):
        self.buffer(name).access = access

    def begin_launch(self):
        for b in self.bufs:
            b.reset()

    def _locate(self, addrs, n):
        if not self.bufs:
            raise EmuError(f"global access of {n} bytes at {int(addrs[0]):#x}: no buffers exist")
        if self._bounds is None:
            self._bounds = (np.array([b.base for b in self.bufs], np.int64),
                            np.array([b.end for b in self.bufs], np.int64))
        bases, ends = self._bounds
        idx = np.searchsorted(bases, addrs, side="right") - 1
        ok = (idx >= 0) & (addrs + n <= ends[np.maximum(idx, 0)])
        if np.count_nonzero(ok) != len(ok):
            bad = int(addrs[~ok][0])
            near = min(self.bufs, key=lambda b: min(abs(bad - b.base), abs(bad - b.end)))
            raise EmuError(f"global access of {n} bytes at {bad:#x} is outside every buffer "
                           f"(nearest: {near.name} [{near.base:#x}, {near.end:#x}), "
                           f"offset {bad - near.base})")
        return idx

    def _by_buffer(self, addrs, n):
        """(buffer, selection) for each buffer the accesses of ``n`` bytes at ``addrs``
        fall in; the selection is ``slice(None)`` when they all fall in one."""
        idx = self._locate(addrs, n)
        if not np.count_nonzero(idx != idx[0]):
            return [(self.bufs[idx[0]], slice(None))]
        return [(self.bufs[bi], idx == bi) for bi in np.unique(idx)]

    def read(self, addrs, n, threads, blk, ep, nc=False):
        """Bytes [len(addrs), n] at ``addrs``; ``threads`` are global thread ids.
        ``nc``: a read through the non-coherent path (ld.global.nc), which needs the
        bytes to stay unwritten for the whole launch."""
        out = np.zeros((len(addrs), n), np.uint8)
        if len(addrs) == 0:
            return out
        for b, sel in self._by_buffer(addrs, n):
            if b.access == "w":
                raise EmuError(f"read of write-only buffer {b.name}")
            off = (addrs[sel] - b.base)[:, None] + np.arange(n)
            th = np.repeat(threads[sel], n)
            flat = off.ravel()
            if b.tracked:
                w = b.writer[flat]
                bad = (w >= 0) & (w != th) & (b.w_blk[flat] == blk) & (b.w_ep[flat] == ep)
            else:  # nothing stored to this buffer yet in this launch
                bad = np.zeros(0, bool)
            if bad.any():
                k = np.nonzero(bad)[0][0]
                raise EmuError(f"global read-after-write race on {b.name} byte {flat[k]}: thread "
                               f"{th[k]} reads what thread {w[k]} of the same block wrote "
                               f"without a barrier in between")
            if nc:
                if b.tracked and b.written[flat].any():
                    raise EmuError(f"ld.global.nc of {b.name} bytes written earlier in this launch "
                                   f"(the non-coherent path needs data read-only for the launch)")
                b.nc_read[flat] = True
            out[sel] = b.data[off]
        return out

    def write(self, addrs, vals, threads, blk, ep, atomic=False):
        n = vals.shape[1]
        if len(addrs) == 0:
            return
        for b, sel in self._by_buffer(addrs, n):
            if b.access == "r":
                raise EmuError(f"write to read-only buffer {b.name}")
            off = (addrs[sel] - b.base)[:, None] + np.arange(n)
            flat = off.ravel()
            v = vals[sel].ravel()
            th = np.repeat(threads[sel], n)
            if b.nc_read[flat].any():
                raise EmuError(f"store to {b.name} bytes read through ld.global.nc in this launch "
                               f"(the non-coherent path needs data read-only for the launch)")
            b.written[flat] = True
            if not atomic:
                u, first, cnt = np.unique(flat, return_index=True, return_counts=True)
                if (cnt > 1).any():
                    # several threads of one instruction store to the same bytes
                    for byte in u[cnt > 1]:
                        vs = v[flat == byte]
                        if (vs != vs[0]).any():
                            raise EmuError(f"global write-write race on {b.name} byte {byte}: "
                                           f"threads {sorted(set(th[flat == byte].tolist()))[:4]} "
                                           f"store different values in one instruction")
                w = b.writer[flat]
                clash = (w >= 0) & (w != th) & (b.data[flat] != v)
                if clash.any():
                    k = np.nonzero(clash)[0][0]
                    raise EmuError(f"global write-write race on {b.name} byte {flat[k]}: threads "
                                   f"{w[k]} and {th[k]} store different values in one launch")
                b.writer[flat] = th
                b.w_blk[flat] = blk
                b.w_ep[flat] = ep
            b.data[flat] = v


class _Shared:
    """Shared memory of one block with per-byte race tracking."""

    def __init__(self, size, base):
        self.base, self.size = base, size
        self.data = np.full(size, 0xAB, np.uint8)
        self.w_th = np.full(size, -1, np.int64)
        self.w_ep = np.full(size, -1, np.int64)   # block epoch of the write
        self.w_wep = np.full(size, -1, np.int64)  # writer warp's warp epoch
        self.r_th = np.full(size, -1, np.int64)   # -2: several threads
        self.r_warp = np.full(size, -1, np.int64)  # -2: several warps
        self.r_ep = np.full(size, -1, np.int64)
        self.r_wep = np.full(size, -1, np.int64)
        self.pend = np.zeros(size, np.int32)
        self.pending = 0  # cp.async copies in flight (their bytes are counted in pend)
        self.epoch = 0
        self.warp_ep = None
        # scratch, indexed by offset: the lowest and highest thread at each start offset
        self._lo = np.zeros(size, np.int64)
        self._hi = np.zeros(size, np.int64)

    def offsets(self, addrs, n, align):
        off = addrs.astype(np.int64, copy=False) - self.base
        # one unsigned comparison: a negative offset wraps to a huge one
        outside = off.view(np.uint64) > np.uint64(max(self.size - n, 0))
        if n > self.size or np.count_nonzero(outside):
            bad = int(off[outside | (n > self.size)][0])
            raise EmuError(f"shared access of {n} bytes at offset {bad} outside the "
                           f"{self.size}-byte shared window")
        if np.count_nonzero(addrs % align):
            raise EmuError(f"misaligned shared access (needs {align}-byte alignment)")
        return off[:, None] + np.arange(n)

    def _ordered(self, other_th, other_ep, other_warp, other_wep, th):
        """True where an access by thread ``th`` is ordered after the other one."""
        warp = th >> 5
        same_warp_synced = (other_warp == warp) & (other_wep < self.warp_ep[warp])
        return (other_ep < self.epoch) | (other_th == th) | same_warp_synced | (other_th == -1)

    def _first_last(self, threads, start):
        """Per access: the lowest and the highest thread whose access starts at the same
        offset.  Accesses of one instruction have one size and are aligned to it, so two
        of them either cover the same bytes or none in common."""
        lo, hi = self._lo, self._hi
        lo[start] = np.iinfo(np.int64).max
        hi[start] = -1
        np.minimum.at(lo, start, threads)
        np.maximum.at(hi, start, threads)
        return lo[start], hi[start]

    def _check_writers(self, threads, flat, n, what):
        """Every byte of ``flat`` (``n`` per thread) was last written by the reading or
        writing thread itself, before a barrier, or by a synced lane of its warp."""
        if self.pending and (self.pend[flat] != 0).any():
            raise EmuError(f"shared {what} of bytes with a cp.async copy still in flight"
                           if what == "read" else "shared write over a cp.async copy still in flight")
        w_ep = self.w_ep[flat]
        if not np.count_nonzero(w_ep >= self.epoch):  # all written before the last barrier, or never
            return
        th = np.repeat(threads, n)
        w = self.w_th[flat]
        ok = self._ordered(w, w_ep, np.where(w >= 0, w >> 5, -1), self.w_wep[flat], th)
        if not ok.all():
            k = np.nonzero(~ok)[0][0]
            if what == "read":
                raise EmuError(f"shared read-after-write race at offset {flat[k]}: thread {th[k]} "
                               f"reads what thread {w[k]} wrote without a barrier in between")
            raise EmuError(f"shared write-after-write race at offset {flat[k]} (threads {w[k]} "
                           f"and {th[k]}, no barrier in between)")

    def read(self, threads, addrs, n, align):
        o = self.offsets(addrs, n, align)
        self._check_writers(threads, o.ravel(), n, "read")
        # Record the readers of each byte (one thread, or -2 for several; their warp, or
        # -2 for several), once per distinct access: the lowest thread reading it stands
        # for the others.  Per-access values are columns, broadcast over the access's bytes.
        first, last = self._first_last(threads, o[:, 0])
        rep = threads == first
        acc = o if np.count_nonzero(rep) == len(rep) else o[rep]
        tf, tl = first[rep][:, None], last[rep][:, None]
        warps = tf >> 5
        fresh = self.r_ep[acc] != self.epoch
        if np.count_nonzero(fresh) == fresh.size:  # no earlier reader in this interval
            multi, many_warps = tf != tl, (tl >> 5) != warps
        else:
            prev_th = np.where(fresh, -1, self.r_th[acc])
            prev_warp = np.where(fresh, -1, self.r_warp[acc])
            multi = (tf != tl) | ((prev_th != -1) & (prev_th != tf))
            many_warps = (((tl >> 5) != warps) | ((prev_warp >= 0) & (prev_warp != warps))
                          | (prev_warp == -2))
        self.r_th[acc] = np.where(multi, -2, tf)
        self.r_warp[acc] = np.where(many_warps, -2, warps)
        self.r_ep[acc] = self.epoch
        self.r_wep[acc] = self.warp_ep[warps]
        return self.data[o]

    def check_write(self, threads, o):
        flat = o.ravel()
        first, _ = self._first_last(threads, o[:, 0])
        if np.count_nonzero(threads != first):
            raise EmuError("two threads write the same shared bytes in one instruction")
        self._check_writers(threads, flat, o.shape[1], "write")
        r_ep = self.r_ep[flat]
        if not np.count_nonzero(r_ep == self.epoch):  # nothing read since the last barrier
            return
        th = np.repeat(threads, o.shape[1])
        r = np.where(r_ep == self.epoch, self.r_th[flat], -1)
        rwarp = self.r_warp[flat]
        ok = (r == -1) | (r == th) | ((rwarp == (th >> 5)) & (self.r_wep[flat] < self.warp_ep[th >> 5]))
        if not ok.all():
            k = np.nonzero(~ok)[0][0]
            raise EmuError(f"shared write-after-read race at offset {flat[k]}: thread {th[k]} "
                           f"overwrites bytes other threads read in the same barrier interval")

    def commit(self, threads, o, vals):
        """Stores ``vals`` (one row per thread) at offsets ``o`` (the same shape)."""
        self.data[o] = vals
        self.w_th[o] = threads[:, None]
        self.w_ep[o] = self.epoch
        self.w_wep[o] = self.warp_ep[threads >> 5][:, None]

    def write(self, threads, addrs, vals, align):
        o = self.offsets(addrs, vals.shape[1], align)
        self.check_write(threads, o)
        self.commit(threads, o, vals)


# ---------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------

_APPROX_ERR = {  # (relative, absolute) documented maximum errors
    "ex2": (2.0 ** -22, 0.0), "lg2": (2.0 ** -22, 2.0 ** -22.6), "rcp": (2.0 ** -23, 0.0),
    "sqrt": (2.0 ** -23, 0.0), "rsqrt": (2.0 ** -22.9, 0.0), "div": (2.0 ** -22, 0.0),
    "tanh": (2.0 ** -10.987, 0.0), "sin": (0.0, 2.0 ** -20.9), "cos": (0.0, 2.0 ** -20.9),
}

_SHARED_BASE = 0x1000


class _Block:
    def __init__(self, mod, ent, params, mem, ctaid, nctaid, ntid, dyn_shared, rng, approx,
                 max_steps, blk_index):
        self.mod, self.e, self.params, self.mem = mod, ent, params, mem
        self.ctaid, self.nctaid, self.ntid = ctaid, nctaid, ntid
        self.nt = ntid[0] * ntid[1] * ntid[2]
        self.rng, self.approx, self.max_steps = rng, approx, max_steps
        self.blk = blk_index
        self.lin = np.arange(self.nt, dtype=np.int64)
        self.gtid = blk_index * self.nt + self.lin
        self.regs, self.preds = {}, {}
        # shared memory layout: module-scope then entry-scope declarations; extern = dynamic
        self.sym = {}
        off = 0
        for name, size, align in list(mod.shared) + list(ent.shared):
            off = (off + align - 1) // align * align
            self.sym[name] = _SHARED_BASE + off
            off += size if size else dyn_shared
        self.sh = _Shared(max(off, 16), _SHARED_BASE)
        self.sh.warp_ep = np.zeros((self.nt + 31) // 32, np.int64)
        self.groups, self.cur_group = [], []
        self.executed = set()
        # The live-thread mask the block starts with (every thread): the run loop passes
        # this very object as the mask while no thread has exited, diverged or been
        # predicated off, so ``whole`` recognises it without looking at its elements.
        self.all_on = np.ones(self.nt, bool)

    # ---------------- operands
    def sreg(self, name):
        n = self.nt
        if name == "%laneid":
            return (self.lin & 31).astype(np.uint64)
        if name == "%warpid":
            return (self.lin >> 5).astype(np.uint64)
        if name == "%nwarpid":
            return np.full(n, (n + 31) // 32, np.uint64)
        if name == "%warpsize":
            return np.full(n, 32, np.uint64)
        m = _SREG.match(name)
        kind, ax = m.group(1), "xyz".index(m.group(2))
        if kind == "tid":
            x = self.lin % self.ntid[0]
            y = (self.lin // self.ntid[0]) % self.ntid[1]
            z = self.lin // (self.ntid[0] * self.ntid[1])
            return (x, y, z)[ax].astype(np.uint64)
        val = {"ntid": self.ntid, "ctaid": self.ctaid, "nctaid": self.nctaid}[kind][ax]
        return np.full(n, val, np.uint64)

    def bits(self, op, ty=None):
        """uint64 bits (array, or scalar for immediates) of an operand."""
        k = op.kind
        if k == "reg":
            r = self.regs.get(op.name)
            if r is None:
                if op.name not in self.e.reg_types:
                    raise EmuError(f"register {op.name} is not declared")
                r = np.full(self.nt, 0xFFFFFFFFFFFFFFFF, np.uint64)
                self.regs[op.name] = r
            return r
        if k == "sreg":
            return self.sreg(op.name)
        if k == "imm":
            if op.fty in ("f32", "f64"):
                if ty in ("f32", "f64") and ty != op.fty:  # e.g. 0f... used by an f64 instruction
                    val = bits_as(np.array([op.value], np.uint64), op.fty)
                    return np.uint64(to_bits(val.astype(_FLOAT[ty]), ty)[0])
                return np.uint64(op.value)
            if op.fty == "dec" or (ty in _FLOAT and isinstance(op.value, int)):
                fty = ty if ty in _FLOAT else "f64"
                return np.uint64(to_bits(np.array([float(op.value)]), fty)[0])
            return np.uint64(op.value & 0xFFFFFFFFFFFFFFFF)
        if k == "sym":
            if op.name in self.sym:
                return np.uint64(self.sym[op.name])
            if op.name in self.params:
                raise EmuError(f"parameter {op.name} used as a value (ld.param needed)")
            raise EmuError(f"unknown symbol {op.name}")
        raise EmuError(f"operand {op} cannot be read as a value")

    def get(self, op, ty):
        if op.kind == "reg":
            r = self.regs.get(op.name)
            if r is not None:
                return bits_as(r, ty)
        b = self.bits(op, ty)
        if np.ndim(b) == 0:
            b = np.full(self.nt, b, np.uint64)
        return bits_as(b, ty)

    def set(self, op, ty, val, mask):
        if op.kind == "sink":
            return
        if op.kind != "reg":
            raise EmuError(f"cannot write to {op}")
        bits = to_bits(val, ty)
        if bits.ndim == 0:
            bits = np.full(self.nt, bits, np.uint64)
        old = self.regs.get(op.name)
        if old is None and op.name not in self.e.reg_types:
            raise EmuError(f"register {op.name} is not declared")
        # to_bits returns a new array (or a scalar, made into one above): no copy needed
        if self.whole(mask):
            self.regs[op.name] = bits
        else:
            if old is None:
                old = np.full(self.nt, 0xFFFFFFFFFFFFFFFF, np.uint64)
            self.regs[op.name] = np.where(mask, bits, old)

    def whole(self, mask):
        """True when ``mask`` selects every thread of the block."""
        return mask is self.all_on or np.count_nonzero(mask) == self.nt

    def getp(self, op):
        name = op.name
        if name.startswith("!"):  # negated predicate operand
            return ~self.getp(Operand("reg", name=name[1:]))
        if name not in self.preds:
            raise EmuError(f"predicate {name} read before any thread wrote it")
        return self.preds[name]

    def setp(self, op, val, mask):
        if op.kind == "sink":
            return
        if self.whole(mask) and isinstance(val, np.ndarray) and val.shape == (self.nt,):
            self.preds[op.name] = val.astype(bool, copy=False)  # never changed in place
            return
        old = self.preds.get(op.name)
        if old is None:
            old = np.zeros(self.nt, bool)
        self.preds[op.name] = np.where(mask, val, old)

    def addr(self, op):
        if op.kind != "addr":
            raise EmuError(f"expected an address, got {op}")
        name = op.name
        if name.startswith("%"):
            base = self.get(Operand("reg", name=name), "u64").astype(np.int64)
        elif name in self.sym:
            base = np.full(self.nt, self.sym[name], np.int64)
        else:
            raise EmuError(f"unknown address base {name}")
        return base + op.off

    # ---------------- main loop
    def run(self):
        insts, labels = self.e.insts, self.e.labels
        nt = self.nt
        alive = self.all_on
        # While every live thread is at one instruction (``converged``), that instruction is
        # ``cpc`` and ``pcs`` is not kept up to date; it is filled in when threads diverge.
        pcs = np.zeros(nt, np.int64)
        converged, cpc = True, 0
        steps = 0
        while True:
            if converged:
                pc, mask_at = cpc, alive
            else:
                pc = int(pcs[alive].min())
                mask_at = alive & (pcs == pc)
                if np.count_nonzero(mask_at) == np.count_nonzero(alive):  # mask_at is in alive
                    converged, cpc, mask_at = True, pc, alive
            if pc >= len(insts):
                raise EmuError(f"{self.e.name}: threads run past the last instruction (missing ret)")
            steps += 1
            if steps > self.max_steps:
                raise EmuError(f"{self.e.name}: more than {self.max_steps} steps (endless loop?)")
            inst = insts[pc]
            self.executed.add(pc)
            mask = mask_at
            if inst.pred is not None:
                pv = self.preds.get(inst.pred)
                if pv is None:
                    pv = self.getp(Operand("reg", name=inst.pred))  # reports the unset predicate
                mask = mask_at & (~pv if inst.neg else pv)
            base = inst.parts[0]
            try:
                if base == "bra":
                    tgt = inst.ops[0].name
                    if tgt not in labels:
                        raise EmuError(f"unknown label {tgt}")
                    # mask is in mask_at: equal when they count the same threads
                    taken = np.count_nonzero(mask)
                    every = mask is mask_at or taken == np.count_nonzero(mask_at)
                    if inst.parts[-1] == "uni" and taken and not every:
                        raise EmuError("bra.uni taken by only some of the threads")
                    if converged and (not taken or every):
                        cpc = labels[tgt] if taken else pc + 1
                        continue
                    if converged:
                        pcs[alive] = pc
                        converged = False
                    pcs[mask] = labels[tgt]
                    pcs[mask_at & ~mask] = pc + 1
                    continue
                if base in ("ret", "exit"):
                    alive = alive & ~mask
                    if not np.count_nonzero(alive):
                        if self.cur_group or any(self.groups):
                            raise EmuError("kernel exits with cp.async copies not waited for")
                        return
                    if converged:
                        cpc = pc + 1  # the threads left all go on after it
                    else:
                        pcs[mask_at & ~mask] = pc + 1
                    continue
                if base in ("bar", "barrier") and inst.parts[1] != "warp":
                    if not np.count_nonzero(mask):
                        if converged:
                            cpc = pc + 1
                        else:
                            pcs[mask_at] = pc + 1
                        continue
                    if not self.whole(mask):
                        gone = int((~alive).sum())
                        elsewhere = int((alive & ~mask).sum())
                        raise EmuError(f"bar.sync reached by {int(mask.sum())} of {nt} threads "
                                       f"({gone} exited, {elsewhere} elsewhere or predicated off)")
                self.execute(inst, mask)
            except EmuError as err:
                raise EmuError(f"{self.mod.path}:{inst.line}: {self.e.name}: `{inst.text}` "
                               f"(block {self.ctaid}): {err}") from None
            if converged:
                cpc = pc + 1
            else:
                pcs[mask_at] = pc + 1

    # ---------------- instructions
    def execute(self, inst, mask):
        base = inst.parts[0]
        h = _HANDLERS.get(base)
        if h is None:
            raise EmuError(f"unsupported instruction {inst.op}")
        h(self, inst, mask)

    def type_of(self, inst):
        for p in reversed(inst.parts):
            if p in _SIZES or p == "pred":
                return p
        raise EmuError(f"no type in {inst.op}")

    def approx_round(self, exact, kind, dtype=np.float32):
        """float64 exact values -> dtype, moved within the documented error of ``kind``."""
        if self.approx in ("random", "hash") and kind in _APPROX_ERR:
            rel, ab = _APPROX_ERR[kind]
            if self.approx == "random":
                u = self.rng.uniform(-1.0, 1.0, exact.shape)
            else:
                u = _hash_uniform(exact, kind, self.approx_seed)
            moved = exact + u * (rel * np.abs(exact) + ab)
            exact = np.where(np.isfinite(exact), moved, exact)
        return exact.astype(dtype)


def _hash_uniform(exact, kind, seed):
    """Values in [-1, 1) that are a fixed function of (the bits of ``exact``, ``kind``,
    ``seed``): splitmix64 of the float64 bits, so equal inputs get equal errors."""
    tag = int.from_bytes(kind.encode()[:8].ljust(8, b"\0"), "little")
    key = np.uint64((tag ^ (int(seed) * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF)
    x = np.ascontiguousarray(exact, np.float64).view(np.uint64) ^ key
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 / (1 << 53)) - 1.0


def _h_mov(b, inst, mask):
    ty = b.type_of(inst)
    d, s = inst.ops
    if s.kind == "vec":  # pack
        size = _SIZES[ty] // len(s.items)
        acc = np.zeros(b.nt, np.uint64)
        for i, it in enumerate(s.items):
            acc |= (b.get(it, f"b{8 * size}").astype(np.uint64) << np.uint64(8 * size * i))
        b.set(d, ty, bits_as(acc, ty), mask)
    elif d.kind == "vec":  # unpack
        size = _SIZES[ty] // len(d.items)
        v = b.get(s, f"b{8 * _SIZES[ty]}").astype(np.uint64)
        for i, it in enumerate(d.items):
            b.set(it, f"b{8 * size}", (v >> np.uint64(8 * size * i)) & np.uint64(_MASK[size]), mask)
    elif ty == "pred":
        b.setp(d, b.getp(s), mask)
    else:
        b.set(d, ty, b.get(s, ty), mask)


def _h_cvta(b, inst, mask):
    b.set(inst.ops[0], "u64", b.get(inst.ops[1], "u64"), mask)


def _round_int(x, mode):
    if mode == "rni":
        return np.rint(x)
    if mode == "rzi":
        return np.trunc(x)
    if mode == "rmi":
        return np.floor(x)
    if mode == "rpi":
        return np.ceil(x)
    raise EmuError(f"unsupported integer rounding .{mode}")


def _int_range(ty):
    """(min, max) of integer type ``ty``."""
    bits = 8 * _SIZES[ty]
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if _is_signed(ty) else (0, 2 ** bits - 1)


def _h_cvt(b, inst, mask):
    parts = inst.parts[1:]
    mods = [p for p in parts if p not in _SIZES]
    types = [p for p in parts if p in _SIZES]
    dt, st = types[0], types[1]
    ftz, sat = "ftz" in mods, "sat" in mods
    rnd = [m for m in mods if m in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")]
    rnd = rnd[0] if rnd else None
    d = inst.ops[0]
    if dt in ("f16x2", "bf16x2"):
        if rnd != "rn":
            raise EmuError(f"{inst.op}: only .rn is supported")
        hi, lo = b.get(inst.ops[1], "f32"), b.get(inst.ops[2], "f32")
        conv = _f32_to_f16_bits if dt == "f16x2" else f32_to_bf16_bits
        val = (conv(hi).astype(np.uint64) << np.uint64(16)) | conv(lo).astype(np.uint64)
        b.set(d, "b32", val, mask)
        return
    if st == "bf16":
        x = bf16_bits_to_f32(b.get(inst.ops[1], "b16"))
        st = "f32"
    else:
        x = b.get(inst.ops[1], st)
    if ftz and st == "f32":
        x = _ftz(x)
    if _is_float(dt):
        if _is_float(st):
            if dt == "bf16":
                if st != "f32" or rnd != "rn":
                    raise EmuError(f"{inst.op}: only cvt.rn.bf16.f32 is supported")
                b.set(d, "b16", f32_to_bf16_bits(x), mask)
                return
            if dt == "f16":
                if rnd != "rn" or st != "f32":
                    raise EmuError(f"{inst.op}: only cvt.rn.f16.f32 is supported")
                b.set(d, "b16", _f32_to_f16_bits(x), mask)
                return
            if rnd in ("rni", "rzi", "rmi", "rpi"):
                y = _round_int(x.astype(np.float64), rnd).astype(_FLOAT[dt])
            else:
                if _SIZES[dt] < _SIZES[st] and rnd != "rn":
                    raise EmuError(f"{inst.op}: narrowing float conversion needs .rn")
                y = x.astype(_FLOAT[dt])
        else:
            if rnd not in ("rn", None):
                raise EmuError(f"{inst.op}: only .rn int -> float is supported")
            y = x.astype(np.float64).astype(_FLOAT[dt]) if _SIZES[st] <= 4 else x.astype(_FLOAT[dt])
        if ftz and dt == "f32":
            y = _ftz(y)
        if sat:
            y = np.clip(np.nan_to_num(y, nan=0.0), 0.0, 1.0).astype(y.dtype)
        b.set(d, dt, y, mask)
        return
    # integer destination
    size = _SIZES[dt]
    if _is_float(st):
        if rnd is None:
            raise EmuError(f"{inst.op}: float -> int needs a rounding modifier")
        r = _round_int(x.astype(np.float64), rnd)
        lo, hi = _int_range(dt)
        r = np.where(np.isnan(r), 0, np.clip(r, lo, hi))
        vals = np.array([int(v) for v in r], dtype=object) if size == 8 else r.astype(np.int64)
        if size == 8:
            bits = np.array([v & _MASK[8] for v in vals], np.uint64)
            b.set(d, "u64", bits, mask)
        else:
            b.set(d, dt, vals, mask)
        return
    v = x.astype(np.int64) if _is_signed(st) or _SIZES[st] < 8 else x.astype(np.uint64)
    if sat:
        lo, hi = _int_range(dt)
        v = np.clip(v.astype(object), lo, hi).astype(np.int64 if lo < 0 or size < 8 else np.uint64)
    b.set(d, dt, v, mask)


def _float_binop(b, inst, mask, fn):
    ty = b.type_of(inst)
    mods = inst.parts[1:-1]
    for m in mods:
        if m in ("rz", "rm", "rp"):
            raise EmuError(f"{inst.op}: rounding .{m} not supported")
    a = b.get(inst.ops[1], ty)
    c = b.get(inst.ops[2], ty)
    if "ftz" in mods:
        a, c = _ftz(a), _ftz(c)
    r = fn(a, c).astype(a.dtype)
    if "ftz" in mods:
        r = _ftz(r)
    if "sat" in mods:
        r = np.clip(np.nan_to_num(r, nan=0.0), 0, 1).astype(r.dtype)
    b.set(inst.ops[0], ty, r, mask)


def _int_vals(b, op, ty):
    v = b.get(op, ty)
    return v.astype(np.int64) if _is_signed(ty) or _SIZES[ty] < 8 else v


def _h_arith(b, inst, mask):
    base = inst.parts[0]
    ty = b.type_of(inst)
    if ty in ("f32", "f64"):
        fns = {"add": np.add, "sub": np.subtract, "mul": np.multiply,
               "min": np.fmin if "NaN" not in inst.parts else np.minimum,
               "max": np.fmax if "NaN" not in inst.parts else np.maximum,
               "copysign": lambda a, c: np.copysign(c, a)}
        if base == "div":
            if "rn" in inst.parts:
                return _float_binop(b, inst, mask, np.divide)
            a, c = b.get(inst.ops[1], ty), b.get(inst.ops[2], ty)
            if "ftz" in inst.parts:
                a, c = _ftz(a), _ftz(c)
            r = b.approx_round(a.astype(np.float64) / c.astype(np.float64), "div", a.dtype)
            b.set(inst.ops[0], ty, _ftz(r) if "ftz" in inst.parts else r, mask)
            return
        if base not in fns:
            raise EmuError(f"unsupported float instruction {inst.op}")
        return _float_binop(b, inst, mask, fns[base])
    if ty in ("f16", "bf16", "f16x2", "bf16x2"):
        raise EmuError(f"{inst.op}: half-precision arithmetic is not supported")
    size = _SIZES[ty]
    mods = inst.parts[1:-1]
    if size <= 4 and ("wide" in mods or (base in ("mul", "mad") and "hi" in mods)):
        # The product of two operands of at most 32 bits is exact in 64 bits.
        wide = np.int64 if _is_signed(ty) else np.uint64
        r = b.get(inst.ops[1], ty).astype(wide) * b.get(inst.ops[2], ty).astype(wide)
        if "wide" in mods:
            dty = f"{'s' if _is_signed(ty) else 'u'}{16 * size}"
        else:
            r, dty = r >> (8 * size), ty
        if base == "mad":
            r = r + b.get(inst.ops[3], dty).astype(wide)  # wraps; set keeps the low bits of dty
        b.set(inst.ops[0], dty, r, mask)
        return
    if "wide" in mods:
        a = _int_vals(b, inst.ops[1], ty).astype(object)
        c = _int_vals(b, inst.ops[2], ty).astype(object)
        r = a * c
        if base == "mad":
            r = r + _int_vals(b, inst.ops[3], ty.replace("32", "64")).astype(object)
        dty = ty.replace("32", "64").replace("16", "32")
        dsize = _SIZES[dty]
        b.set(inst.ops[0], "u64" if dsize == 8 else "u32",
              np.array([int(x) & _MASK[dsize] for x in r], np.uint64), mask)
        return
    if base in ("mul", "mad") and "hi" in mods:
        a = _int_vals(b, inst.ops[1], ty).astype(object)
        c = _int_vals(b, inst.ops[2], ty).astype(object)
        r = np.array([(int(x) * int(y)) >> (8 * size) for x, y in zip(a, c)], dtype=object)
        if base == "mad":
            r = r + _int_vals(b, inst.ops[3], ty).astype(object)
        b.set(inst.ops[0], f"b{8 * size}", np.array([int(x) & _MASK[size] for x in r], np.uint64), mask)
        return
    a = _int_vals(b, inst.ops[1], ty)
    if base in ("neg", "not", "abs", "popc", "clz", "brev", "cnot"):
        if base == "neg":
            r = -a.astype(np.int64)
        elif base == "not":
            r = ~a.astype(np.int64) if size < 8 else ~a
        elif base == "abs":
            r = np.abs(a.astype(np.int64))
        elif base == "cnot":
            r = (a == 0).astype(np.int64)
        elif base == "popc":
            r = np.array([bin(int(x) & _MASK[size]).count("1") for x in a], np.int64)
            b.set(inst.ops[0], "u32", r, mask)
            return
        elif base == "clz":
            r = np.array([8 * size - (int(x) & _MASK[size]).bit_length() for x in a], np.int64)
            b.set(inst.ops[0], "u32", r, mask)
            return
        else:
            r = np.array([int(f"{int(x) & _MASK[size]:0{8 * size}b}"[::-1], 2) for x in a], np.uint64)
        _set_int(b, inst.ops[0], ty, r, mask)
        return
    if base in ("shl", "shr"):
        sh = b.get(inst.ops[2], "u32").astype(np.int64)
        sh = np.minimum(sh, 8 * size)
        if base == "shl":
            if size == 8:
                r = np.where(sh >= 64, np.uint64(0), a.astype(np.uint64) << sh.astype(np.uint64))
            else:
                r = np.where(sh >= 8 * size, 0, (a.astype(np.int64) << np.minimum(sh, 63)) & _MASK[size])
        elif _is_signed(ty):
            r = a.astype(np.int64) >> np.minimum(sh, 63)
        else:
            ua = a.astype(np.uint64) if size == 8 else a.astype(np.int64) & _MASK[size]
            r = np.where(sh >= 8 * size, 0, ua >> (sh.astype(ua.dtype)))
        _set_int(b, inst.ops[0], ty, r, mask)
        return
    c = _int_vals(b, inst.ops[2], ty)
    if size == 8 and not _is_signed(ty):
        a, c = a.astype(np.uint64), c.astype(np.uint64)
    if base in ("add", "sub", "mul", "mad"):
        if "sat" in mods:
            raise EmuError(f"{inst.op}: .sat on integers not supported")
        r = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "mad": np.multiply}[base](a, c)
        if base == "mad":
            r = r + _int_vals(b, inst.ops[3], ty).astype(r.dtype)
    elif base in ("and", "or", "xor"):
        r = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[base](a, c)
    elif base == "min":
        r = np.minimum(a, c)
    elif base == "max":
        r = np.maximum(a, c)
    elif base in ("div", "rem"):
        if (c[mask] == 0).any():
            raise EmuError(f"integer {base} by zero")
        cc = np.where(c == 0, 1, c)
        if _is_signed(ty):
            # truncating division, exact for every width
            q = np.array([(abs(int(x)) // abs(int(y))) * (1 if (x < 0) == (y < 0) else -1)
                          for x, y in zip(a, cc)], np.int64)
            r = q if base == "div" else a - q * cc
        else:
            r = a // cc if base == "div" else a % cc
    else:
        raise EmuError(f"unsupported instruction {inst.op}")
    _set_int(b, inst.ops[0], ty, r, mask)


def _set_int(b, op, ty, r, mask):
    """Stores an integer result (int64 / uint64 array) wrapped to the width of ``ty``."""
    r = np.asarray(r)
    if _SIZES[ty] == 8:
        r = r.astype(np.int64).view(np.uint64) if r.dtype.kind in "ib" else r.astype(np.uint64)
        b.set(op, "u64", r, mask)
    else:
        b.set(op, ty, r.astype(np.int64), mask)


def _h_pred_logic(b, inst, mask):
    base = inst.parts[0]
    if base == "not":
        b.setp(inst.ops[0], ~b.getp(inst.ops[1]), mask)
        return
    x, y = b.getp(inst.ops[1]), b.getp(inst.ops[2])
    r = {"and": x & y, "or": x | y, "xor": x ^ y}[base]
    b.setp(inst.ops[0], r, mask)


def _h_logic(b, inst, mask):
    if inst.parts[-1] == "pred":
        return _h_pred_logic(b, inst, mask)
    return _h_arith(b, inst, mask)


_CMP = {
    "eq": lambda a, c: a == c, "ne": lambda a, c: a != c, "lt": lambda a, c: a < c,
    "le": lambda a, c: a <= c, "gt": lambda a, c: a > c, "ge": lambda a, c: a >= c,
    "lo": lambda a, c: a < c, "ls": lambda a, c: a <= c, "hi": lambda a, c: a > c,
    "hs": lambda a, c: a >= c,
}


def _h_setp(b, inst, mask):
    cmp = inst.parts[1]
    combine = inst.parts[2] if inst.parts[2] in ("and", "or", "xor") else None
    ty = inst.parts[-1]
    if ty == "bf16":
        a = bf16_bits_to_f32(b.get(inst.ops[1], "b16"))
        c = bf16_bits_to_f32(b.get(inst.ops[2], "b16"))
    else:
        a, c = b.get(inst.ops[1], ty), b.get(inst.ops[2], ty)
    if "ftz" in inst.parts and ty == "f32":
        a, c = _ftz(a), _ftz(c)
    if _is_float(ty):
        nan = np.isnan(a) | np.isnan(c)
        if cmp == "num":
            r = ~nan
        elif cmp == "nan":
            r = nan
        elif cmp.endswith("u") and cmp[:-1] in _CMP:
            r = _CMP[cmp[:-1]](a, c) | nan
        elif cmp in _CMP:
            r = _CMP[cmp](a, c) & ~nan
        else:
            raise EmuError(f"unsupported comparison {cmp}")
    else:
        r = _CMP[cmp](a, c)
    if combine:
        q = b.getp(inst.ops[3])
        r = {"and": r & q, "or": r | q, "xor": r ^ q}[combine]
    d = inst.ops[0]
    if d.kind == "pair":
        b.setp(d.items[0], r, mask)
        b.setp(d.items[1], ~r, mask)
    else:
        b.setp(d, r, mask)


def _h_selp(b, inst, mask):
    ty = b.type_of(inst)
    p = b.getp(inst.ops[3])
    bt = f"b{8 * _SIZES[ty]}"
    b.set(inst.ops[0], bt, np.where(p, b.get(inst.ops[1], bt), b.get(inst.ops[2], bt)), mask)


def _h_testp(b, inst, mask):
    ty = inst.parts[-1]
    x = b.get(inst.ops[1], ty)
    r = {"finite": np.isfinite(x), "infinite": np.isinf(x), "number": ~np.isnan(x),
         "notanumber": np.isnan(x), "normal": np.isfinite(x) & (np.abs(x) >= np.finfo(x.dtype).tiny),
         "subnormal": (x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny)}[inst.parts[1]]
    b.setp(inst.ops[0], r, mask)


def _h_fma(b, inst, mask):
    ty = b.type_of(inst)
    if "rn" not in inst.parts:
        raise EmuError(f"{inst.op}: only .rn is supported")
    ops = inst.ops
    a, c, d = b.get(ops[1], ty), b.get(ops[2], ty), b.get(ops[3], ty)
    ftz = "ftz" in inst.parts
    if ftz:
        a, c, d = _ftz(a), _ftz(c), _ftz(d)
    if ty == "f32":
        r = _fma_f32(a, c, d)
    elif ty == "f64":
        r = _fma_f64(a, c, d)
    else:
        raise EmuError(f"{inst.op}: unsupported type")
    if ftz:
        r = _ftz(r)
    if "sat" in inst.parts:
        r = np.clip(np.nan_to_num(r, nan=0.0), 0, 1).astype(r.dtype)
    b.set(inst.ops[0], ty, r, mask)


def _h_mad(b, inst, mask):
    if b.type_of(inst) in ("f32", "f64"):
        return _h_fma(b, inst, mask)
    return _h_arith(b, inst, mask)


def _h_unary_float(b, inst, mask):
    base = inst.parts[0]
    ty = b.type_of(inst)
    if ty not in ("f32", "f64"):
        if base in ("neg", "abs"):
            return _h_arith(b, inst, mask)
        raise EmuError(f"{inst.op}: unsupported type")
    x = b.get(inst.ops[1], ty)
    ftz = "ftz" in inst.parts
    if ftz:
        x = _ftz(x)
    x64 = x.astype(np.float64)
    if base == "neg":
        r = -x
    elif base == "abs":
        r = np.abs(x)
    elif base in ("rcp", "sqrt") and "rn" in inst.parts:
        r = np.sqrt(x) if base == "sqrt" else np.divide(x.dtype.type(1), x)
    elif base in ("rcp", "sqrt", "rsqrt", "ex2", "lg2", "tanh", "sin", "cos"):
        if "approx" not in inst.parts:
            raise EmuError(f"{inst.op}: rounding mode not supported")
        exact = {"rcp": lambda v: 1.0 / v, "sqrt": np.sqrt, "rsqrt": lambda v: 1.0 / np.sqrt(v),
                 "ex2": np.exp2, "lg2": np.log2, "tanh": np.tanh, "sin": np.sin,
                 "cos": np.cos}[base](x64)
        r = b.approx_round(exact, base, x.dtype)
        if base == "tanh":
            r = np.clip(r, -1, 1).astype(x.dtype)
    else:
        raise EmuError(f"unsupported instruction {inst.op}")
    if ftz:
        r = _ftz(r)
    b.set(inst.ops[0], ty, r, mask)


def _mem_type(inst):
    for p in reversed(inst.parts):
        if p in _SIZES:
            return p
    raise EmuError(f"no type in {inst.op}")


def _space(inst):
    for p in inst.parts[1:]:
        if p in ("param", "global", "shared", "local", "const"):
            return p
    return "generic"


def _mem_layout(inst):
    """(type, state space, vector width) of a ld / st, decoded once per instruction."""
    if inst.memo is None:
        vec = next((int(p[1:]) for p in inst.parts if re.fullmatch(r"v[248]", p)), 1)
        inst.memo = (_mem_type(inst), _space(inst), vec)
    return inst.memo


def _h_ld(b, inst, mask):
    ty, space, vec = _mem_layout(inst)
    d, a = inst.ops[0], inst.ops[1]
    regs = d.items if d.kind == "vec" else [d]
    size = _SIZES[ty]
    if space == "param":
        name = a.name
        if name not in b.params:
            raise EmuError(f"unknown parameter {name}")
        if a.off:
            raise EmuError("offset into a parameter is not supported")
        val = np.full(b.nt, b.params[name], np.uint64)
        b.set(regs[0], f"b{8 * size}", val, mask)
        return
    th = np.nonzero(mask)[0]
    if len(th) == 0:
        return
    addrs = b.addr(a)[th]
    n = size * vec
    if (addrs % n).any():
        raise EmuError(f"misaligned {n}-byte access at {int(addrs[(addrs % n) != 0][0]):#x}")
    if space == "generic":
        space = "shared" if (addrs < (1 << 32)).all() else "global"
    if space == "global":
        raw = b.mem.read(addrs, n, b.gtid[th], b.blk, b.sh.epoch, nc="nc" in inst.parts)
    elif space == "shared":
        raw = b.sh.read(th, addrs, n, n)
    else:
        raise EmuError(f"unsupported state space .{space}")
    words = np.ascontiguousarray(raw).view(_UINT[size]).reshape(len(th), vec)
    whole = len(th) == b.nt
    for i, r in enumerate(regs):
        w = words[:, i]
        if _is_signed(ty):
            w = w.view(_SINT[size]).astype(np.int64).view(np.uint64)
            rt = b.e.reg_types.get(r.name, "b64")
            w = w & np.uint64(_MASK[_SIZES.get(rt, 8)])
        if r.kind != "sink":
            if r.name not in b.e.reg_types:
                raise EmuError(f"register {r.name} is not declared")
            if whole:  # th is every thread, in order
                b.regs[r.name] = w.astype(np.uint64)
                continue
            full = np.zeros(b.nt, np.uint64)
            full[th] = w
            old = b.regs.get(r.name)
            if old is None:
                old = np.full(b.nt, 0xFFFFFFFFFFFFFFFF, np.uint64)
            b.regs[r.name] = np.where(mask, full, old)


def _h_st(b, inst, mask):
    ty, space, vec = _mem_layout(inst)
    a, s = inst.ops[0], inst.ops[1]
    regs = s.items if s.kind == "vec" else [s]
    size = _SIZES[ty]
    th = np.nonzero(mask)[0]
    if len(th) == 0:
        return
    addrs = b.addr(a)[th]
    n = size * vec
    if (addrs % n).any():
        raise EmuError(f"misaligned {n}-byte access at {int(addrs[(addrs % n) != 0][0]):#x}")
    vals = np.stack([b.get(r, f"b{8 * size}")[th] for r in regs], 1).astype(_UINT[size])
    raw = np.ascontiguousarray(vals).view(np.uint8).reshape(len(th), n)
    if space == "generic":
        space = "shared" if (addrs < (1 << 32)).all() else "global"
    if space == "global":
        b.mem.write(addrs, raw, b.gtid[th], b.blk, b.sh.epoch)
    elif space == "shared":
        b.sh.write(th, addrs, raw, n)
    else:
        raise EmuError(f"unsupported state space .{space}")


def _h_atom(b, inst, mask):
    """atom / red: applied thread by thread in increasing thread order."""
    is_red = inst.parts[0] == "red"
    ty = _mem_type(inst)
    space = _space(inst)
    known = ("add", "min", "max", "inc", "dec", "and", "or", "xor", "exch", "cas")
    op = next((p for p in inst.parts[1:] if p in known), None)
    if op is None:
        raise EmuError(f"unsupported atomic {inst.op}")
    ops = inst.ops if is_red else inst.ops[1:]
    a = ops[0]
    size = _SIZES[ty]
    th = np.nonzero(mask)[0]
    if len(th) == 0:
        return
    addrs = b.addr(a)[th]
    if (addrs % size).any():
        raise EmuError("misaligned atomic")
    if space == "generic":
        space = "shared" if (addrs < (1 << 32)).all() else "global"
    bt = f"b{8 * size}"
    src = b.get(ops[1], ty)[th]
    cmpv = b.get(ops[2], ty)[th] if op == "cas" else None
    olds = np.zeros(b.nt, np.uint64)
    dt = _FLOAT.get(ty, _SINT[size] if _is_signed(ty) else _UINT[size])
    for k, t in enumerate(th):
        ad = addrs[k:k + 1]
        if space == "global":
            raw = b.mem.read(ad, size, b.gtid[t:t + 1], -2, -2)  # atomics are ordered
        elif space == "shared":
            o = b.sh.offsets(ad, size, size)
            if (b.sh.pend[o.ravel()] != 0).any():
                raise EmuError("atomic on shared bytes with a cp.async copy in flight")
            raw = b.sh.data[o]
        else:
            raise EmuError(f"unsupported state space .{space}")
        old = raw.view(dt)[0, 0] if dt != np.uint64 else raw.view(np.uint64)[0, 0]
        x = src[k]
        if op == "add":
            new = dt(old + x) if ty not in ("f32", "f64") else dt(dt(old) + dt(x))
        elif op == "min":
            new = min(old, x) if ty not in ("f32", "f64") else np.fmin(old, x)
        elif op == "max":
            new = max(old, x) if ty not in ("f32", "f64") else np.fmax(old, x)
        elif op == "inc":
            new = 0 if old >= x else old + 1
        elif op == "dec":
            new = x if (old == 0 or old > x) else old - 1
        elif op == "and":
            new = old & x
        elif op == "or":
            new = old | x
        elif op == "xor":
            new = old ^ x
        elif op == "exch":
            new = x
        else:
            new = cmpv[k] if old == x else old
        newraw = np.array([new], dtype=dt).view(np.uint8).reshape(1, size)
        if space == "global":
            b.mem.write(ad, newraw, b.gtid[t:t + 1], b.blk, b.sh.epoch, atomic=True)
        else:
            b.sh.data[o.ravel()] = newraw.ravel()
            b.sh.w_th[o.ravel()] = -1  # atomics do not race with each other
        olds[t] = np.array([old], dtype=dt).view(_UINT[size]).astype(np.uint64)[0]
    if not is_red:
        b.set(inst.ops[0], bt, olds, mask)


def _h_bar(b, inst, mask):
    if inst.parts[1] == "warp":
        mm = b.get(inst.ops[0], "u32") if inst.ops else 0xFFFFFFFF
        _check_warp_members(b, mask, mm, inst)
        warps = np.unique(np.nonzero(mask)[0] >> 5)
        b.sh.warp_ep[warps] += 1
        return
    if inst.ops and inst.ops[0].kind == "imm" and inst.ops[0].value != 0:
        raise EmuError("only barrier 0 is supported")
    if len(inst.ops) > 1:
        cnt = int(b.get(inst.ops[1], "u32")[0])
        if cnt != b.nt:
            raise EmuError(f"barrier thread count {cnt} differs from the block size {b.nt}")
    b.sh.epoch += 1  # cp.async copies in flight stay pending across barriers


_LANE_BIT = np.int64(1) << np.arange(32, dtype=np.int64)


def _check_warp_members(b, mask, membermask, inst):
    """Every warp executing ``inst`` must do so with exactly the lanes its member
    mask names (``membermask``: an int, or per-thread values equal within a warp)."""
    mm = np.broadcast_to(np.asarray(membermask, np.int64), (b.nt,))
    # One pass over all warps (a partial last warp padded with lanes that do not exist):
    # a warp passes when its executing lanes agree on the member mask and the mask names
    # exactly those of its lanes that exist.
    pad = np.zeros(-b.nt % 32, bool)
    lanes = np.concatenate([mask, pad]).reshape(-1, 32)
    exists = np.concatenate([np.ones(b.nt, bool), pad]).reshape(-1, 32)
    vals = np.concatenate([mm, pad.astype(np.int64)]).reshape(-1, 32)
    executing = np.count_nonzero(lanes, axis=1) > 0
    first = vals[np.arange(len(vals)), np.argmax(lanes, axis=1)]
    agree = ((vals == first[:, None]) | ~lanes).all(axis=1)
    named = (first[:, None] & _LANE_BIT) != 0
    if (agree & ((named == lanes) | ~exists).all(axis=1))[executing].all():
        return
    for w in np.unique(np.nonzero(mask)[0] >> 5):  # a warp fails: find and name it
        lanes = mask[32 * w:32 * w + 32]
        vals = np.unique(mm[32 * w:32 * w + 32][lanes])
        if len(vals) != 1:
            raise EmuError(f"warp {w}: lanes disagree on the member mask")
        want = np.array([(int(vals[0]) >> i) & 1 for i in range(len(lanes))], bool)
        if (lanes & ~want).any():
            raise EmuError(f"warp {w}: executing lanes {np.nonzero(lanes & ~want)[0].tolist()} "
                           f"are not in the member mask {int(vals[0]):#x}")
        if (want & ~lanes).any():
            raise EmuError(f"warp {w}: lanes {np.nonzero(want & ~lanes)[0].tolist()} named in the "
                           f"member mask {int(vals[0]):#x} do not execute this instruction with the "
                           f"others (diverged, exited or predicated off)")


def _h_shfl(b, inst, mask):
    mode = inst.parts[2]
    d, a, bb, c, mm = inst.ops
    _check_warp_members(b, mask, b.get(mm, "u32"), inst)
    lane = (b.lin & 31)
    bval = b.get(bb, "u32").astype(np.int64) & 31
    cv = b.get(c, "u32").astype(np.int64)
    cval, seg = cv & 31, (cv >> 8) & 31
    max_lane = (lane & seg) | (cval & ~seg)
    min_lane = lane & seg
    if mode == "up":
        j = lane - bval
        pval = j >= max_lane
    elif mode == "down":
        j = lane + bval
        pval = j <= max_lane
    elif mode == "bfly":
        j = lane ^ bval
        pval = j <= max_lane
    elif mode == "idx":
        j = min_lane | (bval & ~seg)
        pval = j <= max_lane
    else:
        raise EmuError(f"unsupported shfl mode {mode}")
    j = np.where(pval, j, lane)
    src_t = (b.lin & ~31) + j
    if (src_t >= b.nt).any() and mask[src_t >= b.nt].any():
        raise EmuError("shfl source lane beyond the block")
    src_t = np.minimum(src_t, b.nt - 1)
    if mask.any() and not mask[src_t[mask]].all():
        raise EmuError("shfl reads a lane that does not take part")
    av = b.get(a, "b32")
    dd = d.items[0] if d.kind == "pair" else d
    b.set(dd, "b32", av[src_t], mask)
    if d.kind == "pair":
        b.setp(d.items[1], pval, mask)


def _h_vote(b, inst, mask):
    """vote.sync.{all,any,uni}.pred d, {!}p, membermask; vote.sync.ballot.b32 d, {!}p, membermask."""
    mode = next(m for m in inst.parts[1:] if m in ("all", "any", "uni", "ballot"))
    _check_warp_members(b, mask, b.get(inst.ops[-1], "u32"), inst)
    p = b.getp(inst.ops[1])
    out_bits = np.zeros(b.nt, np.uint64)
    out_pred = np.zeros(b.nt, bool)
    for w in range(0, b.nt, 32):
        m = mask[w:w + 32]
        pv = p[w:w + 32] & m
        out_bits[w:w + 32] = sum(1 << i for i in range(len(pv)) if pv[i])
        sel = p[w:w + 32][m]
        out_pred[w:w + 32] = {"all": sel.all(), "any": sel.any(), "uni": sel.all() or not sel.any(),
                              "ballot": False}[mode]
    if mode == "ballot":
        b.set(inst.ops[0], "b32", out_bits, mask)
    else:
        b.setp(inst.ops[0], out_pred, mask)


def _h_nop(b, inst, mask):
    return None


def _h_cp(b, inst, mask):
    kind = inst.parts[2]
    if kind == "commit_group":
        if mask.any():
            b.groups.append(b.cur_group)
            b.cur_group = []
        return
    if kind in ("wait_group", "wait_all"):
        if kind == "wait_all":
            b.groups.append(b.cur_group)
            b.cur_group = []
            keep = 0
        else:
            keep = int(inst.ops[0].value)
        while len(b.groups) > keep:
            for th, o, vals in b.groups.pop(0):
                b.sh.pend[o.ravel()] -= 1
                b.sh.pending -= 1
                b.sh.check_write(th, o)
                b.sh.commit(th, o, vals)
        return
    th = np.nonzero(mask)[0]
    if len(th) == 0:
        return
    dst = b.addr(inst.ops[0])[th]
    src = b.addr(inst.ops[1])[th]
    csize = int(inst.ops[2].value)
    nbytes = b.get(inst.ops[3], "u32")[th].astype(np.int64) if len(inst.ops) > 3 else np.full(len(th), csize)
    if (nbytes > csize).any() or (nbytes < 0).any():
        raise EmuError("cp.async src-size outside [0, cp-size]")
    if (src % csize).any():
        raise EmuError("misaligned cp.async source")
    o = b.sh.offsets(dst, csize, csize)
    b.sh.check_write(th, o)
    vals = np.zeros((len(th), csize), np.uint8)
    for n in np.unique(nbytes):
        if n == 0:
            continue
        sel = nbytes == n
        vals[sel, :n] = b.mem.read(src[sel], int(n), b.gtid[th[sel]], b.blk, b.sh.epoch)
    b.sh.pend[o.ravel()] += 1
    b.sh.pending += 1
    b.cur_group.append((th, o, vals))


def _h_ldmatrix(b, inst, mask):
    _check_warp_members(b, mask, 0xFFFFFFFF, inst)
    num = next(int(p[1:]) for p in inst.parts if p in ("x1", "x2", "x4"))
    trans = "trans" in inst.parts
    regs = inst.ops[0].items if inst.ops[0].kind == "vec" else [inst.ops[0]]
    th = np.nonzero(mask)[0]
    a = b.addr(inst.ops[1])
    nw = b.nt // 32
    # lanes 8j..8j+7 supply the row addresses of matrix j
    rows = np.zeros((nw, 32, 8), np.uint16)
    sup = th[(th & 31) < 8 * num]
    rows_data = b.sh.read(sup, a[sup], 16, 16).view(np.uint16).reshape(len(sup), 8)
    rows[sup >> 5, sup & 31] = rows_data
    t = th
    w, l = t >> 5, t & 31
    for j, r in enumerate(regs):
        if not trans:
            lo = rows[w, 8 * j + (l >> 2), 2 * (l & 3)]
            hi = rows[w, 8 * j + (l >> 2), 2 * (l & 3) + 1]
        else:
            lo = rows[w, 8 * j + 2 * (l & 3), l >> 2]
            hi = rows[w, 8 * j + 2 * (l & 3) + 1, l >> 2]
        full = np.zeros(b.nt, np.uint64)
        full[t] = lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(16))
        b.set(r, "b32", full, mask)


def _h_mma(b, inst, mask):
    _check_warp_members(b, mask, 0xFFFFFFFF, inst)
    p = inst.parts
    # mma.sync.aligned.m16n8k16.row.col.<D type>.<A type>.<B type>.<C type>
    if ("m16n8k16" not in p or p[-3] not in ("f16", "bf16") or p[-2] != p[-3]
            or p[-1] != "f32" or p[-4] != "f32" or p[-6:-4] != ["row", "col"]):
        raise EmuError(f"unsupported mma shape/types {inst.op}")
    ty = p[-3]
    d, ar, br, cr = (o.items for o in inst.ops)
    # Every executing warp has all 32 lanes (checked above), so whole warps are laid out
    # as (warp, g, q) with lane = 4 g + q; a block's partial last warp cannot execute.
    nw = b.nt // 32
    n = 32 * nw

    def halves(regs):
        """b32 registers -> float64 [register, half (low first), warp, g, q]."""
        words = np.stack([b.get(r, "b32")[:n] for r in regs])
        bits = np.stack([words & 0xFFFF, words >> 16], axis=1).astype(np.uint16)
        f = bits.view(np.float16) if ty == "f16" else bf16_bits_to_f32(bits)
        return f.astype(np.float64).reshape(len(regs), 2, nw, 8, 4)

    # Fragment layouts (PTX ISA, mma.m16n8k16): A element 4 c + 2 r + e of lane (g, q)
    # (register 2 c + r, half e) is A[8 r + g][8 c + 2 q + e]; B element 2 k + e (register
    # k) is B[8 k + 2 q + e][g]; C and D element 2 r + e is C[8 r + g][2 q + e].
    A = halves(ar).reshape(2, 2, 2, nw, 8, 4).transpose(3, 1, 4, 0, 5, 2).reshape(nw, 16, 16)
    B = halves(br).transpose(2, 0, 4, 1, 3).reshape(nw, 16, 8)
    C = (np.stack([b.get(r, "f32")[:n] for r in cr]).astype(np.float64)
         .reshape(2, 2, nw, 8, 4).transpose(2, 0, 3, 4, 1).reshape(nw, 16, 8))
    D = np.einsum("wik,wkj->wij", np.ascontiguousarray(A), np.ascontiguousarray(B)) + C
    out = D.reshape(nw, 2, 8, 4, 2).transpose(1, 4, 0, 2, 3).reshape(4, n).astype(np.float32)
    for i, r in enumerate(d):
        full = np.zeros(b.nt, np.float32)
        full[:n] = out[i]
        b.set(r, "f32", full, mask)


_HANDLERS = {
    "mov": _h_mov, "cvta": _h_cvta, "cvt": _h_cvt,
    "add": _h_arith, "sub": _h_arith, "mul": _h_arith, "div": _h_arith, "rem": _h_arith,
    "min": _h_arith, "max": _h_arith, "copysign": _h_arith,
    "and": _h_logic, "or": _h_logic, "xor": _h_logic, "not": _h_logic, "cnot": _h_arith,
    "shl": _h_arith, "shr": _h_arith, "popc": _h_arith, "clz": _h_arith, "brev": _h_arith,
    "neg": _h_unary_float, "abs": _h_unary_float,
    "mad": _h_mad, "fma": _h_fma,
    "rcp": _h_unary_float, "sqrt": _h_unary_float, "rsqrt": _h_unary_float, "ex2": _h_unary_float,
    "lg2": _h_unary_float, "tanh": _h_unary_float, "sin": _h_unary_float, "cos": _h_unary_float,
    "setp": _h_setp, "selp": _h_selp, "testp": _h_testp,
    "ld": _h_ld, "st": _h_st, "atom": _h_atom, "red": _h_atom,
    "bar": _h_bar, "barrier": _h_bar, "membar": _h_nop, "fence": _h_nop,
    "shfl": _h_shfl, "vote": _h_vote, "cp": _h_cp, "ldmatrix": _h_ldmatrix, "mma": _h_mma,
}
