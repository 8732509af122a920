"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A batch-1 decode step of the 27B shape is ~880 kernels; inside its CUDA
graph the GPU still idles between two dependent kernels while the next one
is launched and its programs are placed (1.73 ms of an 8.78 ms int4 step on
the H200, 2026-12-02, bench.profile_step). On sm_90 and newer a kernel
launched with PDL may start while the one before it finishes: its programs
are placed early and wait in `griddepcontrol.wait` until the earlier grid
has completed and its writes are visible.

The contract every kernel taking `PDL` keeps (`pdl_prologue` first thing):
each program waits before it reads anything an earlier kernel wrote and
before it writes anything (the graph's memory pool may hand it a buffer an
earlier kernel still reads), so ordering holds transitively down the
stream; it then lets its own dependents launch. Kernels of other libraries
(cuBLAS, PyTorch) launch as before and wait for full completion.

`TANDEM_PDL=0` turns it off (read per launch; inside a CUDA graph, at
capture): the A/B switch of bench.decode / bench.quant. Off the GPU (the
interpreter, CPU tensors) and before sm_90 there is nothing to turn on.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.gpu_facts import capability_major
from engine.switches import on_off

PDL_ENV = "TANDEM_PDL"


def pdl_capable(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return capability_major(device) >= 9


def pdl_wanted() -> bool:
    return on_off(PDL_ENV, True, on="dependent launches", off="off")


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of a kernel taking `PDL: tl.constexpr`."""
    if pdl_capable(device) and pdl_wanted():
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


RELEASE_FIRST_ENV = "TANDEM_PDL_RELEASE_BEFORE_GEMV"


def release_first_launch(device: torch.device) -> dict:
    """pdl_launch's keywords for a small kernel whose next kernel is a
    persistent GEMV (the layer norms, GDN's gated norm, attention's split
    combine), which take `RELEASE_FIRST: tl.constexpr` too. With
    TANDEM_PDL_RELEASE_BEFORE_GEMV=1 (off) it lets the GEMV launch before
    its own wait, so the GEMV's blocks are placed, and ask for their first
    tiles, while the GEMV before still runs, as they are behind another
    GEMV. On an H100 it lost 0.22 ms (12-07 15:25), where a GEMV after a
    norm runs only ~0.8 us over its back-to-back time; on the H200 that
    cold start is ~2.5 us and the launch boundary GEMV -> norm -> GEMV
    ~4.5 us against ~0.4 for GEMV -> GEMV (12-07 17:58), so it is back,
    off, for one H200 A/B (scripts/sessions/device_next74.sh). Memory order
    is the same either way: the GEMV's wait returns only once this kernel
    has finished, which it does only after its own wait."""
    first = on_off(RELEASE_FIRST_ENV, False, on="released before the wait",
                   off="released after it")
    launch = pdl_launch(device)
    return {**launch, "RELEASE_FIRST": first and launch["PDL"]}


@triton.jit
def pdl_prologue(PDL: tl.constexpr, RELEASE_FIRST: tl.constexpr = False):
    """Wait for the kernel before (and so for every kernel before it), then
    let the next one launch: its programs take the SMs this grid's last
    programs leave, and wait in their own prologue. RELEASE_FIRST: let it
    launch first, then wait (release_first_launch; every Triton kernel
    releasing first lost 0.19-0.21 ms on an H100, 12-06 15:45)."""
    if PDL:
        if RELEASE_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
