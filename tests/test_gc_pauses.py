"""A service process freezes its start-up heap out of the garbage collector's
reach and logs the collections that still pause it (tandem/serving.py)."""
import subprocess
import sys

PROGRAM = """
import gc, sys
import torch  # the bulk of a worker's start-up heap
from tandem import serving
before = len(gc.get_objects())
serving.settle_the_heap("worker")
serving.settle_the_heap("worker")  # a second server in one process: one report
print(gc.get_freeze_count(), before, len(gc.get_objects()), sep=",")
serving.GC_PAUSE_REPORT_S = 0.0
print("collect", file=sys.stderr)
gc.collect()
print("collected", file=sys.stderr, flush=True)
"""


def test_start_up_objects_leave_the_collector_and_pauses_are_reported():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          timeout=120, check=True)
    frozen, tracked_before, tracked_after = map(int, done.stdout.strip().split(","))
    assert frozen >= tracked_before // 2 and tracked_after < tracked_before // 10
    lines = done.stderr.splitlines()
    during = lines[lines.index("collect") + 1:lines.index("collected")]
    assert len(during) == 1 and during[0].startswith(
        "worker: garbage collection (generation 2) paused the process"), done.stderr
