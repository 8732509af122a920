"""Triton compilations seen by this process, so a worker can say when a
request paid for one.

Triton compiles a kernel once per specialization: its constexprs and, for
each integer argument not marked `do_not_specialize`, whether it is 1 or a
multiple of 16. A size that changes per request (a token count, a page
table's width) therefore reaches new variants long after start-up, and a
compile costs the request that meets it 0.3-3 s on an H200. The kernels
mark such arguments; this watch is how a missed one shows up: the worker
logs each request that compiled anything (kernel names and seconds).

The hook is Triton's process-wide `knobs.runtime` pair (called before and
after each compile, or load from the on-disk cache); one watch per process,
installed by the worker's main. Off CUDA (the interpreter) nothing compiles.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Compile:
    kernel: str
    seconds: float


@dataclass
class CompileWatch:
    """Collects compiles between `take()` calls; thread-safe (a worker's GPU
    thread compiles, its event loop reads)."""
    _started: dict[str, float] = field(default_factory=dict)
    _done: list[Compile] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> "CompileWatch":
        from triton import knobs

        before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

        def on_start(*, key, repr, fn, **kwargs):
            with self._lock:
                self._started[str(key)] = time.perf_counter()
            # a true return would tell Triton to skip the compile
            return before(key=key, repr=repr, fn=fn, **kwargs) if before else None

        def on_end(*, key, repr, fn, **kwargs):
            with self._lock:
                start = self._started.pop(str(key), None)
                if start is not None:
                    self._done.append(Compile(fn.name, time.perf_counter() - start))
            return after(key=key, repr=repr, fn=fn, **kwargs) if after else None

        knobs.runtime.jit_cache_hook = on_start
        knobs.runtime.jit_post_compile_hook = on_end
        return self

    def take(self) -> list[Compile]:
        """The compiles finished since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done


def watch_compiles(device) -> CompileWatch | None:
    """A worker's watch, installed; None off CUDA (nothing compiles there)."""
    return CompileWatch().install() if device.type == "cuda" else None


def describe(compiles: list[Compile]) -> str:
    """'3 Triton compiles, 2.41 s: _paged_attention_kernel 1.90 s, ...' (slowest first)."""
    ordered = sorted(compiles, key=lambda c: -c.seconds)
    total = sum(c.seconds for c in compiles)
    names = ", ".join(f"{c.kernel} {c.seconds:.2f} s" for c in ordered[:6])
    more = f", and {len(ordered) - 6} more" if len(ordered) > 6 else ""
    return f"{len(compiles)} Triton compile(s), {total:.2f} s: {names}{more}"
