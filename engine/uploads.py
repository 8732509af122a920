"""Host values to device tensors without a stream sync.

`torch.tensor(values, device="cuda")` and a plain `.to("cuda")` copy from
pageable memory, and PyTorch then waits for that copy: a stream sync, which
drains the queue of launched kernels and leaves the GPU idle while the host
launches the next ones. Inside a forward that cost the 27B agent turn ~0.1 s
(BENCHMARKS.md, 2026-12-02). Staging through pinned memory and copying with
non_blocking=True queues the copy behind the stream's work instead; torch's
caching host allocator keeps the pinned block until the copy has run (it
records an event on the stream), so the staging cannot be overwritten early.
"""
from __future__ import annotations

from typing import Sequence

import torch


def upload(values: Sequence | torch.Tensor, dtype: torch.dtype,
           device: torch.device | str) -> torch.Tensor:
    """values as a `dtype` tensor on `device`; on CUDA an asynchronous copy."""
    host = (values.to(dtype) if isinstance(values, torch.Tensor)
            else torch.tensor(values, dtype=dtype))
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
