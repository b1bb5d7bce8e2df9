#!/usr/bin/env python3
"""The largest batch size that trains without running out of device memory.

One search for both sides of ``scripts/gpu-check``: PyTorch's (``torch_nmt_gpu.py
--find-max-batch`` calls :func:`search` in process) and ringtrain's (this file as a
program runs one command per try). The search doubles from a batch that fits (or steps
down from one that does not), then bisects down to a multiple of ``step``. A try fails
for memory only when it says so; any other failure stops the search with its reason,
since a crash is not a size limit.

A search may have a time budget. Each try then gets what is left of it, and the
search stops, incomplete, when the budget runs out: the result is then a bracket, the
largest batch that fit and the smallest that did not (or none yet), with the reason it
stopped. Nothing in the result is extrapolated: every number in it was run.

As a program::

    max_batch.py [--start N] [--step N] [--seconds S] [--json FILE] -- CMD ... {batch} ...

runs ``CMD`` with ``{batch}`` replaced by the batch size to try, prints one line per
try, and writes the result as JSON (``largest``, ``smallest_failed``, ``complete``,
``stopped``, ``out_of_time``, ``tries``). A try that exits 0 fit. One that exits
non-zero was too big when its output says "out of device memory", "out of memory" or
``CUDA_ERROR_OUT_OF_MEMORY`` (it ran out), "not enough memory: this configuration
needs" (ringtrain refused it at start: its memory estimate exceeded the free memory), or
"index with 32-bit integers" (an operand outgrew the GPU kernels' indexing); the result
names which. The exit status is 0 when the search ran to its end or stopped
at the time budget, 1 when a try failed for another reason, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

# A try's outcome: it trained; it ran out of device memory; the trainer refused it before
# allocating because its memory estimate exceeded the free memory (ringtrain's check at
# start); or an operand outgrew what the GPU kernels index with 32-bit integers
# (ringtrain's check at start, or a kernel's). The last three are "too big" to the search.
FITS, OUT_OF_MEMORY, REFUSED = "fits", "out of memory", "refused by the memory estimate"
BEYOND_INDEXING = "beyond the kernels' 32-bit indexing"
TOO_BIG = (OUT_OF_MEMORY, REFUSED, BEYOND_INDEXING)

# What a try that ran out of device memory prints (ringtrain-cuda's error, the CUDA
# driver's name for the code, PyTorch's OutOfMemoryError), and ringtrain's refusal.
MEMORY_FAILURE = re.compile(r"out of (device )?memory|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
ESTIMATE_REFUSAL = re.compile(r"not enough memory: this configuration needs")
INDEX_LIMIT = re.compile(r"index with 32-bit integers")


@dataclass
class Try:
    batch: int
    outcome: str  # FITS, OUT_OF_MEMORY, REFUSED, or why it failed otherwise
    seconds: float


@dataclass
class Result:
    """What a search found; every batch in it was tried."""

    largest: int  # largest batch that fit (0: none did)
    smallest_failed: Optional[int]  # smallest batch that ran out of memory (None: none)
    complete: bool  # no multiple of `step` lies between the two
    stopped: Optional[str] = None  # why an incomplete search ended
    out_of_time: bool = False  # it ended because the time budget ran out
    tries: list = field(default_factory=list)

    def failure(self) -> str:
        """How the smallest failed batch failed (an outcome in TOO_BIG), or ''."""
        return next((t["outcome"] for t in self.tries if t["batch"] == self.smallest_failed), "")

    def describe(self) -> str:
        failed = f"{self.smallest_failed}: {self.failure()}" if self.smallest_failed else ""
        if self.complete:
            if self.largest == 0:
                return f"none fits ({failed})"
            return f"{self.largest} ({failed})"
        upper = f"; {failed}" if failed else ""
        return f">= {self.largest}{upper}; search stopped ({self.stopped})"


class StopSearch(Exception):
    """A try ended the search: it failed for another reason than memory, or ran out of
    time (`out_of_time`). The message says which."""

    def __init__(self, message: str, out_of_time: bool = False):
        super().__init__(message)
        self.out_of_time = out_of_time


def search(
    fits: Callable[[int, Optional[float]], str],
    start: int,
    step: int = 32,
    seconds: Optional[float] = None,
    clock: Callable[[], float] = time.monotonic,
) -> Result:
    """The largest batch that fits, among `start` doubled as long as it fits and the
    multiples of `step` below the first that did not.

    `fits(batch, seconds_left)` returns FITS when a step at that batch trained,
    OUT_OF_MEMORY or REFUSED when it was too big, and raises StopSearch for anything
    else; `seconds_left` is the budget left for that try (None: no budget). Tries
    double from `start` until one fails; when `start` itself fails, they step down from
    it by 1, 2, 4, ... steps until one fits (a start from an estimate near the limit
    then costs a try or two); then they bisect. With `seconds`, no try starts once the
    budget is spent."""
    if start < 1 or step < 1:
        raise ValueError(f"start ({start}) and step ({step}) must be positive")
    deadline = None if seconds is None else clock() + seconds
    tries: list[Try] = []
    good, bad = 0, None

    def attempt(batch: int) -> bool:
        left = None if deadline is None else deadline - clock()
        if left is not None and left <= 0:
            raise StopSearch(f"the {seconds:g} s budget ran out before batch {batch}", True)
        began = clock()
        try:
            outcome = fits(batch, left)
        except StopSearch as stop:
            tries.append(Try(batch, str(stop), clock() - began))
            raise
        if outcome != FITS and outcome not in TOO_BIG:
            raise ValueError(f"fits({batch}) returned {outcome!r}, not an outcome")
        tries.append(Try(batch, outcome, clock() - began))
        return outcome == FITS

    try:
        batch = start
        while bad is None:
            if attempt(batch):
                good = batch
                batch = max(batch * 2, step)
            else:
                bad = batch
        if good == 0:
            # Down from the start: the multiples of `step` 1, 2, 4, ... steps below it.
            below = (start - 1) // step * step
            stride = step
            while below >= step:
                if attempt(below):
                    good = below
                    break
                bad = below
                below -= stride
                stride *= 2
        while True:
            # the middle multiple of `step` strictly between the two, if any
            mid = max((good + bad) // 2 // step * step, good // step * step + step)
            if mid >= bad:
                break
            if attempt(mid):
                good = mid
            else:
                bad = mid
    except StopSearch as stop:
        return Result(good, bad, False, str(stop), stop.out_of_time, [asdict(t) for t in tries])
    return Result(good, bad, True, None, False, [asdict(t) for t in tries])


def command_fits(template: list[str], log: Optional[str] = None):
    """A `fits` for :func:`search` that runs `template` with `{batch}` replaced."""

    def fits(batch: int, left: Optional[float]) -> str:
        argv = [a.replace("{batch}", str(batch)) for a in template]
        try:
            run = subprocess.run(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                timeout=left,
            )
        except subprocess.TimeoutExpired:
            raise StopSearch(f"batch {batch} was still running when the budget ran out", True)
        except OSError as e:
            raise StopSearch(f"could not run {argv[0]}: {e}")
        if log:
            with open(log, "w") as f:
                f.write(run.stdout)
        if run.returncode == 0:
            return FITS
        if ESTIMATE_REFUSAL.search(run.stdout):
            return REFUSED
        if INDEX_LIMIT.search(run.stdout):
            return BEYOND_INDEXING
        if MEMORY_FAILURE.search(run.stdout):
            return OUT_OF_MEMORY
        last = run.stdout.strip().splitlines()[-1:] or ["(no output)"]
        raise StopSearch(
            f"batch {batch} failed with exit status {run.returncode}, not for memory: {last[0]}"
        )

    return fits


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description="Largest batch that trains: runs CMD with {batch} replaced, doubling "
        "then bisecting.",
        usage="%(prog)s [options] -- CMD ... {batch} ...",
    )
    parser.add_argument("--start", type=int, default=32, help="first batch tried (default 32)")
    parser.add_argument("--step", type=int, default=32, help="granularity (default 32)")
    parser.add_argument("--seconds", type=float, help="time budget for the whole search")
    parser.add_argument("--json", help="write the result here as JSON")
    parser.add_argument("--log", help="each try's output goes here (the last try's remains)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: put it after --, with {batch} where the size goes")
    if not any("{batch}" in a for a in command):
        parser.error("the command has no {batch}: every try would run the same size")
    if args.start < 1 or args.step < 1:
        parser.error(f"--start ({args.start}) and --step ({args.step}) must be positive")
    if args.seconds is not None and args.seconds <= 0:
        parser.error(f"--seconds {args.seconds:g}: give a positive budget, or none")

    fits = command_fits(command, args.log)

    def reporting(batch: int, left: Optional[float]) -> str:
        outcome = fits(batch, left)
        print(f"batch {batch}: {outcome}", flush=True)
        return outcome

    result = search(reporting, args.start, args.step, args.seconds)
    print(f"largest batch that trains: {result.describe()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f)
            f.write("\n")
    return 1 if result.stopped and not result.out_of_time else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
