"""CUDA streams for the two workers that share one GPU: decode on the
highest-priority stream, prefill on a normal one, so the GPU's block
scheduler runs a decode step's kernels ahead of queued prefill work.

Prefill also bounds how much work it queues: it waits for each chunk to
finish (`yield_to_decode`) before launching the next, so a decode step never
sits behind more than one chunk. On the CPU both are no-ops."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

# torch maps priorities beyond the device's range to its ends: this is the
# highest there is (0 to -3 on an H200, where lower is more urgent).
HIGHEST_PRIORITY = -100
NORMAL_PRIORITY = 0


@contextmanager
def worker_stream(device: torch.device | str, high_priority: bool) -> Iterator[None]:
    """Makes a new stream of the wanted priority current in this thread."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device=device,
                               priority=HIGHEST_PRIORITY if high_priority else NORMAL_PRIORITY)
    with torch.cuda.stream(stream):
        yield


def yield_to_decode(device: torch.device | str) -> None:
    """Between prefill chunks: wait until this thread's queued work is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream().synchronize()
