#!/usr/bin/env python3
"""Tests of max_batch.py: the search against oracles with a known limit, its time budget,
and the program form against a command that fails like a trainer out of memory.

Run: python3 benches/test_max_batch.py (scripts/test runs it).
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import max_batch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def limit_oracle(limit, log):
    """fits(batch) is batch <= limit; every batch asked is appended to `log`."""

    def fits(batch, left):
        log.append(batch)
        return max_batch.FITS if batch <= limit else max_batch.OUT_OF_MEMORY

    return fits


class FakeClock:
    """A clock that each try advances by `per_try` seconds."""

    def __init__(self, per_try):
        self.now, self.per_try = 0.0, per_try

    def __call__(self):
        return self.now

    def fits(self, limit):
        def fits(batch, left):
            self.now += self.per_try
            return max_batch.FITS if batch <= limit else max_batch.OUT_OF_MEMORY

        return fits


class SearchTest(unittest.TestCase):
    def test_finds_the_largest_multiple_of_the_step_for_many_limits(self):
        for start in (32, 384, 100):
            for limit in list(range(start, 2000, 37)) + [start, 4096, 4095]:
                asked = []
                r = max_batch.search(limit_oracle(limit, asked), start, 32)
                self.assertTrue(r.complete)
                # the answer fits, and nothing tried above it up to the failure did
                self.assertLessEqual(r.largest, limit)
                self.assertGreater(r.smallest_failed, limit)
                between = [b for b in range(r.largest + 1, r.smallest_failed) if b % 32 == 0]
                self.assertEqual(between, [], (start, limit, asked))
                # the answer is the largest size tried that fit
                self.assertEqual(r.largest, max(b for b in asked if b <= limit))
                self.assertTrue(r.largest in asked and r.smallest_failed in asked)
                self.assertEqual([t["batch"] for t in r.tries], asked)
                # doubling then bisection: logarithmic in the limit
                self.assertLess(len(asked), 2 * (limit // 32).bit_length() + 4, asked)

    def test_a_start_that_does_not_fit_searches_below_it(self):
        asked = []
        r = max_batch.search(limit_oracle(100, asked), 384, 32)
        self.assertTrue(r.complete)
        self.assertEqual((r.largest, r.smallest_failed), (96, 128))
        self.assertEqual(asked[0], 384)

    def test_a_start_just_above_the_limit_costs_a_try_or_two(self):
        # An estimate a little too high: the step below fits.
        asked = []
        r = max_batch.search(limit_oracle(4000, asked), 4010, 32)
        self.assertEqual(asked, [4010, 4000])
        self.assertEqual((r.largest, r.smallest_failed, r.complete), (4000, 4010, True))
        asked = []
        r = max_batch.search(limit_oracle(3950, asked), 4010, 32)
        self.assertEqual(asked, [4010, 4000, 3968, 3904, 3936])
        self.assertEqual((r.largest, r.smallest_failed, r.complete), (3936, 3968, True))

    def test_nothing_fits(self):
        r = max_batch.search(limit_oracle(0, []), 64, 32)
        self.assertTrue(r.complete)
        self.assertEqual((r.largest, r.smallest_failed), (0, 32))
        self.assertEqual(r.describe(), "none fits (32: out of memory)")

    def test_the_budget_stops_the_search_with_a_bracket_of_tried_sizes(self):
        clock = FakeClock(per_try=10.0)
        r = max_batch.search(clock.fits(5000), 384, 32, seconds=35.0, clock=clock)
        # tries start at 0, 10, 20 and 30 s; none at 40
        self.assertFalse(r.complete)
        self.assertTrue(r.out_of_time)
        self.assertEqual([t["batch"] for t in r.tries], [384, 768, 1536, 3072])
        self.assertEqual((r.largest, r.smallest_failed), (3072, None))
        self.assertIn("budget ran out before batch 6144", r.stopped)
        self.assertTrue(r.describe().startswith(">= 3072; search stopped"), r.describe())

    def test_each_try_gets_what_is_left_of_the_budget(self):
        clock = FakeClock(per_try=4.0)
        lefts = []

        def fits(batch, left):
            lefts.append(left)
            clock.now += 4.0
            return max_batch.FITS if batch <= 100 else max_batch.OUT_OF_MEMORY

        max_batch.search(fits, 32, 32, seconds=30.0, clock=clock)
        self.assertEqual(lefts[:3], [30.0, 26.0, 22.0])
        self.assertIsNone(max_batch.search(limit_oracle(64, []), 32).stopped)

    def test_a_failure_other_than_memory_stops_the_search_and_is_named(self):
        def fits(batch, left):
            if batch >= 128:
                raise max_batch.StopSearch(f"batch {batch} crashed")
            return max_batch.FITS

        r = max_batch.search(fits, 32, 32)
        self.assertFalse(r.complete)
        self.assertFalse(r.out_of_time)
        self.assertEqual((r.largest, r.smallest_failed), (64, None))
        self.assertEqual(r.tries[-1]["outcome"], "batch 128 crashed")

    def test_an_oracle_answering_something_else_is_a_bug_not_a_size(self):
        with self.assertRaises(ValueError):
            max_batch.search(lambda batch, left: True, 32)

    def test_bad_arguments_are_refused(self):
        with self.assertRaises(ValueError):
            max_batch.search(limit_oracle(10, []), 0, 32)
        with self.assertRaises(ValueError):
            max_batch.search(limit_oracle(10, []), 32, 0)


# A stand-in trainer: exits 0 up to LIMIT, else prints the CUDA crate's out-of-memory
# message and exits 1; above REFUSE_ABOVE it refuses as the trainer's memory check does,
# and from CRASH_AT it crashes.
FAKE_TRAINER = r"""
import os, sys
batch = int(sys.argv[1])
if batch >= int(os.environ.get("CRASH_AT", "1000000000")):
    print("thread 'main' panicked at somewhere: index out of bounds"); sys.exit(101)
if batch > int(os.environ.get("INDEX_ABOVE", "1000000000")):
    print("ringtrain: error: invalid value `%d` for --batch-size: one matrix product's operand would"
          " hold 3 elements, more than the 2 the GPU kernels index with 32-bit integers" % batch)
    sys.exit(1)
if batch > int(os.environ.get("REFUSE_ABOVE", "1000000000")):
    print("ringtrain: error: not enough memory: this configuration needs about 9.0 MiB per rank")
    sys.exit(1)
if batch > int(os.environ["LIMIT"]):
    print("error: out of device memory: allocating 123 bytes failed while this process held 0 bytes")
    sys.exit(1)
print("trained")
"""


class ProgramTest(unittest.TestCase):
    def run_program(self, env_extra, *args):
        with tempfile.TemporaryDirectory() as tmp:
            out_json = os.path.join(tmp, "r.json")
            env = dict(os.environ, **env_extra)
            run = subprocess.run(
                [sys.executable, os.path.join(HERE, "max_batch.py"), "--json", out_json, *args,
                 "--", sys.executable, "-c", FAKE_TRAINER, "{batch}"],
                env=env, capture_output=True, text=True, timeout=120,
            )
            result = None
            if os.path.exists(out_json):
                with open(out_json) as f:
                    result = json.load(f)
            return run, result

    def test_a_command_out_of_memory_is_too_big_and_the_result_is_written(self):
        run, result = self.run_program({"LIMIT": "300"}, "--start", "64")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual((result["largest"], result["smallest_failed"]), (288, 320))
        self.assertTrue(result["complete"])
        self.assertIn("batch 512: out of memory", run.stdout)
        self.assertIn("largest batch that trains: 288 (320: out of memory)", run.stdout)

    def test_a_refusal_by_the_memory_estimate_is_too_big_and_named(self):
        run, result = self.run_program({"LIMIT": "300", "REFUSE_ABOVE": "200"}, "--start", "64")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual((result["largest"], result["smallest_failed"]), (192, 224))
        self.assertIn("largest batch that trains: 192 (224: refused by the memory estimate)",
                      run.stdout)

    def test_the_kernels_index_limit_is_a_size_limit_and_named(self):
        run, result = self.run_program({"LIMIT": "300", "INDEX_ABOVE": "100"}, "--start", "64")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual((result["largest"], result["smallest_failed"]), (96, 128))
        self.assertIn("(128: beyond the kernels' 32-bit indexing)", run.stdout)

    def test_a_crash_is_not_a_size_limit(self):
        run, result = self.run_program({"LIMIT": "300", "CRASH_AT": "256"}, "--start", "64")
        self.assertEqual(run.returncode, 1)
        self.assertFalse(result["complete"])
        self.assertEqual(result["largest"], 128)
        self.assertIn("batch 256 failed with exit status 101, not for memory", result["stopped"])

    def test_arguments_are_checked_before_any_try(self):
        for args, needle in (
            (["--start", "0"], "must be positive"),
            (["--seconds", "0"], "positive budget"),
        ):
            run, result = self.run_program({"LIMIT": "1"}, *args)
            self.assertEqual(run.returncode, 2, args)
            self.assertIn(needle, run.stderr)
            self.assertIsNone(result)
        run = subprocess.run(
            [sys.executable, os.path.join(HERE, "max_batch.py"), "--", "true"],
            capture_output=True, text=True, timeout=60,
        )
        self.assertEqual(run.returncode, 2)
        self.assertIn("has no {batch}", run.stderr)


if __name__ == "__main__":
    unittest.main()
