"""Building kernels for the H200 (sm_90) without a GPU: a script run in a
fresh interpreter with TRITON_INTERPRET=0 (triton reads it once, at import),
compiled by Triton's own ptxas, so a kernel that only the interpreter
accepts fails in CI rather than on the device machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def run_sm90_script(script: str, timeout: int = 300) -> str:
    """The script's stdout; skips where this triton has no bundled ptxas."""
    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    done = subprocess.run([sys.executable, "-c", script],
                          env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
