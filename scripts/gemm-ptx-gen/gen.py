#!/usr/bin/env python3
"""Generates ptx/gemm.ptx: the nine GEMM entries gemm_{f32,f16,bf16}_{nn,nt,tn}.

The PTX is written by hand, once per piece, in this file (f32 SIMT entries, the
file header) and in tc.py (f16 / bf16 tensor-core entries).  Only the operand
staging differs between the transposes, and only the mma type suffix between f16
and bf16, so each piece is stamped once per entry with Python f-strings; the
output is plain, commented PTX.  The algorithms, shared-memory layouts and the
fragment maps are described in the header comment of the generated file (the
HEADER string below).

Regenerate after editing gen.py or tc.py (from the repository root):

    python3 scripts/gemm-ptx-gen/gen.py -o ptx/gemm.ptx
    scripts/check-ptx                      # ptxas sm_80 / sm_90, no spills
    scripts/check-ptx-emu                  # emulated correctness checks

scripts/gemm-ptx-gen/check-gemm-ptx regenerates into a temporary file and fails
when it differs from the committed ptx/gemm.ptx, so the two cannot drift apart.
Without -o the PTX goes to standard output.  Only the Python standard library is
needed.
"""
import argparse
import os
import sys

sys.dont_write_bytecode = True  # keep the source tree free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tc  # noqa: E402  (the tensor-core entries; lives next to this file)

OUT = []  # lines of the generated file


def emit(s=""):
    """Appends one line (or several, joined by newlines) to the output."""
    OUT.append(s)


HEADER = r"""//
// gemm.ptx -- dense matrix products for ringtrain.
//
//   C = alpha * op(A) . op(B) + beta * C
//
// All matrices are row-major. C is f32 [m, n] with row stride ldc.
//   *_nn : A stored [m, k] (lda >= k), B stored [k, n] (ldb >= n)
//   *_nt : A stored [m, k] (lda >= k), B stored [n, k] (ldb >= k)   -> A . B^T
//   *_tn : A stored [k, m] (lda >= m), B stored [k, n] (ldb >= n)   -> A^T . B
// Parameters (every entry): a, b, c (.u64 pointers), m, n, k, lda, ldb, ldc
// (.u32), alpha, beta (.f32). When beta == 0, C is never read (it may hold NaN).
// m, n >= 1 (zero-size problems are not launched).  k >= 1 is the normal case;
// a launch with k == 0 is also well defined: A and B are not read and every
// entry writes C = beta * C (C = 0 when beta == 0, still without reading C),
// because the K loop runs once over an all-zero slice.
//
// Block scheduling (all entries).  The grid is (ceil(n / T), ceil(m / T), 1)
// with T the tile edge.  The linear block id  pid = ctaid.y * nctaid.x +
// ctaid.x  is re-mapped to a tile (tile_m, tile_n) in groups of 8 tile rows:
//     group   = pid / (8 * nctaid.x)
//     first_m = 8 * group
//     gsize   = min(nctaid.y - first_m, 8)
//     r       = pid - group * 8 * nctaid.x
//     tile_m  = first_m + r % gsize,   tile_n = r / gsize
// so blocks that run at the same time share A rows and B columns in L2.  The
// map is a bijection on the grid: each group holds gsize * nctaid.x ids and
// r / gsize < nctaid.x.
//
// ---------------------------------------------------------------------------
// f32 SIMT entries: gemm_f32_{nn,nt,tn}
//   block 256 threads, 64 x 64 tile of C, K staged in slices of 16.
//   Shared memory (17408 bytes), two buffers per operand, f32 elements:
//     As[buf][kk][mm] at  buf * 4352 + kk * 272 + mm * 4           (kk < 16, mm < 64)
//     Bs[buf][kk][nn] at  8704 + buf * 4352 + kk * 272 + nn * 4    (nn < 64)
//   (row pitch 68 floats = 272 bytes: 16-byte aligned rows, and the
//   transposing stores below are free of bank conflicts.)
//   Thread t computes the 4 x 4 micro-tile rows 4*ty .. 4*ty+3, columns
//   4*tx .. 4*tx+3 of the block tile, tx = t & 15, ty = t >> 4; per kk it reads
//   As[kk][4ty..4ty+3] and Bs[kk][4tx..4tx+3] with two ld.shared.v4 and does 16
//   FMAs.  A warp reads 2 distinct A vectors (broadcast) and 256 contiguous
//   bytes of B.
//   Each slice is fetched from global memory into registers (4 values of A and
//   4 of B per thread) while the previous slice is computed from shared memory,
//   then stored to the other buffer; one bar.sync per slice.
//   Two staging patterns, chosen per operand by its storage:
//    * "k-rows" (operand stored with k as its row index: A of tn, B of nn/tn):
//        thread t loads row kk = t >> 4, columns cc .. cc+3 with cc = 4*(t & 15)
//        of the slice and stores them with one st.shared.v4 at [kk][cc].
//    * "k-columns" (operand stored [rows, k]: A of nn/nt, B of nt):
//        w = t >> 5, l = t & 31, row r = (l & 15) + 16*(w & 3),
//        k-quad q = (l >> 4) + 2*(w >> 2); thread t loads elements k = 4q .. 4q+3
//        of row r and stores them to [4q+e][r].  Within a warp the 32 stores of
//        one e hit banks (16*q + r + 4e) mod 32: all distinct.
//   Out-of-range elements (row >= m/n, k >= K) are loaded as 0, so the edge
//   slices need no special compute path.  Stores to C are predicated per
//   element; a row of four goes out as one st.global.v4 when ldc % 4 == 0,
//   c is 16-byte aligned and all four columns are in range.
//
// ---------------------------------------------------------------------------
// f16 / bf16 tensor-core entries: gemm_{f16,bf16}_{nn,nt,tn}
//   block 256 threads = 8 warps, 128 x 128 tile of C, K staged in slices of 32
//   through a 3-stage cp.async pipeline.
//   Requirements (checked by the launcher): lda % 8 == 0, ldb % 8 == 0, a and b
//   16-byte aligned (so every 8-element chunk of a row is one aligned 16-byte
//   copy).  Any m, n, k >= 1 works: partial chunks at the m/n/k edges are
//   copied with cp.async src-size < 16, which zero-fills the rest (so k need
//   not be a multiple of 8; only the leading dimensions and pointers must be).
//   Shared memory: 3 stages x 16384 bytes = 49152 bytes (static).  Stage s:
//     A slice at s*16384, B slice at s*16384 + 8192, each 4096 16-bit elements.
//   A slice is kept in one of two layouts (chunk = 8 elements = 16 bytes):
//    * "K-major" (operand stored [rows, k]: A of nn/nt, B of nt):
//        128 rows x 4 chunks, row pitch 64 bytes; logical chunk c of row r is
//        at  r*64 + ((c ^ ((r >> 1) & 3)) << 4).
//    * "MN-major" (operand stored [k, cols]: A of tn, B of nn):
//        32 k-rows x 16 chunks, row pitch 256 bytes; logical chunk c of k-row r
//        is at  r*256 + ((c ^ (r & 7)) << 4).
//   The XOR swizzles make every ldmatrix phase (8 row addresses with the same
//   logical chunk, rows 8-aligned) touch 8 distinct 16-byte bank groups.
//   Copies: thread t moves 2 chunks of A and 2 of B per slice:
//    * K-major:  row r = (t >> 2) + 64*i, chunk c = t & 3       (i = 0, 1)
//    * MN-major: k-row r = (t >> 4) + 16*i, chunk c = t & 15    (i = 0, 1)
//   (i = 1 lands 4096 bytes after i = 0 in both layouts: the swizzle term
//   depends only on r mod 8.)
//   Warps: w = t >> 5, wm = w >> 2 (0..1), wn = w & 3 (0..3); warp w computes the
//   64 x 32 sub-tile rows 64*wm .., columns 32*wn .. as 4 x 4 mma tiles of
//   16 x 8: acc[i][j][e], i = m-tile, j = n-tile, e = 0..3.
//   mma.m16n8k16 fragments (g = lane >> 2, q = lane & 3; low half of a .b32 is
//   the lower-index element):
//     A (16 x 16, row):  a0 = (g, 2q..2q+1)     a1 = (g+8, 2q..2q+1)
//                        a2 = (g, 2q+8..2q+9)   a3 = (g+8, 2q+8..2q+9)
//     B (16 x 8, col):   b0 = (k 2q..2q+1, n g) b1 = (k 2q+8..2q+9, n g)
//     C (16 x 8, f32):   c0, c1 = (g, 2q), (g, 2q+1); c2, c3 = (g+8, 2q), (g+8, 2q+1)
//   ldmatrix.x4: lane l supplies the address of row (l & 7) of 8x8 matrix l >> 3;
//   register j receives from matrix j the pair (row l >> 2, cols 2(l&3), +1), or
//   with .trans the pair (rows 2(l&3), +1; col l >> 2).  Hence:
//    * A, K-major (no .trans): matrix j = (m-half j & 1, k-half j >> 1), lane l
//      addresses m-row (l & 15), chunk 2*ks + (l >> 4); registers = a0..a3.
//    * A, MN-major (.trans): matrix j = (m-half j & 1, k-half j >> 1), lane l
//      addresses k-row 16*ks + 8*(l >> 4) + (l & 7), m-chunk 2*i + ((l >> 3) & 1);
//      the transposed pair is (m g, k 2q..2q+1) = a0..a3.
//    * B, K-major (no .trans): matrix j = (n-tile 2p + (j >> 1), k-half j & 1),
//      lane l addresses n-row 16*p + 8*(l >> 4) + (l & 7), chunk 2*ks + ((l >> 3) & 1);
//      registers = b0, b1 of n-tile 2p, then b0, b1 of n-tile 2p+1.
//    * B, MN-major (.trans): same matrix order, lane l addresses k-row
//      16*ks + 8*((l >> 3) & 1) + (l & 7), n-chunk 4*wn + 2*p + (l >> 4).
//   Pipeline (one bar.sync per slice):
//     copy slice 0 -> stage 0, commit; copy slice 1 -> stage 1, commit
//     for kt in 0 .. KT-1:
//       cp.async.wait_group 1; bar.sync       // slice kt landed for every thread;
//                                             // everyone is done with slice kt-1
//       copy slice kt+2 -> stage (kt+2) % 3, commit   // the stage of slice kt-1
//       2 x (ldmatrix A, B; 16 mma) on stage kt % 3
//   Slices past the end are "copied" with src-size 0 (zero fill, no read).
//   Epilogue: element e of acc[i][j] belongs to row 64wm + 16i + g + 8(e >> 1),
//   column 32wn + 8j + 2q + (e & 1); pairs go out as st.global.v2 when ldc is
//   even, c is 8-byte aligned and both columns are in range, else per element.
//
"""


def grouped_tile(tile):
    """PTX computing %m0, %n0 (first row / column of the block tile)."""
    return f"""\
    // ---- grouped tile order (see file header) ----
    mov.u32         %gx, %nctaid.x;
    mov.u32         %gy, %nctaid.y;
    mov.u32         %t0, %ctaid.y;
    mov.u32         %t1, %ctaid.x;
    mad.lo.u32      %pid, %t0, %gx, %t1;
    shl.b32         %t2, %gx, 3;                // ids per group of 8 tile rows
    div.u32         %t3, %pid, %t2;             // group
    mul.lo.u32      %t4, %t3, %t2;
    sub.u32         %t5, %pid, %t4;             // r = id inside the group
    shl.b32         %t3, %t3, 3;                // first_m
    sub.u32         %t6, %gy, %t3;
    min.u32         %t6, %t6, 8;                // gsize
    rem.u32         %t7, %t5, %t6;
    add.u32         %t7, %t7, %t3;              // tile_m
    div.u32         %t8, %t5, %t6;              // tile_n
    mul.lo.u32      %m0, %t7, {tile};
    mul.lo.u32      %n0, %t8, {tile};
"""


# Parameter order shared by every entry (see /work/plan/GEMM_PTX.md); pointers
# are .u64, sizes .u32, alpha and beta .f32.
PARAMS = ["a", "b", "c", "m", "n", "k", "lda", "ldb", "ldc", "alpha", "beta"]
PTYPES = {"a": "u64", "b": "u64", "c": "u64", "alpha": "f32", "beta": "f32"}


def entry_open(name, extra_directives):
    """Emits the .entry line, its parameter list, directives and the opening brace."""
    emit(f".visible .entry {name}(")
    lines = []
    for p in PARAMS:
        lines.append(f"    .param .{PTYPES.get(p, 'u32')} {name}_{p}")
    emit(",\n".join(lines))
    emit(")")
    for d in extra_directives:
        emit(d)
    emit("{")


def load_params(name):
    """PTX loading every parameter into %pa .. %beta and the global pointers %ga, %gb, %gc."""
    return f"""\
    ld.param.u64    %pa, [{name}_a];
    ld.param.u64    %pb, [{name}_b];
    ld.param.u64    %pc, [{name}_c];
    ld.param.u32    %M, [{name}_m];
    ld.param.u32    %N, [{name}_n];
    ld.param.u32    %K, [{name}_k];
    ld.param.u32    %lda, [{name}_lda];
    ld.param.u32    %ldb, [{name}_ldb];
    ld.param.u32    %ldc, [{name}_ldc];
    ld.param.f32    %alpha, [{name}_alpha];
    ld.param.f32    %beta, [{name}_beta];
    cvta.to.global.u64 %ga, %pa;
    cvta.to.global.u64 %gb, %pb;
    cvta.to.global.u64 %gc, %pc;
    mov.u32         %thr, %tid.x;
"""


# ===========================================================================
# f32 SIMT
# ===========================================================================

def f32_stage_setup(X, kind, g, ld, dim, first):
    """Per-thread staging state for operand X ('A' or 'B').

    kind 'krows': X stored with k as row index, slice = 16 k-rows x 64 columns.
    kind 'kcols': X stored [rows, k], slice = 64 rows x 16 k-columns.
    g: global base, ld: leading dim, dim: extent of the non-k dimension,
    first: first row/column of the block tile in that dimension.
    Defines %{X}ptr (u64), %{X}soff (u32 shared byte offset inside a buffer),
    and validity state.
    """
    if kind == "krows":
        return f"""\
    // {X}: k-rows staging. kk = t >> 4, columns cc .. cc+3, cc = 4 * (t & 15)
    shr.u32         %t0, %thr, 4;               // kk
    and.b32         %t1, %thr, 15;
    shl.b32         %t1, %t1, 2;                // cc
    add.u32         %t2, %{first}, %t1;          // global column of element 0
    mul.wide.u32    %d0, %t0, %{ld};
    cvt.u64.u32     %d1, %t2;
    add.u64         %d0, %d0, %d1;
    shl.b64         %d0, %d0, 2;
    add.u64         %{X}ptr, %{g}, %d0;          // &X[kk][first + cc]
    setp.lt.u32     %{X}c0, %t2, %{dim};         // column validity, per element
    add.u32         %t3, %t2, 1;
    setp.lt.u32     %{X}c1, %t3, %{dim};
    add.u32         %t3, %t2, 2;
    setp.lt.u32     %{X}c2, %t3, %{dim};
    add.u32         %t3, %t2, 3;
    setp.lt.u32     %{X}c3, %t3, %{dim};
    sub.s32         %{X}left, %K, %t0;           // > 0 while row k0 + kk < K
    mul.wide.u32    %{X}step, %{ld}, 64;         // 16 rows, in bytes
    mul.lo.u32      %t3, %t0, 272;
    shl.b32         %t4, %t1, 2;
    add.u32         %{X}soff, %t3, %t4;          // [kk][cc]
"""
    return f"""\
    // {X}: k-columns staging. r = (l & 15) + 16 (w & 3), q = (l >> 4) + 2 (w >> 2)
    and.b32         %t0, %thr, 15;
    shr.u32         %t1, %thr, 5;
    and.b32         %t2, %t1, 3;
    shl.b32         %t2, %t2, 4;
    add.u32         %t0, %t0, %t2;              // r
    shr.u32         %t3, %thr, 4;
    and.b32         %t3, %t3, 1;
    shr.u32         %t1, %t1, 2;
    shl.b32         %t1, %t1, 1;
    add.u32         %t3, %t3, %t1;              // q
    shl.b32         %t3, %t3, 2;                // 4q = first k of the quad
    add.u32         %t4, %{first}, %t0;          // global row
    setp.lt.u32     %{X}rowok, %t4, %{dim};
    mul.wide.u32    %d0, %t4, %{ld};
    cvt.u64.u32     %d1, %t3;
    add.u64         %d0, %d0, %d1;
    shl.b64         %d0, %d0, 2;
    add.u64         %{X}ptr, %{g}, %d0;          // &X[row][4q]
    sub.s32         %{X}left, %K, %t3;           // element e valid while left - k0 > e
    mul.lo.u32      %t5, %t3, 272;
    shl.b32         %t6, %t0, 2;
    add.u32         %{X}soff, %t5, %t6;          // [4q][r]
"""


def f32_fetch(X, kind):
    """Global -> registers %{X}v0..3 for the next slice; advances the state."""
    if kind == "krows":
        s = f"""\
    setp.gt.s32     %prow, %{X}left, 0;
"""
        for e in range(4):
            s += f"""\
    mov.f32         %{X}v{e}, 0f00000000;
    and.pred        %pe, %prow, %{X}c{e};
    @%pe ld.global.nc.f32 %{X}v{e}, [%{X}ptr+{4 * e}];
"""
        s += f"""\
    add.u64         %{X}ptr, %{X}ptr, %{X}step;
    sub.s32         %{X}left, %{X}left, 16;
"""
        return s
    s = ""
    for e in range(4):
        s += f"""\
    mov.f32         %{X}v{e}, 0f00000000;
    setp.gt.s32     %pe, %{X}left, {e};
    and.pred        %pe, %pe, %{X}rowok;
    @%pe ld.global.nc.f32 %{X}v{e}, [%{X}ptr+{4 * e}];
"""
    s += f"""\
    add.u64         %{X}ptr, %{X}ptr, 64;
    sub.s32         %{X}left, %{X}left, 16;
"""
    return s


def f32_store(X, kind, bufreg):
    """Registers -> shared buffer whose base address is in %{bufreg}."""
    s = f"""\
    add.u32         %t0, %{bufreg}, %{X}soff;
"""
    if kind == "krows":
        s += f"""\
    st.shared.v4.f32 [%t0], {{%{X}v0, %{X}v1, %{X}v2, %{X}v3}};
"""
    else:
        for e in range(4):
            s += f"""\
    st.shared.f32   [%t0+{272 * e}], %{X}v{e};
"""
    return s


def f32_entry(variant):
    """Emits gemm_f32_<variant> (variant: nn, nt or tn)."""
    name = f"gemm_f32_{variant}"
    akind = "krows" if variant == "tn" else "kcols"
    bkind = "kcols" if variant == "nt" else "krows"
    desc = {
        "nn": "A [m,k] (k-columns staging), B [k,n] (k-rows staging)",
        "nt": "A [m,k] (k-columns staging), B [n,k] (k-columns staging)",
        "tn": "A [k,m] (k-rows staging), B [k,n] (k-rows staging)",
    }[variant]
    emit("// ===========================================================================")
    emit(f"// {name}: f32 SIMT, 64 x 64 tile per 256-thread block.")
    emit(f"//   {desc}.")
    emit("//   Grid (ceil(n/64), ceil(m/64), 1).  Algorithm: see file header.")
    emit("// ===========================================================================")
    entry_open(name, [".maxntid 256, 1, 1"])
    emit("""\
    .reg .pred      %prow, %pe, %pbz, %pvec, %pmore, %p<8>;
    .reg .pred      %Ac<4>, %Bc<4>, %Arowok, %Browok, %cc<4>, %cv;
    .reg .b32       %t<9>, %gx, %gy, %pid, %m0, %n0, %thr, %tx, %ty;
    .reg .b32       %M, %N, %K, %lda, %ldb, %ldc, %kt, %KT;
    .reg .b32       %Asoff, %Bsoff, %Aleft, %Bleft;
    .reg .b32       %sbase, %cur, %nxt, %sa, %sb, %row, %col;
    .reg .b64       %pa, %pb, %pc, %ga, %gb, %gc, %d<4>;
    .reg .b64       %Aptr, %Bptr, %Astep, %Bstep, %cptr, %cstep;
    .reg .f32       %alpha, %beta, %Av<4>, %Bv<4>, %a<4>, %b<4>, %o<4>, %acc<16>;
    .shared .align 16 .b8 %s_smem[17408];
""".replace("%s_smem", f"{name}_smem"))
    emit(load_params(name))
    emit(grouped_tile(64))
    # A: rows = m; B: columns = n.
    emit(f32_stage_setup("A", akind, "ga", "lda", "M", "m0"))
    emit(f32_stage_setup("B", bkind, "gb", "ldb", "N", "n0"))
    emit(f"""\
    // ---- compute mapping: tx = t & 15 (columns 4tx..), ty = t >> 4 (rows 4ty..)
    and.b32         %tx, %thr, 15;
    shr.u32         %ty, %thr, 4;
    mov.u32         %sbase, {name}_smem;
    add.u32         %KT, %K, 15;
    shr.u32         %KT, %KT, 4;                // number of 16-wide k slices""")
    for i in range(16):
        emit(f"    mov.f32         %acc{i}, 0f00000000;")
    emit("""\
    // ---- slice 0 -> buffer 0
""")
    emit(f32_fetch("A", akind))
    emit(f32_fetch("B", bkind))
    emit("    mov.u32         %cur, 0;                    // byte offset of the buffer being computed")
    emit("    add.u32         %t7, %sbase, 0;")
    emit(f32_store("A", akind, "t7"))
    emit("    add.u32         %t7, %sbase, 8704;")
    emit(f32_store("B", bkind, "t7"))
    emit("""\
    bar.sync        0;
    mov.u32         %kt, 0;
F32_LOOP_%V:
    // fetch slice kt+1 into registers (all-zero past the end of K)
""".replace("%V", variant))
    emit(f32_fetch("A", akind))
    emit(f32_fetch("B", bkind))
    emit("""\
    // compute slice kt from buffer %cur
    add.u32         %t8, %sbase, %cur;
    shl.b32         %t7, %ty, 4;
    add.u32         %sa, %t8, %t7;              // &As[cur][0][4ty]
    shl.b32         %t7, %tx, 4;
    add.u32         %sb, %t8, %t7;
    add.u32         %sb, %sb, 8704;             // &Bs[cur][0][4tx]""")
    for kk in range(16):
        emit(f"    ld.shared.v4.f32 {{%a0, %a1, %a2, %a3}}, [%sa+{272 * kk}];")
        emit(f"    ld.shared.v4.f32 {{%b0, %b1, %b2, %b3}}, [%sb+{272 * kk}];")
        for i in range(4):
            for j in range(4):
                emit(f"    fma.rn.f32      %acc{4 * i + j}, %a{i}, %b{j}, %acc{4 * i + j};")
    emit("""\
    // store slice kt+1 to the other buffer; a single barrier per slice suffices:
    // the other buffer was last read in iteration kt-1, before the last barrier.
    sub.u32         %nxt, 4352, %cur;
    add.u32         %t7, %sbase, %nxt;""")
    emit(f32_store("A", akind, "t7"))
    emit("    add.u32         %t7, %t7, 8704;")
    emit(f32_store("B", bkind, "t7"))
    emit(f"""\
    bar.sync        0;
    mov.u32         %cur, %nxt;
    add.u32         %kt, %kt, 1;
    setp.lt.u32     %pmore, %kt, %KT;
    @%pmore bra     F32_LOOP_{variant};

    // ---- epilogue: rows m0 + 4ty + i, columns n0 + 4tx + j
    shl.b32         %t0, %ty, 2;
    add.u32         %row, %m0, %t0;
    shl.b32         %t1, %tx, 2;
    add.u32         %col, %n0, %t1;
    setp.lt.u32     %cc0, %col, %N;
    add.u32         %t2, %col, 1;
    setp.lt.u32     %cc1, %t2, %N;
    add.u32         %t2, %col, 2;
    setp.lt.u32     %cc2, %t2, %N;
    add.u32         %t2, %col, 3;
    setp.lt.u32     %cc3, %t2, %N;
    // vector path: ldc % 4 == 0, c 16-byte aligned, all 4 columns in range
    and.b32         %t3, %ldc, 3;
    cvt.u32.u64     %t4, %gc;
    and.b32         %t4, %t4, 15;
    or.b32          %t3, %t3, %t4;
    setp.eq.u32     %cv, %t3, 0;
    and.pred        %cv, %cv, %cc3;
    mul.wide.u32    %d0, %row, %ldc;
    cvt.u64.u32     %d1, %col;
    add.u64         %d0, %d0, %d1;
    shl.b64         %d0, %d0, 2;
    add.u64         %cptr, %gc, %d0;            // &C[row][col]
    mul.wide.u32    %cstep, %ldc, 4;            // one row, in bytes
    setp.eq.f32     %pbz, %beta, 0f00000000;""")
    for i in range(4):
        emit(f"    // row 4ty + {i}")
        emit(f"    add.u32         %t5, %row, {i};")
        emit("    setp.lt.u32     %prow, %t5, %M;")
        emit("    and.pred        %pvec, %prow, %cv;")
        emit("    not.pred        %p4, %cv;")
        emit("    and.pred        %p5, %prow, %p4;            // scalar path")
        for j in range(4):
            emit(f"    and.pred        %p{j}, %p5, %cc{j};")
            emit(f"    mul.f32         %o{j}, %acc{4 * i + j}, %alpha;")
        emit(f"    @%pbz bra       F32_ST_{variant}_{i};")
        emit("    // beta != 0: read C")
        emit("    mov.f32         %a0, 0f00000000;")
        emit("    mov.f32         %a1, 0f00000000;")
        emit("    mov.f32         %a2, 0f00000000;")
        emit("    mov.f32         %a3, 0f00000000;")
        emit("    @%pvec ld.global.v4.f32 {%a0, %a1, %a2, %a3}, [%cptr];")
        for j in range(4):
            emit(f"    @%p{j} ld.global.f32 %a{j}, [%cptr+{4 * j}];")
        for j in range(4):
            emit(f"    fma.rn.f32      %o{j}, %a{j}, %beta, %o{j};")
        emit(f"F32_ST_{variant}_{i}:")
        emit("    @%pvec st.global.v4.f32 [%cptr], {%o0, %o1, %o2, %o3};")
        for j in range(4):
            emit(f"    @%p{j} st.global.f32 [%cptr+{4 * j}], %o{j};")
        emit("    add.u64         %cptr, %cptr, %cstep;")
    emit("    ret;")
    emit("}")
    emit()


def generate():
    """Returns the full text of gemm.ptx."""
    OUT.clear()
    emit(HEADER)
    emit(".version 8.0")
    emit(".target sm_80")
    emit(".address_size 64")
    emit()
    for v in ("nn", "nt", "tn"):
        f32_entry(v)
    tc.emit_all(emit, entry_open, load_params, grouped_tile)
    return "\n".join(OUT) + "\n"


def main():
    ap = argparse.ArgumentParser(description="Generate ptx/gemm.ptx.")
    ap.add_argument("-o", "--output", help="write here instead of standard output")
    args = ap.parse_args()
    text = generate()
    if args.output:
        with open(args.output, "w", encoding="ascii", newline="\n") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
