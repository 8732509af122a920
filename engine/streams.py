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


class WorkerStream:
    """A worker's CUDA stream of the wanted priority, made once and entered for
    each unit of work (`with stream.active():`). Once matters: PyTorch's
    caching allocator reuses a freed block only for the stream it was
    allocated on, so a fresh stream per request would find none of the
    memory earlier requests freed, allocate everything anew and, once the
    card fills, flush every cached block. (It was first blamed for the 27B
    agent turns' 1.5-5 s spikes in the prefill worker; those were Triton
    compiles, see engine/compiles.py.)"""

    def __init__(self, device: torch.device | str, high_priority: bool) -> None:
        device = torch.device(device)
        priority = HIGHEST_PRIORITY if high_priority else NORMAL_PRIORITY
        self.stream = (torch.cuda.Stream(device=device, priority=priority)
                       if device.type == "cuda" else None)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Makes the stream current in this thread (a no-op off CUDA)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield


def yield_to_decode(device: torch.device | str) -> None:
    """Between prefill chunks: wait until this thread's queued work is done."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream().synchronize()
