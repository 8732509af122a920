"""Does a decode or prefill step grow the trimmed thread-stack reservation
back? (issue 7: the decode worker measured 0.79 GiB under NVML with the
trim, as much as without it). Trims the stack limit, then runs the 27B int4
dummy's prefill and decode steps, printing NVML's figure for this process and
the context's stack limit (cuCtxGetLimit) after each stage: a limit above the
trimmed one names the stage whose kernels need a stack or spill to local
memory. Run on the device: `python scripts/device_lmem.py`."""
import ctypes
import os

import pynvml
import torch

from engine.cuda_context import STACK_BYTES, trim_stack_reservation


def report(stage: str, handle) -> None:
    limit = ctypes.c_size_t()
    ctypes.CDLL("libcuda.so.1").cuCtxGetLimit(ctypes.byref(limit), ctypes.c_int(0))
    used = next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                 if p.pid == os.getpid()), 0)
    print(f"{stage:40s} NVML {used / 2**20:7.0f} MiB, torch reserved "
          f"{torch.cuda.memory_reserved() / 2**20:7.0f} MiB, stack limit {limit.value} B",
          flush=True)


def main() -> None:
    from bench.decode import decode_steps
    from engine.loader import load_model

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    trim_stack_reservation("cuda", STACK_BYTES)
    report("trimmed", handle)
    loaded = load_model("qwen3.5-27b", device="cuda", weights="int4", progress=False)
    report("int4 27B loaded", handle)
    decode_steps(loaded, "int8", 1, 4096, 2, cuda_graphs=False)
    report("eager decode steps", handle)
    decode_steps(loaded, "int8", 1, 4096, 3)
    report("graph-captured decode steps", handle)
    decode_steps(loaded, "int8", 4, 4096, 3)
    report("batch-4 decode steps", handle)
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams
    engine = OfflineEngine(loaded, EngineConfig(max_batch=1, max_context=2048,
                                                prefill_chunk=512))
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    list(engine.generate([[(7 * i + 3) % 256 for i in range(1024)]], params))
    report("1024-token prefill in 512 chunks", handle)


if __name__ == "__main__":
    main()
