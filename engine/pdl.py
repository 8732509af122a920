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

When a kernel lets the next one launch is a second choice
(`TANDEM_PDL_RELEASE`, pdl_release). By default a program waits, then
releases: the next kernel is placed only once this one's programs run, so
a chain of ~1 us kernels (norm, q/k norm + rotary, KV write, attention,
combine, gate) pays each launch's latency in turn, and a GEMV after a norm
can start reading its weights only once the GEMV before the norm is done.
Released first, a kernel's dependents are placed while it still waits, and
theirs while they wait: the launches run ahead of the work, each kernel's
weights and states load while the kernels before it run. The order of
memory stays as it was: `griddepcontrol.wait` returns only once the kernel
before has finished, which it does only after its own wait returned, so
every kernel earlier in the stream has finished by then too. What a kernel
may read before its wait changes: no longer "all but the kernel before have
finished", only "nothing in the stream writes it" (weights, and GDN states,
which one forward writes once per layer: gdn_kernels.recurrence_state_early).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.gpu_facts import capability_major
from engine.switches import on_off, one_of

PDL_ENV = "TANDEM_PDL"
RELEASE_ENV = "TANDEM_PDL_RELEASE"
# pdl_release's values: 0 waits before it releases, 1 the Triton kernels
# release first, 2 the CUDA GEMVs (engine/quant/q4_gemv.cu) too
RELEASE_AFTER_WAIT, RELEASE_FIRST, RELEASE_FIRST_EVERYWHERE = 0, 1, 2
# the PDL constexpr of a Triton kernel that releases first (True: waits first)
_PDL_RELEASE_FIRST = 2


def pdl_capable(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return capability_major(device) >= 9


def pdl_wanted() -> bool:
    return on_off(PDL_ENV, True, on="dependent launches", off="off")


def pdl_release() -> int:
    """When a dependent-launch kernel lets the next one launch
    (TANDEM_PDL_RELEASE; read per launch, in a CUDA graph at capture):
    RELEASE_AFTER_WAIT (0), RELEASE_FIRST (1: the Triton kernels, before
    their wait) or RELEASE_FIRST_EVERYWHERE (2: the CUDA GEMVs too)."""
    return one_of(RELEASE_ENV, RELEASE_AFTER_WAIT,
                  (RELEASE_AFTER_WAIT, RELEASE_FIRST, RELEASE_FIRST_EVERYWHERE))


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of a kernel taking `PDL: tl.constexpr`: PDL is
    False (off), True (wait, then release) or 2 (release, then wait)."""
    if pdl_capable(device) and pdl_wanted():
        release_first = pdl_release() != RELEASE_AFTER_WAIT
        return {"PDL": _PDL_RELEASE_FIRST if release_first else True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the kernel before (and so for every kernel before it) and
    let the next one launch: after the wait (PDL True), its programs take
    the SMs this grid's last programs leave; before it (PDL 2), they are
    placed while this one still waits (the module's docstring says why
    both orders keep memory in order)."""
    if PDL == 2:  # _PDL_RELEASE_FIRST
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
