"""Starts, watches and stops the child processes of one `tandem serve`.

Owns: launching children in order, each gated on its gRPC health check;
forwarding their output to our stderr prefixed with their name (keeping the
last lines for error messages); restarting the restartable ones, loudly and
within a budget; stopping all of them in reverse order on SIGINT/SIGTERM, on a
fatal child death, or on any exception of our own.

Must not know what the children are (kvstore, prefill, ...), their flags or
their protocols beyond grpc.health.v1: the CLI builds the `ProcessSpec`s.

Children stay in our process group (start_new_session=False), so a Ctrl-C at
the terminal reaches them too, and on Linux each is started with a parent-death
signal (SIGTERM), so even a SIGKILLed supervisor leaves no orphans. That signal
follows the *thread* that started the child: call start() and run() from one
long-lived thread (the main thread in the CLI).
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from engine.errors import TandemError
from tandem.healthcheck import HealthProbe

STDERR_TAIL_LINES = 20
HEALTH_POLL_S = 0.05
STOP_GRACE_S = 10.0
# After a child is seen dead, how long to wait for a SIGINT/SIGTERM of our own
# to be noticed: a terminal Ctrl-C reaches the children and us at once, and a
# child dying of it is a shutdown, not a crash.
SIGNAL_GRACE_S = 0.2

# Run as `python -S -c _DIE_WITH_PARENT PPID ARGV...`: asks Linux to SIGTERM
# this process when its parent dies (PR_SET_PDEATHSIG = 1), gives up if the
# parent is already gone, then becomes ARGV (same pid, the setting survives exec).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class StartupError(TandemError):
    """A child exited, or never reported SERVING, while being started."""

    def __init__(self, message: str, name: str, exit_code: int | None = None,
                 stderr_tail: list[str] | None = None):
        super().__init__(message)
        self.name = name
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail or []


class StartupInterrupted(StartupError):
    """A stop was asked for (stop_event, SIGINT, SIGTERM) while starting."""


@dataclass(frozen=True)
class ProcessSpec:
    """How to start one child and how to tell that it is ready.

    health_target: a gRPC target (`unix:///dir/x.sock`, `127.0.0.1:50051`)
    serving grpc.health.v1, or an `http://` URL answering GET with 200; the
    child counts as started once service "" is SERVING there. restartable: a death is reported and the child restarted
    (within the supervisor's budget); otherwise a death stops everything.
    """
    name: str
    argv: tuple[str, ...]
    health_target: str
    restartable: bool = False
    start_timeout_s: float = 60.0
    # extra environment variables (a secret such as an API key goes here, not
    # in argv, which every user of the machine can read)
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "env", tuple(tuple(kv) for kv in self.env))
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"process name {self.name!r} must be a non-empty word")
        if not self.argv or not all(isinstance(a, str) and a for a in self.argv):
            raise ValueError(f"{self.name}: argv must be non-empty strings, got {self.argv!r}")
        if not self.health_target:
            raise ValueError(f"{self.name}: health_target is empty")
        if not self.start_timeout_s > 0:
            raise ValueError(f"{self.name}: start_timeout_s must be > 0, "
                             f"got {self.start_timeout_s}")


class RestartBudget:
    """At most `per_minute` restarts in any sliding minute, with exponential
    backoff (backoff_s, doubling per recent restart, capped at max_backoff_s)."""

    def __init__(self, per_minute: int, backoff_s: float, max_backoff_s: float,
                 clock=time.monotonic):
        self.per_minute = per_minute
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.total = 0
        self._recent: collections.deque[float] = collections.deque()
        self._clock = clock

    def spend(self) -> int | None:
        """Takes one restart: its number since start-up, or None when spent."""
        now = self._clock()
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) >= self.per_minute:
            return None
        self._recent.append(now)
        self.total += 1
        return self.total

    def delay_s(self) -> float:
        """How long to wait before the restart just spent."""
        return min(self.backoff_s * 2 ** max(len(self._recent) - 1, 0), self.max_backoff_s)


class _Child:
    """One running instance of a spec: the process and a thread forwarding its
    output line by line (prefixed) while keeping the last lines."""

    def __init__(self, spec: ProcessSpec, process: subprocess.Popen, emit):
        self.spec = spec
        self.process = process
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._emit = emit
        self._reader = threading.Thread(target=self._forward, daemon=True,
                                        name=f"tandem-{spec.name}-output")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    def _forward(self) -> None:
        for raw in self.process.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.tail.append(line)
            self._emit(f"[{self.spec.name}] {line}")

    def last_lines(self, wait_s: float = 1.0) -> list[str]:
        """The tail, after waiting up to wait_s for the reader to reach EOF."""
        self._reader.join(wait_s)
        return list(self.tail)

    def terminate(self, grace_s: float, say) -> None:
        """SIGTERM, wait up to grace_s, then SIGKILL; always reaps."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                say(f"{self.spec.name} did not stop within {grace_s:g} s; killing it")
                self.process.kill()
                self.process.wait()
        self._reader.join(1.0)
        if not self._reader.is_alive():  # else a grandchild still holds the pipe
            self.process.stdout.close()


class Supervisor:
    """Runs `specs` as child processes: start() (in order, health-gated),
    run() (watch until a stop or a fatal death), stop() (reverse order).

    `stop_event` is what SIGINT/SIGTERM set (inside `with supervisor:`, which
    installs the handlers when on the main thread); tests set it directly.
    """

    def __init__(self, specs: list[ProcessSpec], log: TextIO | None = None, *,
                 max_restarts_per_minute: int = 5, restart_backoff_s: float = 0.1,
                 max_restart_backoff_s: float = 5.0, stop_grace_s: float = STOP_GRACE_S):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.specs = list(specs)
        self.stop_event = threading.Event()
        self._log = log if log is not None else sys.stderr
        self._log_lock = threading.Lock()
        self._stop_grace_s = stop_grace_s
        self._children: dict[str, _Child] = {}
        self._budgets = {s.name: RestartBudget(max_restarts_per_minute, restart_backoff_s,
                                               max_restart_backoff_s) for s in specs}
        self._stop_lock = threading.Lock()
        self._saved_handlers: dict[int, object] = {}

    # -- the public lifecycle ------------------------------------------------

    def start(self) -> None:
        """Starts every spec in order, each only once the previous is SERVING.
        On any failure stops what was started and raises (StartupError for a
        child that exited or timed out, StartupInterrupted for a stop)."""
        try:
            for spec in self.specs:
                self._start_healthy(spec)
        except BaseException:
            self.stop()
            raise

    def run(self) -> int:
        """Blocks until stop_event is set (returns 0) or a child dies for good
        (returns 1): a non-restartable one, or a restartable one whose restart
        budget is spent. Stops every child before returning or raising."""
        try:
            while not self.stop_event.wait(HEALTH_POLL_S):
                child = self._first_exited()
                if child is None:
                    continue
                if self.stop_event.wait(SIGNAL_GRACE_S):
                    break
                if not self._recover(child):
                    return 1
            return 0
        finally:
            self.stop()

    def stop(self) -> None:
        """Stops every child, last started first: SIGTERM, up to stop_grace_s,
        then SIGKILL. Idempotent and safe from any thread."""
        self.stop_event.set()
        with self._stop_lock:
            for child in reversed(list(self._children.values())):
                child.terminate(self._stop_grace_s, self._say)

    def pids(self) -> dict[str, int]:
        """Current pid of each started child (a restart changes it)."""
        return {name: child.pid for name, child in self._children.items()}

    def __enter__(self) -> "Supervisor":
        self._install_signal_handlers()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_signal_handlers()

    # -- starting ------------------------------------------------------------

    def _start_healthy(self, spec: ProcessSpec) -> _Child:
        child = self._launch(spec)
        try:
            self._await_serving(child)
        except BaseException:
            child.terminate(self._stop_grace_s, self._say)
            raise
        return child

    def _launch(self, spec: ProcessSpec) -> _Child:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(spec.env))
        process = subprocess.Popen(_with_parent_death_signal(spec.argv), env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=False)
        child = _Child(spec, process, self._write_line)
        self._children[spec.name] = child
        return child

    def _await_serving(self, child: _Child) -> None:
        spec = child.spec
        deadline = time.monotonic() + spec.start_timeout_s
        with HealthProbe(spec.health_target) as probe:
            while True:
                code = child.exit_code()
                if code is not None:
                    raise self._exited_during_start(child, code)
                if probe.serving(timeout_s=max(min(1.0, deadline - time.monotonic()), 0.05)):
                    return
                if self.stop_event.is_set():
                    raise StartupInterrupted(f"stopped while starting {spec.name}", spec.name)
                if time.monotonic() > deadline:
                    raise self._timed_out(child)
                self.stop_event.wait(HEALTH_POLL_S)

    def _exited_during_start(self, child: _Child, code: int) -> StartupError:
        tail = child.last_lines()
        return StartupError(f"{child.spec.name} exited with code {code} during start-up"
                            + _tail_text(tail), child.spec.name, code, tail)

    def _timed_out(self, child: _Child) -> StartupError:
        spec = child.spec
        tail = list(child.tail)
        return StartupError(f"{spec.name} did not report SERVING on {spec.health_target} within "
                            f"{spec.start_timeout_s:g} s" + _tail_text(tail), spec.name, None, tail)

    # -- watching and restarting -----------------------------------------------

    def _first_exited(self) -> _Child | None:
        return next((c for c in self._children.values() if c.exit_code() is not None), None)

    def _recover(self, child: _Child) -> bool:
        """Handles one dead child: True when it is serving again (or a stop
        came meanwhile), False when everything must stop."""
        code = child.exit_code()
        child.terminate(0, self._say)  # reaps and closes its pipe
        if not child.spec.restartable:
            self._say(f"{child.spec.name} exited with code {code}")
            return False
        return self._restart(child.spec, code)

    def _restart(self, spec: ProcessSpec, code: int | None) -> bool:
        budget = self._budgets[spec.name]
        while True:
            number = budget.spend()
            if number is None:
                self._say(f"{spec.name} exited with code {code}; it was restarted "
                          f"{budget.per_minute} times in the last minute; giving up")
                return False
            self._say(f"{spec.name} exited with code {code}; restarting (restart {number})")
            if self.stop_event.wait(budget.delay_s()):
                return True
            try:
                self._start_healthy(spec)
            except StartupInterrupted:
                return True
            except StartupError as e:
                self._say(str(e))
                code = e.exit_code
                continue
            self._say(f"{spec.name} is serving again (restart {number})")
            return True

    # -- signals and output --------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        while self._saved_handlers:
            sig, handler = self._saved_handlers.popitem()
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        # Set the event from another thread: the handler runs on the main
        # thread, which may be inside stop_event.wait() holding the event's
        # lock, and setting it here could then deadlock.
        if not self.stop_event.is_set():
            threading.Thread(target=self.stop_event.set, daemon=True).start()

    def _say(self, message: str) -> None:
        self._write_line(f"tandem: {message}")

    def _write_line(self, line: str) -> None:
        with self._log_lock:
            self._log.write(line + "\n")
            self._log.flush()


def _with_parent_death_signal(argv: tuple[str, ...]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def _tail_text(lines: list[str]) -> str:
    if not lines:
        return " (it wrote nothing)"
    return "; its last output:\n" + "\n".join(f"    {line}" for line in lines)

