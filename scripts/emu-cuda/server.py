#!/usr/bin/env python3
"""Kernel-execution server of the emulated CUDA driver (libcuda_emu.c).

The driver library starts this program as a child process on first use and
talks to it over one Unix stream socket (inherited file descriptor).  Device
memory is one sparse shared file that both sides map: the library copies and
sets bytes in it directly, this server runs kernels on it through
``ptx_emu.GlobalMemory.map`` views, so kernel stores land in the file.

Protocol (all integers little-endian).  A request is ``u32 op, u32 length``
followed by ``length`` payload bytes; every request gets one reply,
``u32 status, u32 length`` and payload.  Status 0 is success (payload as
below), 1 an error (payload: UTF-8 message), 2 "not found" (unknown entry).

* ``LOAD   = 1``: PTX text -> ``u32 module id``.
* ``GETFN  = 2``: ``u32 module id`` + entry name -> ``u32 function id,
  u32 static shared bytes, u32 max threads per block, u32 parameter count``,
  then one ``u32`` size per parameter.
* ``UNLOAD = 3``: ``u32 module id`` -> nothing.
* ``ALLOC  = 4``: ``u64 device address, u64 bytes`` -> nothing (the bytes live
  at file offset address - base).
* ``FREE   = 5``: ``u64 device address`` -> nothing.
* ``LAUNCH = 6``: ``u32 function id, u32 grid[3], u32 block[3],
  u32 dynamic shared bytes, u64 seed``, then the parameter values packed one
  after another with the sizes GETFN reported -> nothing, or status 1 with the
  emulator's message (it names the entry, PTX line and instruction).

Approximate instructions (ex2.approx, tanh.approx, ...) are perturbed within
their documented error.  ``LIBCUDA_EMU_APPROX`` picks how (ptx_emu's ``approx``):
``hash`` (default) makes the error a fixed function of the exact result and
``LIBCUDA_EMU_SEED``, so equal inputs give equal outputs in every launch as on
hardware; ``random`` draws new errors per launch from the seed the library sends
(LIBCUDA_EMU_SEED plus the launch number); ``exact`` rounds the exact value.
The block order of a launch is shuffled with the seed the library sends.  Both
make a run reproducible.

Usage (by the library): ``server.py --fd N --mem-fd M --mem-size BYTES --base ADDR``.
"""
from __future__ import annotations

import argparse
import mmap
import os
import socket
import struct
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ptx-emu"))
import ptx_emu  # noqa: E402

OP_LOAD, OP_GETFN, OP_UNLOAD, OP_ALLOC, OP_FREE, OP_LAUNCH = 1, 2, 3, 4, 5, 6
ST_OK, ST_ERROR, ST_NOT_FOUND = 0, 1, 2

_PARAM_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2,
                "u32": 4, "s32": 4, "b32": 4, "f32": 4,
                "u64": 8, "s64": 8, "b64": 8, "f64": 8}


class Reply(Exception):
    """A non-success reply: status and message."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class Server:
    def __init__(self, mem_fd, mem_size, base):
        self.base = base
        self.size = mem_size
        self.map = mmap.mmap(mem_fd, mem_size, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = np.frombuffer(self.map, np.uint8)
        self.mem = ptx_emu.GlobalMemory()
        self.modules = {}    # id -> ptx_emu.Module
        self.functions = {}  # id -> (module id, entry name, [(param name, type)])
        self.next_id = 1
        self.approx = os.environ.get("LIBCUDA_EMU_APPROX") or "hash"
        self.approx_seed = int(os.environ.get("LIBCUDA_EMU_SEED") or "0", 0)

    def _new_id(self):
        self.next_id += 1
        return self.next_id - 1

    def load(self, payload):
        text = payload.decode("utf-8", errors="replace")
        try:
            module = ptx_emu.Module(text, path="<cuModuleLoadData>")
        except ptx_emu.EmuError as e:
            raise Reply(ST_ERROR, f"PTX not accepted by the emulator: {e}") from None
        except (ValueError, IndexError, KeyError, AttributeError) as e:
            raise Reply(ST_ERROR, f"PTX could not be parsed: {type(e).__name__}: {e}") from None
        mid = self._new_id()
        self.modules[mid] = module
        return struct.pack("<I", mid)

    def getfn(self, payload):
        (mid,) = struct.unpack_from("<I", payload)
        name = payload[4:].decode("utf-8", errors="replace")
        module = self.modules.get(mid)
        if module is None:
            raise Reply(ST_ERROR, f"module {mid} is not loaded")
        ent = module.entries.get(name)
        if ent is None:
            raise Reply(ST_NOT_FOUND, f"no entry {name!r} in the module "
                                      f"(entries: {', '.join(sorted(module.entries))})")
        sizes = []
        for pname, pty in ent.params:
            if pty not in _PARAM_SIZES:
                raise Reply(ST_ERROR, f"{name}: parameter {pname} of type .{pty} is not emulated")
            sizes.append(_PARAM_SIZES[pty])
        static_shared = 0
        for _sname, size, align in list(module.shared) + list(ent.shared):
            static_shared = (static_shared + align - 1) // align * align + size
        max_threads = 1024
        for d in ("maxntid", "reqntid"):
            if f".{d}" in ent.directives:
                i = ent.directives.index(f".{d}")
                dims = [int(t.rstrip(",")) for t in ent.directives[i + 1:i + 4]
                        if t.rstrip(",").isdigit()]
                max_threads = min(max_threads, int(np.prod(dims)))
        fid = self._new_id()
        self.functions[fid] = (mid, name, list(ent.params))
        return struct.pack(f"<IIII{len(sizes)}I", fid, static_shared, max_threads, len(sizes), *sizes)

    def unload(self, payload):
        (mid,) = struct.unpack_from("<I", payload)
        self.modules.pop(mid, None)
        for fid in [f for f, v in self.functions.items() if v[0] == mid]:
            del self.functions[fid]
        return b""

    def alloc(self, payload):
        addr, size = struct.unpack_from("<QQ", payload)
        off = addr - self.base
        if off < 0 or off + size > self.size:
            raise Reply(ST_ERROR, f"allocation [{addr:#x}, +{size}) outside device memory")
        self.mem.map(addr, self.bytes[off:off + size], f"cuMemAlloc@{addr:#x}[{size} B]")
        return b""

    def free(self, payload):
        (addr,) = struct.unpack_from("<Q", payload)
        try:
            self.mem.unmap(addr)
        except KeyError:
            raise Reply(ST_ERROR, f"free of unknown allocation {addr:#x}") from None
        return b""

    def launch(self, payload):
        fid, gx, gy, gz, bx, by, bz, dyn, seed = struct.unpack_from("<IIIIIIIIQ", payload)
        off = struct.calcsize("<IIIIIIIIQ")
        if fid not in self.functions:
            raise Reply(ST_ERROR, f"function {fid} is not loaded")
        mid, name, params = self.functions[fid]
        args = {}
        for pname, pty in params:
            n = _PARAM_SIZES[pty]
            raw = payload[off:off + n]
            off += n
            if pty in ("f32", "f64"):
                args[pname] = float(np.frombuffer(raw, np.float32 if n == 4 else np.float64)[0])
            elif pty == "f16":
                args[pname] = int.from_bytes(raw, "little")
            else:
                args[pname] = int.from_bytes(raw, "little", signed=pty.startswith("s"))
        try:
            self.modules[mid].launch(name, (gx, gy, gz), (bx, by, bz), self.mem, args,
                                     dynamic_shared=dyn, seed=seed, approx=self.approx,
                                     approx_seed=self.approx_seed)
        except ptx_emu.EmuError as e:
            raise Reply(ST_ERROR, f"{name} grid ({gx},{gy},{gz}) block ({bx},{by},{bz}): {e}") from None
        return b""


def _recv_exact(sock, n):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--mem-fd", type=int, required=True)
    ap.add_argument("--mem-size", type=int, required=True)
    ap.add_argument("--base", type=int, required=True)
    a = ap.parse_args()
    server = Server(a.mem_fd, a.mem_size, a.base)
    os.close(a.mem_fd)
    sock = socket.socket(fileno=a.fd)
    handlers = {OP_LOAD: server.load, OP_GETFN: server.getfn, OP_UNLOAD: server.unload,
                OP_ALLOC: server.alloc, OP_FREE: server.free, OP_LAUNCH: server.launch}
    while True:
        head = _recv_exact(sock, 8)
        if head is None:
            return 0  # the library closed the socket: the process is exiting
        op, length = struct.unpack("<II", head)
        payload = _recv_exact(sock, length)
        if payload is None:
            return 0
        try:
            handler = handlers.get(op)
            if handler is None:
                raise Reply(ST_ERROR, f"unknown request {op}")
            status, body = ST_OK, handler(payload)
        except Reply as r:
            status, body = r.status, str(r).encode()
        except Exception as e:  # an emulator defect: report it instead of dying
            tb = traceback.format_exc(limit=-3).strip().replace("\n", " | ")
            status, body = ST_ERROR, f"internal emulator error {type(e).__name__}: {e} ({tb})".encode()
        sock.sendall(struct.pack("<II", status, len(body)) + body)


if __name__ == "__main__":
    sys.exit(main())
