"""Tensor-core (f16 / bf16) entries of gemm.ptx, stamped by gen.py.

The algorithm (3-stage cp.async pipeline, swizzled shared layouts, ldmatrix and
mma.sync m16n8k16 fragment maps) is described in the header comment of the
generated file (gen.py's HEADER).
"""

# .minnctapersm: blocks per SM the register allocation must allow (caps registers at 128).
MIN_CTAS = 2


def acc(i, j, e):
    """Accumulator register: m-tile i, n-tile j, fragment element e."""
    return f"%acc{(i * 4 + j) * 4 + e}"


def fa(i, r):
    """A-fragment register r (0..3) of m-tile i."""
    return f"%fa{i * 4 + r}"


def fb(j, r):
    """B-fragment register r (0..1) of n-tile j."""
    return f"%fb{j * 2 + r}"


def copy_setup(X, kind, g, ld, dim, first, smem_add):
    """Per-thread cp.async state of operand X; shared offsets are relative to a stage."""
    if kind == "kmajor":
        return f"""\
    // {X}: K-major slice (128 rows x 4 chunks). chunk c = t & 3 of rows r = t >> 2 and r + 64
    shr.u32         %t0, %thr, 2;               // r
    and.b32         %t1, %thr, 3;               // c
    add.u32         %t2, %{first}, %t0;          // global row of chunk 0
    shl.b32         %t3, %t1, 3;                // 8c = first k of the chunk
    mul.wide.u32    %d0, %t2, %{ld};
    cvt.u64.u32     %d1, %t3;
    add.u64         %d0, %d0, %d1;
    shl.b64         %d0, %d0, 1;
    add.u64         %{X}p0, %{g}, %d0;           // &X[row][8c]
    mul.wide.u32    %d2, %{ld}, 128;             // 64 rows, in bytes
    add.u64         %{X}p1, %{X}p0, %d2;         // &X[row + 64][8c]
    // k elements left in the chunk (0 when its row is out of range)
    sub.s32         %t4, %K, %t3;
    setp.lt.u32     %pe, %t2, %{dim};
    selp.b32        %{X}l0, %t4, 0, %pe;
    add.u32         %t5, %t2, 64;
    setp.lt.u32     %pe, %t5, %{dim};
    selp.b32        %{X}l1, %t4, 0, %pe;
    // shared offset: r*64 + ((c ^ ((r >> 1) & 3)) << 4)
    shr.u32         %t6, %t0, 1;
    and.b32         %t6, %t6, 3;
    xor.b32         %t6, %t6, %t1;
    shl.b32         %t6, %t6, 4;
    shl.b32         %t7, %t0, 6;
    add.u32         %t7, %t7, %t6;
    add.u32         %{X}soff, %t7, {smem_add};
"""
    return f"""\
    // {X}: MN-major slice (32 k-rows x 16 chunks). chunk c = t & 15 of k-rows r = t >> 4 and r + 16
    shr.u32         %t0, %thr, 4;               // r
    and.b32         %t1, %thr, 15;              // c
    shl.b32         %t3, %t1, 3;
    add.u32         %t2, %{first}, %t3;          // global column of the chunk
    mul.wide.u32    %d0, %t0, %{ld};
    cvt.u64.u32     %d1, %t2;
    add.u64         %d0, %d0, %d1;
    shl.b64         %d0, %d0, 1;
    add.u64         %{X}p0, %{g}, %d0;           // &X[r][col]
    mul.wide.u32    %d2, %{ld}, 32;              // 16 rows, in bytes
    add.u64         %{X}p1, %{X}p0, %d2;         // &X[r + 16][col]
    mul.wide.u32    %{X}step, %{ld}, 64;         // 32 rows, in bytes
    // bytes of the chunk inside the matrix: clamp(dim - col, 0, 8) * 2
    sub.s32         %t4, %{dim}, %t2;
    max.s32         %t4, %t4, 0;
    min.s32         %t4, %t4, 8;
    shl.b32         %{X}cb, %t4, 1;
    // k-rows left below each chunk row: valid while > 0
    sub.s32         %{X}l0, %K, %t0;
    sub.s32         %{X}l1, %{X}l0, 16;
    // shared offset: r*256 + ((c ^ (r & 7)) << 4)
    and.b32         %t5, %t0, 7;
    xor.b32         %t5, %t5, %t1;
    shl.b32         %t5, %t5, 4;
    shl.b32         %t6, %t0, 8;
    add.u32         %t6, %t6, %t5;
    add.u32         %{X}soff, %t6, {smem_add};
"""


def copy_slice(X, kind):
    """cp.async of one K slice of X into the stage at %sld; advances the state."""
    s = f"""\
    add.u32         %t1, %sld, %{X}soff;
"""
    for i in range(2):
        if kind == "kmajor":
            s += f"""\
    max.s32         %t0, %{X}l{i}, 0;
    min.s32         %t0, %t0, 8;
    shl.b32         %t0, %t0, 1;                // bytes to read (rest zero-filled)
    setp.ne.u32     %pe, %t0, 0;
    selp.b64        %d0, %{X}p{i}, %ga, %pe;     // never read when bytes == 0
    cp.async.cg.shared.global [%t1+{4096 * i}], [%d0], 16, %t0;
    add.u64         %{X}p{i}, %{X}p{i}, 64;
    sub.s32         %{X}l{i}, %{X}l{i}, 32;
"""
        else:
            s += f"""\
    setp.gt.s32     %pe, %{X}l{i}, 0;
    selp.b32        %t0, %{X}cb, 0, %pe;         // bytes to read (rest zero-filled)
    setp.ne.u32     %pe, %t0, 0;
    selp.b64        %d0, %{X}p{i}, %ga, %pe;     // never read when bytes == 0
    cp.async.cg.shared.global [%t1+{4096 * i}], [%d0], 16, %t0;
    add.u64         %{X}p{i}, %{X}p{i}, %{X}step;
    sub.s32         %{X}l{i}, %{X}l{i}, 32;
"""
    return s


# Lane-derived terms shared by the ldmatrix address computations.
FRAG_SETUP_COMMON = """\
    // ---- ldmatrix lane offsets (relative to a stage); l = lane
    and.b32         %x7, %lane, 7;              // l & 7
    shr.u32         %xr, %lane, 1;
    and.b32         %xr, %xr, 3;                // (l >> 1) & 3
    shr.u32         %h3, %lane, 3;
    and.b32         %h3, %h3, 1;                // (l >> 3) & 1
    shr.u32         %h4, %lane, 4;              // l >> 4
"""


def frag_setup(X, kind):
    """Per-lane ldmatrix byte offsets (relative to a stage) for operand X in layout kind."""
    s = ""
    if X == "A" and kind == "kmajor":
        # Ao_ks = (64 wm + (l & 15)) * 64 + (((2 ks + h4) ^ xr) << 4)
        s += """\
    // A K-major: m-row 64wm + (l & 15), chunk 2ks + (l >> 4)
    and.b32         %t0, %lane, 15;
    shl.b32         %t1, %wm, 6;
    add.u32         %t0, %t0, %t1;
    shl.b32         %t0, %t0, 6;
"""
        for ks in range(2):
            s += f"""\
    add.u32         %t2, %h4, {2 * ks};
    xor.b32         %t2, %t2, %xr;
    shl.b32         %t2, %t2, 4;
    add.u32         %Ao{ks}, %t0, %t2;
"""
    elif X == "A":
        # Ao_i = (8 h4 + x7) * 256 + ((8 wm + ((2i + h3) ^ x7)) << 4)
        s += """\
    // A MN-major (.trans): k-row 16ks + 8(l >> 4) + (l & 7), m-chunk 8wm + 2i + ((l >> 3) & 1)
    shl.b32         %t0, %h4, 3;
    add.u32         %t0, %t0, %x7;
    shl.b32         %t0, %t0, 8;
    shl.b32         %t1, %wm, 3;
"""
        for i in range(4):
            s += f"""\
    add.u32         %t2, %h3, {2 * i};
    xor.b32         %t2, %t2, %x7;
    add.u32         %t2, %t2, %t1;
    shl.b32         %t2, %t2, 4;
    add.u32         %Ao{i}, %t0, %t2;
"""
    elif kind == "kmajor":
        # Bo_ks = 8192 + (32 wn + 8 h4 + x7) * 64 + (((2ks + h3) ^ xr) << 4)
        s += """\
    // B K-major: n-row 32wn + 16p + 8(l >> 4) + (l & 7), chunk 2ks + ((l >> 3) & 1)
    shl.b32         %t0, %wn, 5;
    shl.b32         %t1, %h4, 3;
    add.u32         %t0, %t0, %t1;
    add.u32         %t0, %t0, %x7;
    shl.b32         %t0, %t0, 6;
    add.u32         %t0, %t0, 8192;
"""
        for ks in range(2):
            s += f"""\
    add.u32         %t2, %h3, {2 * ks};
    xor.b32         %t2, %t2, %xr;
    shl.b32         %t2, %t2, 4;
    add.u32         %Bo{ks}, %t0, %t2;
"""
    else:
        # Bo_p = 8192 + (8 h3 + x7) * 256 + (((4 wn + 2p + h4) ^ x7) << 4)
        s += """\
    // B MN-major (.trans): k-row 16ks + 8((l >> 3) & 1) + (l & 7), n-chunk 4wn + 2p + (l >> 4)
    shl.b32         %t0, %h3, 3;
    add.u32         %t0, %t0, %x7;
    shl.b32         %t0, %t0, 8;
    add.u32         %t0, %t0, 8192;
    shl.b32         %t1, %wn, 2;
    add.u32         %t1, %t1, %h4;
"""
        for p in range(2):
            s += f"""\
    add.u32         %t2, %t1, {2 * p};
    xor.b32         %t2, %t2, %x7;
    shl.b32         %t2, %t2, 4;
    add.u32         %Bo{p}, %t0, %t2;
"""
    return s


def compute_stage(akind, bkind, ty):
    """Two k16 steps on the stage at %scmp."""
    s = ""
    if akind == "kmajor":
        s += """\
    add.u32         %sa0, %scmp, %Ao0;
    add.u32         %sa1, %scmp, %Ao1;
"""
    else:
        for i in range(4):
            s += f"    add.u32         %sa{i}, %scmp, %Ao{i};\n"
    s += """\
    add.u32         %sb0, %scmp, %Bo0;
    add.u32         %sb1, %scmp, %Bo1;
"""
    for ks in range(2):
        s += f"    // k16 step {ks}\n"
        for i in range(4):
            regs = ", ".join(fa(i, r) for r in range(4))
            if akind == "kmajor":
                s += f"    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{regs}}}, [%sa{ks}+{1024 * i}];\n"
            else:
                s += f"    ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{regs}}}, [%sa{i}+{4096 * ks}];\n"
        for p in range(2):
            regs = ", ".join([fb(2 * p, 0), fb(2 * p, 1), fb(2 * p + 1, 0), fb(2 * p + 1, 1)])
            if bkind == "kmajor":
                s += f"    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{regs}}}, [%sb{ks}+{1024 * p}];\n"
            else:
                s += f"    ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{regs}}}, [%sb{p}+{4096 * ks}];\n"
        for i in range(4):
            for j in range(4):
                d = ", ".join(acc(i, j, e) for e in range(4))
                a = ", ".join(fa(i, r) for r in range(4))
                b = f"{fb(j, 0)}, {fb(j, 1)}"
                s += (f"    mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
                      f"{{{d}}}, {{{a}}}, {{{b}}}, {{{d}}};\n")
    return s


def epilogue(name, with_beta):
    """Stores the 8 accumulator rows of a thread: C = alpha acc (+ beta C when with_beta)."""
    s = ""
    for srow in range(8):
        i, h = srow >> 1, srow & 1
        s += f"""\
    // row 64wm + g + {8 * srow}: acc[{i}][j][{2 * h}..{2 * h + 1}]
    setp.ge.u32     %prow, %row, %M;
    @%prow bra      {name}_DONE;              // later rows are larger still
"""
        for j in range(4):
            s += f"""\
    mul.f32         %v0, {acc(i, j, 2 * h)}, %alpha;
    mul.f32         %v1, {acc(i, j, 2 * h + 1)}, %alpha;
"""
            if with_beta:
                s += f"""\
    mov.f32         %o0, 0f00000000;
    mov.f32         %o1, 0f00000000;
    @%pv{j} ld.global.v2.f32 {{%o0, %o1}}, [%cptr+{32 * j}];
    @%ps{j} ld.global.f32 %o0, [%cptr+{32 * j}];
    @%pt{j} ld.global.f32 %o1, [%cptr+{32 * j + 4}];
    fma.rn.f32      %v0, %o0, %beta, %v0;
    fma.rn.f32      %v1, %o1, %beta, %v1;
"""
            s += f"""\
    @%pv{j} st.global.v2.f32 [%cptr+{32 * j}], {{%v0, %v1}};
    @%ps{j} st.global.f32 [%cptr+{32 * j}], %v0;
    @%pt{j} st.global.f32 [%cptr+{32 * j + 4}], %v1;
"""
        if srow < 7:
            s += """\
    add.u32         %row, %row, 8;
    add.u64         %cptr, %cptr, %cstep;
"""
    s += f"    bra.uni         {name}_DONE;\n"
    return s


def tc_entry(emit, entry_open, load_params, grouped_tile, ty, variant):
    """Emits gemm_<ty>_<variant> (ty: f16 or bf16; variant: nn, nt or tn)."""
    name = f"gemm_{ty}_{variant}"
    akind = "mnmajor" if variant == "tn" else "kmajor"
    bkind = "kmajor" if variant == "nt" else "mnmajor"
    alayout = {"kmajor": "K-major, ldmatrix", "mnmajor": "MN-major, ldmatrix.trans"}
    emit("// ===========================================================================")
    emit(f"// {name}: {ty} tensor cores (mma.sync m16n8k16, f32 accumulate),")
    emit("//   128 x 128 tile per 256-thread block, grid (ceil(n/128), ceil(m/128), 1).")
    emit(f"//   A slices: {alayout[akind]}; B slices: {alayout[bkind]}.")
    emit("//   Algorithm, layouts and fragment maps: see file header.")
    emit("// ===========================================================================")
    entry_open(name, [".maxntid 256, 1, 1", f".minnctapersm {MIN_CTAS}"])
    nao = 2 if akind == "kmajor" else 4
    emit(f"""\
    .reg .pred      %pe, %pbz, %prow, %pmore, %pv<4>, %ps<4>, %pt<4>;
    .reg .b32       %t<9>, %gx, %gy, %pid, %m0, %n0, %thr, %lane, %warp, %wm, %wn;
    .reg .b32       %M, %N, %K, %lda, %ldb, %ldc, %kt, %KT;
    .reg .b32       %x7, %xr, %h3, %h4, %Ao<{nao}>, %Bo<2>, %sa<{nao}>, %sb<2>;
    .reg .b32       %Asoff, %Bsoff, %Al<2>, %Bl<2>, %Acb, %Bcb;
    .reg .b32       %sbase, %send, %sld, %scmp, %row, %col;
    .reg .b32       %fa<16>, %fb<8>;
    .reg .b64       %pa, %pb, %pc, %ga, %gb, %gc, %d<3>;
    .reg .b64       %Ap<2>, %Bp<2>, %Astep, %Bstep, %cptr, %cstep;
    .reg .f32       %alpha, %beta, %v0, %v1, %o0, %o1, %acc<64>;
    .shared .align 128 .b8 {name}_smem[49152];
""")
    emit(load_params(name))
    emit(grouped_tile(128))
    emit("""\
    and.b32         %lane, %thr, 31;
    shr.u32         %warp, %thr, 5;
    shr.u32         %wm, %warp, 2;              // warp row: 64 rows
    and.b32         %wn, %warp, 3;              // warp column: 32 columns""")
    emit(copy_setup("A", akind, "ga", "lda", "M", "m0", 0))
    emit(copy_setup("B", bkind, "gb", "ldb", "N", "n0", 8192))
    emit(FRAG_SETUP_COMMON)
    emit(frag_setup("A", akind))
    emit(frag_setup("B", bkind))
    for r in range(64):
        emit(f"    mov.f32         %acc{r}, 0f00000000;")
    advance = """\
    add.u32         %{r}, %{r}, 16384;
    setp.eq.u32     %pe, %{r}, %send;
    selp.b32        %{r}, %sbase, %{r}, %pe;"""
    emit(f"""\
    mov.u32         %sbase, {name}_smem;
    add.u32         %send, %sbase, 49152;
    add.u32         %KT, %K, 31;
    shr.u32         %KT, %KT, 5;                // number of 32-wide k slices
    // ---- prologue: slices 0 and 1 -> stages 0 and 1
    mov.u32         %sld, %sbase;""")
    for _ in range(2):
        emit(copy_slice("A", akind) + copy_slice("B", bkind))
        emit("    cp.async.commit_group;")
        emit(advance.format(r="sld"))
    emit(f"""\
    mov.u32         %scmp, %sbase;
    mov.u32         %kt, 0;
{name}_LOOP:
    cp.async.wait_group 1;                      // slice kt has landed (own copies)
    bar.sync        0;                          // ... and everyone's; stage of kt-1 is free
    // copy slice kt+2 into the stage of slice kt-1 (zero fill past the end)""")
    emit(copy_slice("A", akind) + copy_slice("B", bkind))
    emit("    cp.async.commit_group;")
    emit(advance.format(r="sld"))
    emit(compute_stage(akind, bkind, ty))
    emit(advance.format(r="scmp"))
    emit(f"""\
    add.u32         %kt, %kt, 1;
    setp.lt.u32     %pmore, %kt, %KT;
    @%pmore bra     {name}_LOOP;
    cp.async.wait_all;

    // ---- epilogue
    // row = m0 + 64wm + g, col = n0 + 32wn + 2q; column pair j at col + 8j
    shr.u32         %t0, %lane, 2;              // g
    shl.b32         %t1, %wm, 6;
    add.u32         %t1, %t1, %t0;
    add.u32         %row, %m0, %t1;
    and.b32         %t2, %lane, 3;
    shl.b32         %t2, %t2, 1;                // 2q
    shl.b32         %t3, %wn, 5;
    add.u32         %t3, %t3, %t2;
    add.u32         %col, %n0, %t3;
    // pair path (st.global.v2): ldc even and c 8-byte aligned
    and.b32         %t4, %ldc, 1;
    cvt.u32.u64     %t5, %gc;
    and.b32         %t5, %t5, 7;
    or.b32          %t4, %t4, %t5;
    setp.eq.u32     %pe, %t4, 0;""")
    for j in range(4):
        emit(f"""\
    add.u32         %t6, %col, {8 * j};
    add.u32         %t7, %t6, 1;
    setp.lt.u32     %ps{j}, %t6, %N;             // first column in range
    setp.lt.u32     %pt{j}, %t7, %N;             // second column in range
    and.pred        %pv{j}, %pt{j}, %pe;          // both, as one v2
    not.pred        %prow, %pv{j};
    and.pred        %ps{j}, %ps{j}, %prow;        // scalar fallbacks
    and.pred        %pt{j}, %pt{j}, %prow;""")
    emit(f"""\
    mul.wide.u32    %d0, %row, %ldc;
    cvt.u64.u32     %d1, %col;
    add.u64         %d0, %d0, %d1;
    shl.b64         %d0, %d0, 2;
    add.u64         %cptr, %gc, %d0;            // &C[row][col]
    mul.wide.u32    %cstep, %ldc, 32;           // 8 rows, in bytes
    setp.eq.f32     %pbz, %beta, 0f00000000;
    @%pbz bra       {name}_NOBETA;
    // beta != 0: C = alpha acc + beta C""")
    emit(epilogue(name, True))
    emit(f"{name}_NOBETA:\n    // beta == 0: C = alpha acc, C not read")
    emit(epilogue(name, False))
    emit(f"{name}_DONE:\n    ret;\n}}\n")


def emit_all(emit, entry_open, load_params, grouped_tile):
    """Emits the six tensor-core entries in file order (f16 then bf16; nn, nt, tn)."""
    for ty in ("f16", "bf16"):
        for v in ("nn", "nt", "tn"):
            tc_entry(emit, entry_open, load_params, grouped_tile, ty, v)
