"""Why the CUDA GEMV's prologues lose (H200 12-04 21:16: gdn out with the
gated norm 74.9 us against 8.8 for the norm's launch plus the GEMV; gate_up
with the add_rms_norm 36.3 against 28.1): each variant's NVRTC build as the
driver sees it (registers, local and static shared bytes, blocks an SM, the
grid) and its time (bench.gemv_cuda's graph of 16 launches, weight copies
cycled past L2), with and without PDL.

    python3 scripts/sessions/prologue_probe.py [plain gated norm silu] [--few]
"""
from __future__ import annotations

import ctypes

import torch

from bench.quant import _copies, _time_graph, model_shapes
from engine.quant.gemv_cuda import (GatedNormPrologue, NormPrologue, SiluPrologue, _compiled,
                                    build_options, gemv_cuda, plan_for)

_ATTRIBUTES = {"regs": 4, "local_bytes": 3, "shared_bytes": 1}


def attributes(compiled) -> dict:
    from torch.cuda._utils import _get_gpu_runtime_library

    lib, out = _get_gpu_runtime_library(), {"resident_per_sm": compiled.resident_per_sm}
    for name, attribute in _ATTRIBUTES.items():
        value = ctypes.c_int(0)
        lib.cuFuncGetAttribute(ctypes.byref(value), attribute, compiled.function)
        out[name] = value.value
    return out


def timed_us(fn, copies, few: bool) -> float:
    """Graph-timed as bench.gemv_cuda (16 launches back to back); under ncu
    (few) five eager launches, untimed."""
    if few:
        for i in range(5):
            fn(copies[i % len(copies)])
        torch.cuda.synchronize()
        return 0.0
    return _time_graph([(lambda q=copies[i % len(copies)]: fn(q)) for i in range(16)]) * 1e6


def main(argv: list[str]) -> None:
    """argv: the prologue kinds to run (default all) and, under ncu, few launches"""
    few = "--few" in argv
    wanted = [a for a in argv if not a.startswith("--")]
    device = torch.device("cuda")
    from engine.quant.recipes import Q4_K

    shapes = {name: (n, k) for name, fmt, n, k, _ in model_shapes() if fmt is Q4_K}
    rows = []
    for name, kind in (("gdn out", "plain"), ("gdn out", "gated"), ("gate_up", "plain"),
                       ("gate_up", "norm"), ("down", "plain"), ("down", "silu")):
        if wanted and kind not in wanted:
            continue
        n, k = shapes[name]
        copies = _copies(Q4_K, n, k, device)
        plan = plan_for(k, rows=4)
        out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
        x = torch.randn(1, 2 * k if kind == "silu" else k, device=device, dtype=torch.bfloat16)
        prologue = None
        if kind == "gated":
            prologue = GatedNormPrologue(torch.randn(1, k, device=device, dtype=torch.bfloat16),
                                         torch.randn(128, device=device,
                                                     dtype=torch.bfloat16) * 0.1 + 1, 1e-6)
        elif kind == "norm":
            prologue = NormPrologue(torch.randn(k, device=device, dtype=torch.bfloat16) * 0.1,
                                    1e-6, True, torch.randn_like(x), torch.empty_like(x))
        elif kind == "silu":
            prologue = SiluPrologue()
        qt = copies[0]
        compiled = _compiled(build_options(plan, qt.superblock, qt.asymmetric,
                                           qt.d.dtype == torch.float32, True, prologue),
                             0, plan.threads)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        for pdl in (True, False):
            us = timed_us(lambda q: gemv_cuda(x, q, out=out, plan=plan, pdl=pdl,
                                              prologue=prologue), copies, few)
            rows.append({"matrix": name, "prologue": kind, "pdl": pdl, "threads": plan.threads,
                         "grid": plan.grid(n, sms, compiled.resident_per_sm), "us": round(us, 2),
                         **attributes(compiled)})
            print(rows[-1], flush=True)
        del copies


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
