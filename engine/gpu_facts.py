"""Fixed facts of the GPU a process computes on, looked up once per device.

Kernel launchers size their grids by the SM count; off the GPU (CPU tensors
under the Triton interpreter) each caller names its own stand-in, because
what its CPU tests need differs: the GEMVs take the H200's 132 so that the
tests run the grids the GPU runs, the attention's key splits a small count
so that short test contexts still split and merge."""
from __future__ import annotations

import torch

_SMS: dict[int, int] = {}  # per device index: fixed while the process lives


def multiprocessors(device: torch.device, off_gpu: int) -> int:
    """The SM count of `device`, or `off_gpu` when it is not a CUDA device."""
    if device.type != "cuda":
        return off_gpu
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


_MAJOR: dict[int, int] = {}


def capability_major(device: torch.device) -> int:
    """The major compute capability of a CUDA device (9 for Hopper); 0 off the GPU."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MAJOR:
        _MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return _MAJOR[index]
