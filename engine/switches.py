"""The A/B switches the GPU fast path reads from the environment: one reader,
so a mistyped value is an error that names the variable, not a silent default."""
from __future__ import annotations

import os


def on_off(name: str, default: bool, on: str, off: str) -> bool:
    """`name` as "1" (on) or "0" (off), `default` when unset; `on` / `off`
    say in the error what each value does."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: give 1 ({on}) or 0 ({off})")
    return value == "1"


def one_of(name: str, default: int | None, choices: tuple[int, ...]) -> int | None:
    """`name` as one of the integers `choices`, `default` when unset; the
    error lists them."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in tuple(map(str, choices)):
        listed = ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
        raise ValueError(f"{name}={value!r}: give {listed}")
    return int(value)
