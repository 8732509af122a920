"""What every benchmark shares: timing, a short table printed last, JSON out."""
from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path


def now() -> float:
    return time.perf_counter()


def median(values: list[float]) -> float:
    return statistics.median(values)


def environment() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [headers] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.4f}"
    return str(value)
