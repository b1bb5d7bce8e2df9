#!/usr/bin/env python3
"""Tests of the emulated CUDA driver (libcuda_emu.c + server.py) through ctypes.

Usage: test_emu_cuda.py [PATH/TO/libcuda.so.1]   (default .tools/emu-cuda/lib64/libcuda.so.1)
Run by scripts/emu-cuda/build after each build.
"""
from __future__ import annotations

import ctypes as C
import os
import subprocess
import sys
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LIB_PATH = os.path.join(ROOT, ".tools", "emu-cuda", "lib64", "libcuda.so.1")

SUCCESS, INVALID_VALUE, INVALID_HANDLE, NOT_READY, LAUNCH_FAILED, NOT_SUPPORTED = 0, 1, 400, 600, 719, 801
STREAM_NON_BLOCKING = 1

# fill(p, n, v): p[i] = v for every i < n (one thread per element)
FILL_PTX = r"""
.version 7.0
.target sm_90
.address_size 64

.visible .entry fill(.param .u64 p, .param .u32 n, .param .u32 v)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [p];
    ld.param.u32 %r1, [n];
    ld.param.u32 %r2, [v];
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mad.lo.u32 %r3, %r4, %r5, %r3;
    setp.ge.u32 %p1, %r3, %r1;
    @%p1 bra DONE;
    mul.wide.u32 %rd2, %r3, 4;
    add.u64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r2;
DONE:
    ret;
}

.visible .entry exp2(.param .u64 x, .param .u64 y, .param .u32 n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [x];
    ld.param.u64 %rd2, [y];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mad.lo.u32 %r2, %r3, %r4, %r2;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra END;
    mul.wide.u32 %rd3, %r2, 4;
    add.u64 %rd4, %rd1, %rd3;
    add.u64 %rd5, %rd2, %rd3;
    ld.global.f32 %f1, [%rd4];
    ex2.approx.f32 %f2, %f1;
    st.global.f32 [%rd5], %f2;
END:
    ret;
}
"""


def load(path):
    lib = C.CDLL(path)
    u64, sz, vp = C.c_uint64, C.c_size_t, C.c_void_p
    sigs = {
        "cuInit": [C.c_uint],
        "cuDeviceGet": [C.POINTER(C.c_int), C.c_int],
        "cuDeviceGetName": [C.c_char_p, C.c_int, C.c_int],
        "cuDeviceGetAttribute": [C.POINTER(C.c_int), C.c_int, C.c_int],
        "cuDevicePrimaryCtxRetain": [C.POINTER(vp), C.c_int],
        "cuCtxSetCurrent": [vp],
        "cuCtxSynchronize": [],
        "cuMemAlloc_v2": [C.POINTER(u64), sz],
        "cuMemFree_v2": [u64],
        "cuMemGetInfo_v2": [C.POINTER(sz), C.POINTER(sz)],
        "cuMemcpyHtoD_v2": [u64, vp, sz],
        "cuMemcpyDtoH_v2": [vp, u64, sz],
        "cuMemcpyDtoHAsync_v2": [vp, u64, sz, vp],
        "cuMemsetD32_v2": [u64, C.c_uint, sz],
        "cuStreamCreate": [C.POINTER(vp), C.c_uint],
        "cuStreamDestroy_v2": [vp],
        "cuStreamSynchronize": [vp],
        "cuStreamQuery": [vp],
        "cuStreamWaitEvent": [vp, vp, C.c_uint],
        "cuEventCreate": [C.POINTER(vp), C.c_uint],
        "cuEventRecord": [vp, vp],
        "cuEventQuery": [vp],
        "cuEventSynchronize": [vp],
        "cuEventElapsedTime": [C.POINTER(C.c_float), vp, vp],
        "cuEventDestroy_v2": [vp],
        "cuModuleLoadData": [C.POINTER(vp), C.c_char_p],
        "cuModuleGetFunction": [C.POINTER(vp), vp, C.c_char_p],
        "cuModuleUnload": [vp],
        "cuLaunchKernel": [vp, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint,
                           C.c_uint, vp, C.POINTER(vp), C.POINTER(vp)],
        "cuGetErrorName": [C.c_int, C.POINTER(C.c_char_p)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = C.c_int
    return lib


class EmulatedDriver(unittest.TestCase):
    lib = None

    @classmethod
    def setUpClass(cls):
        cls.lib = lib = load(LIB_PATH)
        assert lib.cuInit(0) == SUCCESS
        dev = C.c_int()
        assert lib.cuDeviceGet(C.byref(dev), 0) == SUCCESS
        ctx = C.c_void_p()
        assert lib.cuDevicePrimaryCtxRetain(C.byref(ctx), dev) == SUCCESS
        assert lib.cuCtxSetCurrent(ctx) == SUCCESS
        mod = C.c_void_p()
        assert lib.cuModuleLoadData(C.byref(mod), FILL_PTX.encode()) == SUCCESS
        cls.module = mod
        fn = C.c_void_p()
        assert lib.cuModuleGetFunction(C.byref(fn), mod, b"fill") == SUCCESS
        cls.fill = fn

    def ok(self, result):
        self.assertEqual(result, SUCCESS)

    def alloc_u32(self, values):
        ptr = C.c_uint64()
        self.ok(self.lib.cuMemAlloc_v2(C.byref(ptr), 4 * len(values)))
        host = (C.c_uint32 * len(values))(*values)
        self.ok(self.lib.cuMemcpyHtoD_v2(ptr.value, host, 4 * len(values)))
        return ptr.value

    def read_u32(self, ptr, n):
        host = (C.c_uint32 * n)()
        self.ok(self.lib.cuMemcpyDtoH_v2(host, ptr, 4 * n))
        return list(host)

    def launch_fill(self, ptr, n, value, stream=None, threads=None):
        p, nn, v = C.c_uint64(ptr), C.c_uint32(n), C.c_uint32(value)
        params = (C.c_void_p * 3)(C.cast(C.byref(p), C.c_void_p), C.cast(C.byref(nn), C.c_void_p),
                                  C.cast(C.byref(v), C.c_void_p))
        threads = threads or n
        return self.lib.cuLaunchKernel(self.fill, (threads + 63) // 64, 1, 1, 64, 1, 1, 0, stream,
                                       params, None)

    def stream(self, flags=0):
        s = C.c_void_p()
        self.ok(self.lib.cuStreamCreate(C.byref(s), flags))
        return s

    def event(self):
        e = C.c_void_p()
        self.ok(self.lib.cuEventCreate(C.byref(e), 0))
        return e

    def test_device_reports_the_emulated_h100(self):
        name = C.create_string_buffer(128)
        self.ok(self.lib.cuDeviceGetName(name, 128, 0))
        self.assertEqual(name.value.decode(), "NVIDIA H100 (ringtrain PTX emulator)")
        for attr, want in ((16, 132), (75, 9), (76, 0), (10, 32)):
            v = C.c_int()
            self.ok(self.lib.cuDeviceGetAttribute(C.byref(v), attr, 0))
            self.assertEqual(v.value, want, f"attribute {attr}")

    def test_alloc_copy_round_trip_and_memset(self):
        free0, total = C.c_size_t(), C.c_size_t()
        self.ok(self.lib.cuMemGetInfo_v2(C.byref(free0), C.byref(total)))
        ptr = self.alloc_u32(range(1000))
        free1 = C.c_size_t()
        self.ok(self.lib.cuMemGetInfo_v2(C.byref(free1), C.byref(total)))
        self.assertEqual(free0.value - free1.value, 4000)
        self.assertEqual(self.read_u32(ptr, 1000), list(range(1000)))
        self.ok(self.lib.cuMemsetD32_v2(ptr + 40, 0xDEADBEEF, 10))
        got = self.read_u32(ptr, 1000)
        self.assertEqual(got[10:20], [0xDEADBEEF] * 10)
        self.assertEqual(got[:10] + got[20:], list(range(10)) + list(range(20, 1000)))
        # a copy running past the allocation is refused
        host = (C.c_uint32 * 2)()
        self.assertEqual(self.lib.cuMemcpyDtoH_v2(host, ptr + 3996, 8), INVALID_VALUE)
        self.ok(self.lib.cuMemFree_v2(ptr))
        self.assertEqual(self.lib.cuMemFree_v2(ptr), INVALID_VALUE)

    def test_total_memory_is_set_by_the_environment_and_runs_out(self):
        # child processes: the size is read once, at cuInit
        code = (
            "import ctypes as C, sys; lib = C.CDLL(sys.argv[1]); "
            "r = [lib.cuInit(0)]; dev = C.c_int(); ctx = C.c_void_p(); "
            "r += [lib.cuDeviceGet(C.byref(dev), 0), lib.cuCtxCreate_v2(C.byref(ctx), 0, dev)]; "
            "total, free = C.c_size_t(), C.c_size_t(); "
            "r += [lib.cuDeviceTotalMem_v2(C.byref(total), dev)]; p, q = C.c_uint64(), C.c_uint64(); "
            "r += [lib.cuMemAlloc_v2(C.byref(p), 3 << 20), lib.cuMemAlloc_v2(C.byref(q), 2 << 20)]; "
            "r += [lib.cuMemGetInfo_v2(C.byref(free), C.byref(total))]; "
            "r += [lib.cuMemFree_v2(p), lib.cuMemAlloc_v2(C.byref(q), 2 << 20)]; "
            "print(r, total.value, free.value)"
        )

        def run(value):
            env = dict(os.environ, LIBCUDA_EMU_TOTAL_MEM=value)
            return subprocess.run([sys.executable, "-c", code, LIB_PATH], env=env,
                                  capture_output=True, text=True, timeout=60)

        out = run("4M")
        # 3 MiB fits, 2 MiB more does not (out of memory, code 2) until the 3 MiB are freed
        self.assertEqual(out.stdout.split(), ["[0,", "0,", "0,", "0,", "0,", "2,", "0,", "0,",
                                              "0]", str(4 << 20), str(1 << 20)], out.stderr)
        for bad in ("lots", "0", "12X", "1024G"):
            out = run(bad)
            self.assertTrue(out.stdout.startswith(f"[{INVALID_VALUE},"), (bad, out.stdout))
            self.assertIn(f"LIBCUDA_EMU_TOTAL_MEM={bad} is not a size", out.stderr)

    def test_fresh_allocations_are_poisoned(self):
        ptr = C.c_uint64()
        self.ok(self.lib.cuMemAlloc_v2(C.byref(ptr), 16))
        self.assertEqual(self.read_u32(ptr.value, 4), [0xFFFFFFFF] * 4)
        self.ok(self.lib.cuMemFree_v2(ptr.value))

    def test_kernel_writes_device_memory(self):
        ptr = self.alloc_u32([0] * 100)
        self.ok(self.launch_fill(ptr, 100, 7))
        self.ok(self.lib.cuCtxSynchronize())
        self.assertEqual(self.read_u32(ptr, 100), [7] * 100)
        self.ok(self.lib.cuMemFree_v2(ptr))

    def test_out_of_bounds_kernel_write_is_a_launch_failure(self):
        ptr = self.alloc_u32([0] * 10)
        s = self.stream()
        self.ok(self.launch_fill(ptr, 11, 5, stream=s))  # queued: the error shows at the sync
        self.assertEqual(self.lib.cuStreamSynchronize(s), LAUNCH_FAILED)
        # not sticky: the stream works afterwards
        self.ok(self.launch_fill(ptr, 10, 3, stream=s))
        self.ok(self.lib.cuStreamSynchronize(s))
        self.assertEqual(self.read_u32(ptr, 10), [3] * 10)
        self.ok(self.lib.cuStreamDestroy_v2(s))
        self.ok(self.lib.cuMemFree_v2(ptr))

    def test_copy_on_another_stream_sees_old_data_unless_it_waits(self):
        ptr = self.alloc_u32([1] * 64)
        compute, copy = self.stream(), self.stream(STREAM_NON_BLOCKING)
        host = (C.c_uint32 * 64)()
        # no dependency: the copy runs before the queued kernel
        self.ok(self.launch_fill(ptr, 64, 2, stream=compute))
        self.ok(self.lib.cuMemcpyDtoHAsync_v2(host, ptr, 256, copy))
        self.assertEqual(list(host), [0] * 64, "async copies must not run when queued")
        self.ok(self.lib.cuStreamSynchronize(copy))
        self.assertEqual(list(host), [1] * 64)
        self.ok(self.lib.cuStreamSynchronize(compute))
        # with the event: the copy waits for the kernel
        done = self.event()
        self.ok(self.launch_fill(ptr, 64, 9, stream=compute))
        self.ok(self.lib.cuEventRecord(done, compute))
        self.ok(self.lib.cuStreamWaitEvent(copy, done, 0))
        self.ok(self.lib.cuMemcpyDtoHAsync_v2(host, ptr, 256, copy))
        self.ok(self.lib.cuStreamSynchronize(copy))
        self.assertEqual(list(host), [9] * 64)
        self.ok(self.lib.cuEventQuery(done))
        for s in (compute, copy):
            self.ok(self.lib.cuStreamDestroy_v2(s))
        self.ok(self.lib.cuEventDestroy_v2(done))
        self.ok(self.lib.cuMemFree_v2(ptr))

    def test_event_query_is_not_ready_then_done_and_times_are_positive(self):
        ptr = self.alloc_u32([0] * 32)
        s = self.stream()
        start, stop = self.event(), self.event()
        self.ok(self.lib.cuEventRecord(start, s))
        self.ok(self.launch_fill(ptr, 32, 4, stream=s))
        self.ok(self.lib.cuEventRecord(stop, s))
        self.assertEqual(self.lib.cuStreamQuery(s), NOT_READY)
        self.assertEqual(self.lib.cuEventQuery(stop), SUCCESS)
        self.assertEqual(self.lib.cuStreamQuery(s), SUCCESS)
        ms = C.c_float()
        self.ok(self.lib.cuEventElapsedTime(C.byref(ms), start, stop))
        self.assertGreater(ms.value, 0.0)
        self.ok(self.launch_fill(ptr, 32, 6, stream=s))
        self.ok(self.lib.cuEventRecord(stop, s))
        self.assertEqual(self.lib.cuEventQuery(stop), NOT_READY)
        self.assertEqual(self.lib.cuEventQuery(stop), SUCCESS)
        self.assertEqual(self.read_u32(ptr, 32), [6] * 32)
        for e in (start, stop):
            self.ok(self.lib.cuEventDestroy_v2(e))
        self.ok(self.lib.cuStreamDestroy_v2(s))
        self.ok(self.lib.cuMemFree_v2(ptr))

    def test_blocking_stream_orders_after_the_legacy_stream(self):
        ptr = self.alloc_u32([0] * 16)
        s = self.stream()
        host = (C.c_uint32 * 16)()
        self.ok(self.launch_fill(ptr, 16, 8, stream=None))  # legacy default stream
        self.ok(self.lib.cuMemcpyDtoHAsync_v2(host, ptr, 64, s))
        self.ok(self.lib.cuStreamSynchronize(s))
        self.assertEqual(list(host), [8] * 16)
        self.ok(self.lib.cuStreamDestroy_v2(s))
        self.ok(self.lib.cuMemFree_v2(ptr))

    def test_late_schedule_runs_later_work_of_other_streams_before_a_copy(self):
        # write-after-read across streams: a kernel queued after a cross-stream copy
        # overwrites the copy's source; "lazy" runs the copy first, "late" the kernel
        seen = {}
        for schedule in ("lazy", "late"):
            env = dict(os.environ, LIBCUDA_EMU_SCHEDULE=schedule)
            out = subprocess.run([sys.executable, __file__, LIB_PATH, "--war-scenario"], env=env,
                                 capture_output=True, text=True, check=True)
            seen[schedule] = out.stdout.split()
        self.assertEqual(seen["lazy"], ["1"] * 64)
        self.assertEqual(seen["late"], ["9"] * 64)

    def test_approximate_results_are_perturbed_but_equal_for_equal_inputs(self):
        import numpy as np
        n = 256
        fn = C.c_void_p()
        self.ok(self.lib.cuModuleGetFunction(C.byref(fn), self.module, b"exp2"))
        xs = np.linspace(-3.0, 3.0, n, dtype=np.float32)
        x = self.alloc_u32(xs.view(np.uint32).tolist())
        outs = []
        for _ in range(2):
            y = C.c_uint64()
            self.ok(self.lib.cuMemAlloc_v2(C.byref(y), 4 * n))
            px, py, pn = C.c_uint64(x), C.c_uint64(y.value), C.c_uint32(n)
            params = (C.c_void_p * 3)(*(C.cast(C.byref(v), C.c_void_p) for v in (px, py, pn)))
            self.ok(self.lib.cuLaunchKernel(fn, n // 64, 1, 1, 64, 1, 1, 0, None, params, None))
            outs.append(np.array(self.read_u32(y.value, n), np.uint32).view(np.float32))
            self.ok(self.lib.cuMemFree_v2(y.value))
        self.ok(self.lib.cuMemFree_v2(x))
        exact = np.exp2(xs.astype(np.float64))
        self.assertTrue((np.abs(outs[0] - exact) <= (2.0 ** -22 + 2.0 ** -24) * exact).all())
        self.assertGreater((outs[0] != exact.astype(np.float32)).sum(), n // 4,
                           "ex2.approx should be perturbed within its error bound")
        if os.environ.get("LIBCUDA_EMU_APPROX", "hash") == "hash":
            self.assertEqual(outs[0].tobytes(), outs[1].tobytes(),
                             "equal inputs must give equal ex2.approx results in every launch")

    def test_error_names_and_unknown_entry_points(self):
        name = C.c_char_p()
        self.ok(self.lib.cuGetErrorName(LAUNCH_FAILED, C.byref(name)))
        self.assertEqual(name.value, b"CUDA_ERROR_LAUNCH_FAILED")
        self.ok(self.lib.cuGetErrorName(NOT_READY, C.byref(name)))
        self.assertEqual(name.value, b"CUDA_ERROR_NOT_READY")
        # an entry point that is not emulated: 801 and one line on stderr (child process,
        # so that its stderr can be read)
        code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
                "print(lib.cuGraphCreate(None, 0))")
        out = subprocess.run([sys.executable, "-c", code, LIB_PATH], capture_output=True, text=True,
                             check=True)
        self.assertEqual(out.stdout.strip(), str(NOT_SUPPORTED))
        self.assertIn("libcuda-emu: cuGraphCreate is not emulated", out.stderr)

    def test_unknown_kernel_and_bad_ptx_are_errors(self):
        fn = C.c_void_p()
        self.assertEqual(self.lib.cuModuleGetFunction(C.byref(fn), self.module, b"nope"), 500)
        mod = C.c_void_p()
        bad = b".version 7.0\n.target sm_90\n.address_size 64\n.visible .entry k() { frob.u32 %r1; ret; }"
        self.ok(self.lib.cuModuleLoadData(C.byref(mod), bad))  # parsed lazily per instruction
        self.ok(self.lib.cuModuleGetFunction(C.byref(fn), mod, b"k"))
        self.ok(self.lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, None, None))
        self.assertEqual(self.lib.cuCtxSynchronize(), LAUNCH_FAILED)
        self.ok(self.lib.cuModuleUnload(mod))


def war_scenario():
    """Prints what a copy-stream download sees when a kernel queued after it on the
    compute stream overwrites its source (see the late-schedule test)."""
    t = EmulatedDriver()
    EmulatedDriver.setUpClass()
    ptr = t.alloc_u32([1] * 64)
    compute, copy = t.stream(), t.stream(STREAM_NON_BLOCKING)
    after_compute, done = t.event(), t.event()
    host = (C.c_uint32 * 64)()
    assert t.lib.cuEventRecord(after_compute, compute) == SUCCESS
    assert t.lib.cuStreamWaitEvent(copy, after_compute, 0) == SUCCESS
    assert t.lib.cuMemcpyDtoHAsync_v2(host, ptr, 256, copy) == SUCCESS
    assert t.lib.cuEventRecord(done, copy) == SUCCESS
    assert t.launch_fill(ptr, 64, 9, stream=compute) == SUCCESS
    assert t.lib.cuEventSynchronize(done) == SUCCESS
    print(" ".join(str(v) for v in host))


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        LIB_PATH = os.path.abspath(sys.argv.pop(1))
    if sys.argv[1:] == ["--war-scenario"]:
        war_scenario()
        sys.exit(0)
    unittest.main(verbosity=1)
