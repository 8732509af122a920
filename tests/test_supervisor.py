"""The supervisor with real child processes: small scripts that serve
grpc.health.v1 on a unix socket after a delay (or crash, hang, ignore SIGTERM),
and the argv `tandem serve` builds for its four processes."""
from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tandem.cli import build_parser, serve_specs
from tandem.supervisor import (ProcessSpec, RestartBudget, StartupError, StartupInterrupted,
                               Supervisor)

# argv: NAME SOCKET DELAY EVENTS_FILE [MODE]; MODE is serve (default), crash,
# hang (never listens), stubborn (ignores SIGTERM), or crash-if:FILE (serves
# only while FILE does not exist).
CHILD = r'''
import os, signal, sys, threading, time
from concurrent import futures

name, sock, delay, events = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
mode = sys.argv[5] if len(sys.argv) > 5 else "serve"

def event(what):
    with open(events, "a") as f:
        f.write(f"{what} {name} {os.getpid()}\n")

event("start")
print(f"{name} starting", file=sys.stderr, flush=True)
if mode == "crash" or (mode.startswith("crash-if:") and os.path.exists(mode[9:])):
    for i in range(30):
        print(f"{name} says line {i}", file=sys.stderr)
    sys.exit(3)
stop = threading.Event()
# set from another thread, as the supervisor does: the handler runs on the main
# thread, which may hold the event's lock inside stop.wait(), and setting it
# there deadlocks now and then (an orphan that never exits, seen under load)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else
              lambda *a: threading.Thread(target=stop.set, daemon=True).start())
if mode == "hang":
    stop.wait()
    sys.exit(0)
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
time.sleep(delay)
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port(f"unix://{sock}")
server.start()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
event("serving")
print(f"{name} serving", file=sys.stderr, flush=True)
while not stop.wait(0.1):
    pass
server.stop(0).wait(2)
event("stopped")
os._exit(0)  # do not wait on grpc's worker threads at interpreter exit
'''


@pytest.fixture
def rig(tmp_path):
    """Makes specs for CHILD; sockets live in a short private directory
    (unix socket paths are limited to 107 bytes)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    events = tmp_path / "events.txt"
    socket_dir = tempfile.mkdtemp(prefix="tandem-test-")

    class Rig:
        def spec(self, name, delay=0.2, mode="serve", restartable=False, timeout=20.0):
            sock = os.path.join(socket_dir, f"{name}.sock")
            argv = [sys.executable, str(script), name, sock, str(delay), str(events), mode]
            return ProcessSpec(name, argv, f"unix://{sock}", restartable, timeout)

        def events(self) -> list[tuple[str, str]]:
            if not events.exists():
                return []
            return [tuple(line.split()[:2]) for line in events.read_text().splitlines()]

        def our_children(self) -> list[int]:
            """Live processes whose parent is this test process, running CHILD."""
            found = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                state, ppid = fields[0], int(fields[1])
                if ppid == os.getpid() and state != "Z" and str(script).encode() in cmdline:
                    found.append(int(entry.name))
            return found

    yield Rig()
    shutil.rmtree(socket_dir, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_in_thread(supervisor):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", supervisor.run()))
    thread.start()
    return thread, result


def test_starts_in_order_each_after_the_previous_is_serving_and_stop_leaves_nothing(rig):
    log = io.StringIO()
    sup = Supervisor([rig.spec("store", delay=0.4), rig.spec("worker", delay=0.2),
                      rig.spec("front", delay=0.1)], log=log)
    sup.start()
    try:
        assert rig.events() == [("start", "store"), ("serving", "store"),
                                ("start", "worker"), ("serving", "worker"),
                                ("start", "front"), ("serving", "front")]
        pids = sup.pids()
        assert sorted(pids) == ["front", "store", "worker"] and all(map(alive, pids.values()))
    finally:
        sup.stop()
    assert not any(alive(pid) for pid in pids.values())
    assert rig.our_children() == []
    # stopped last-started first, each cleanly on SIGTERM
    assert [e for e in rig.events() if e[0] == "stopped"] == [
        ("stopped", "front"), ("stopped", "worker"), ("stopped", "store")]
    assert "[store] store serving" in log.getvalue()  # output forwarded with its name


def test_child_exiting_during_start_raises_with_its_output_and_stops_the_others(rig):
    sup = Supervisor([rig.spec("store"), rig.spec("worker", mode="crash"), rig.spec("front")],
                     log=io.StringIO())
    with pytest.raises(StartupError) as info:
        sup.start()
    err = info.value
    assert err.name == "worker" and err.exit_code == 3
    message = str(err)
    assert "worker exited with code 3 during start-up" in message
    assert "worker says line 29" in message and "worker says line 10" in message
    assert "worker says line 9" not in message  # only the last 20 lines
    assert not alive(sup.pids()["store"])
    assert ("start", "front") not in rig.events()
    assert rig.our_children() == []


def test_child_that_never_serves_times_out(rig):
    sup = Supervisor([rig.spec("store", mode="hang", timeout=1.0)], log=io.StringIO())
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"store did not report SERVING on unix://.* within 1 s"):
        sup.start()
    assert time.monotonic() - t0 < 5
    assert rig.our_children() == []


def test_killed_restartable_child_is_reported_and_restarted_healthy(rig):
    log = io.StringIO()
    sup = Supervisor([rig.spec("store"), rig.spec("decode", restartable=True)], log=log)
    sup.start()
    thread, result = run_in_thread(sup)
    try:
        old = sup.pids()["decode"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: "decode is serving again" in log.getvalue(), what="the restart")
        assert "tandem: decode exited with code -9; restarting (restart 1)" in log.getvalue()
        new = sup.pids()["decode"]
        assert new != old and alive(new) and alive(sup.pids()["store"])
        assert rig.events().count(("serving", "decode")) == 2
        assert thread.is_alive()
    finally:
        sup.stop_event.set()
        thread.join(30)
    assert result["rc"] == 0
    assert rig.our_children() == []


def test_restart_budget_spent_stops_everything(rig, tmp_path):
    marker = tmp_path / "broken"
    log = io.StringIO()
    sup = Supervisor([rig.spec("store"), rig.spec("decode", restartable=True,
                                                  mode=f"crash-if:{marker}")],
                     log=log, max_restarts_per_minute=2, restart_backoff_s=0.05)
    sup.start()
    marker.touch()  # from now on every restart crashes during start-up
    thread, result = run_in_thread(sup)
    os.kill(sup.pids()["decode"], signal.SIGKILL)
    thread.join(30)
    assert result["rc"] == 1
    text = log.getvalue()
    assert "restarting (restart 1)" in text and "restarting (restart 2)" in text
    assert "decode exited with code 3 during start-up" in text
    assert ("decode exited with code 3; it was restarted 2 times in the last minute; "
            "giving up") in text
    assert rig.our_children() == []


def test_killed_non_restartable_child_stops_the_rest_and_run_returns_1(rig):
    log = io.StringIO()
    sup = Supervisor([rig.spec("store"), rig.spec("decode", restartable=True),
                      rig.spec("front")], log=log)
    sup.start()
    pids = sup.pids()
    thread, result = run_in_thread(sup)
    os.kill(pids["store"], signal.SIGKILL)
    thread.join(30)
    assert result["rc"] == 1
    assert "tandem: store exited with code -9" in log.getvalue()
    assert "restarting" not in log.getvalue()
    assert not any(alive(pid) for pid in pids.values())
    assert rig.our_children() == []


def test_sigterm_stops_everything_cleanly_and_run_returns_0(rig):
    sup = Supervisor([rig.spec("store"), rig.spec("front")], log=io.StringIO())
    with sup:  # installs the SIGINT/SIGTERM handlers (we are the main thread)
        sup.start()
        pids = sup.pids()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert sup.run() == 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not any(alive(pid) for pid in pids.values())
    assert [e[1] for e in rig.events() if e[0] == "stopped"] == ["front", "store"]


def test_stop_event_during_start_interrupts_it(rig):
    sup = Supervisor([rig.spec("store"), rig.spec("slow", mode="hang")], log=io.StringIO())
    threading.Timer(1.5, sup.stop_event.set).start()
    with pytest.raises(StartupInterrupted):
        sup.start()
    assert rig.our_children() == []


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(rig):
    log = io.StringIO()
    sup = Supervisor([rig.spec("stubborn", mode="stubborn")], log=log, stop_grace_s=0.5)
    sup.start()
    pid = sup.pids()["stubborn"]
    sup.stop()
    assert not alive(pid)
    assert "tandem: stubborn did not stop within 0.5 s; killing it" in log.getvalue()


def test_children_die_with_a_killed_supervisor(rig, tmp_path):
    """A SIGKILLed supervisor leaves no orphans (parent-death signal, Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    spec = rig.spec("store")
    program = tmp_path / "supervise.py"
    program.write_text(
        "import sys, time\n"
        "from tandem.supervisor import ProcessSpec, Supervisor\n"
        f"sup = Supervisor([ProcessSpec('store', {list(spec.argv)!r}, {spec.health_target!r})])\n"
        "sup.start()\n"
        "print(sup.pids()['store'], flush=True)\n"
        "time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    parent = subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, env=env)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait()
        # generous: on a loaded 2-core CI machine the orphan's shutdown was once
        # slower than 5 s; an orphan the signal never reached lives forever
        wait_for(lambda: not alive(child), timeout=20, what=f"the orphan {child} to die")
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if alive(child):
            os.kill(child, signal.SIGKILL)  # never leak it into the rest of the run


def test_restart_budget_slides_over_a_minute_with_doubling_backoff():
    now = [0.0]
    budget = RestartBudget(per_minute=3, backoff_s=0.1, max_backoff_s=0.25, clock=lambda: now[0])
    assert budget.spend() == 1 and budget.delay_s() == pytest.approx(0.1)
    now[0] = 10
    assert budget.spend() == 2 and budget.delay_s() == pytest.approx(0.2)
    now[0] = 20
    assert budget.spend() == 3 and budget.delay_s() == pytest.approx(0.25)
    now[0] = 59
    assert budget.spend() is None
    now[0] = 60  # the first restart left the window
    assert budget.spend() == 4


def test_process_spec_is_validated():
    with pytest.raises(ValueError, match="argv"):
        ProcessSpec("x", [], "unix:///tmp/x.sock")
    with pytest.raises(ValueError, match="name"):
        ProcessSpec("two words", ["true"], "unix:///tmp/x.sock")
    with pytest.raises(ValueError, match="health_target"):
        ProcessSpec("x", ["true"], "")
    with pytest.raises(ValueError, match="start_timeout_s"):
        ProcessSpec("x", ["true"], "unix:///tmp/x.sock", start_timeout_s=0)
    spec = ProcessSpec("x", ["true", "1"], "unix:///tmp/x.sock")
    assert spec.argv == ("true", "1") and not spec.restartable
    with pytest.raises(ValueError, match="unique"):
        Supervisor([spec, spec])


def test_serve_specs_builds_the_five_command_lines(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    d = "/tmp/tandem-abc"
    specs = serve_specs(args, d)
    py = sys.executable
    assert [s.name for s in specs] == ["kvstore", "prefill", "decode", "router", "openai"]
    assert [s.restartable for s in specs] == [False, True, True, False, True]
    assert list(specs[0].argv) == [
        py, "-m", "kvstore.server", "--model", "embedded", "--socket", f"{d}/kvstore.sock",
        "--kv-format", "int8", "--max-context-tokens", "65536",
        "--live-slots", "16", "--snapshot-slots", "64", "--prefill-chunk-tokens", "auto",
        "--device", "cpu", "--speculative", "none", "--draft-tokens", "3"]
    # the store picks the format's page size unless one is given
    paged = serve_specs(build_parser().parse_args(["serve", "--device", "cpu", "--page-size", "32"]),
                        d)[0].argv
    assert list(paged[-2:]) == ["--page-size", "32"]
    assert list(specs[1].argv) == [
        py, "-m", "prefill.server", "--store", f"{d}/kvstore.sock", "--socket",
        f"{d}/prefill.sock", "--device", "cpu"]
    assert list(specs[2].argv) == [
        py, "-m", "decode.server", "--store", f"{d}/kvstore.sock", "--socket",
        f"{d}/decode.sock", "--max-batch", "16", "--device", "cpu"]
    assert list(specs[3].argv) == [
        py, "-m", "router.server", "--store", f"{d}/kvstore.sock", "--prefill",
        f"{d}/prefill.sock", "--decode", f"{d}/decode.sock", "--host", "127.0.0.1",
        "--port", "50051", "--metrics-port", "9464"]
    assert list(specs[4].argv) == [
        py, "-m", "openai_api", "--router", "127.0.0.1:50051", "--host", "127.0.0.1",
        "--port", "8000"]
    assert specs[4].env == (("TANDEM_API_KEY", ""),)  # no key: the gateway asks for none
    assert [s.health_target for s in specs] == [
        f"unix://{d}/kvstore.sock", f"unix://{d}/prefill.sock", f"unix://{d}/decode.sock",
        "127.0.0.1:50051", "http://127.0.0.1:8000/health"]


def test_serve_specs_hand_speculation_to_the_kvstore_only():
    """The store lays out the drafter's memory; the others read it from the store."""
    args = build_parser().parse_args(["serve", "--device", "cpu", "--speculative", "mtp",
                                      "--draft-tokens", "2"])
    specs = serve_specs(args, "/tmp/t")
    assert specs[0].argv[-4:] == ("--speculative", "mtp", "--draft-tokens", "2")
    assert all("--speculative" not in s.argv for s in specs[1:])


def test_serve_specs_http_gateway_flags(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--device", "cpu", "--http-port", "9000"])
    gateway = serve_specs(args, "/tmp/t")[-1]
    assert gateway.argv[-2:] == ("--port", "9000") and "from-env" not in gateway.argv
    assert gateway.env == (("TANDEM_API_KEY", "from-env"),)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--api-key", "sk-1"])
    assert serve_specs(args, "/tmp/t")[-1].env == (("TANDEM_API_KEY", "sk-1"),)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--http-port", "0"])
    assert [s.name for s in serve_specs(args, "/tmp/t")] == ["kvstore", "prefill", "decode",
                                                             "router"]
    from engine.errors import TandemError
    for bad in ("70000", "50051"):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--http-port", bad])
        with pytest.raises(TandemError, match="--http-port"):
            serve_specs(args, "/tmp/t")


def test_prefill_sm_percent_reaches_only_the_prefill_worker_as_its_mps_share():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--prefill-sm-percent", "60"])
    specs = {s.name: s for s in serve_specs(args, "/tmp/t")}
    assert specs["prefill"].env == (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "60"),)
    assert all("CUDA_MPS" not in str(s.env) for n, s in specs.items() if n != "prefill")
    unset = serve_specs(build_parser().parse_args(["serve", "--device", "cpu"]), "/tmp/t")
    assert unset[1].env == ()
    from engine.errors import TandemError
    for bad in ("0", "101"):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--prefill-sm-percent", bad])
        with pytest.raises(TandemError, match="--prefill-sm-percent"):
            serve_specs(args, "/tmp/t")


def test_each_worker_gets_only_its_own_mps_share():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--prefill-sm-percent", "75",
                                      "--decode-sm-percent", "40"])
    specs = {s.name: s for s in serve_specs(args, "/tmp/t")}
    assert specs["prefill"].env == (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "75"),)
    assert specs["decode"].env == (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40"),)
    assert specs["kvstore"].env == () and specs["router"].env == ()
    from engine.errors import TandemError
    args = build_parser().parse_args(["serve", "--device", "cpu", "--decode-sm-percent", "0"])
    with pytest.raises(TandemError, match="--decode-sm-percent must be in 1..100, got 0"):
        serve_specs(args, "/tmp/t")


def test_ports_that_clash_are_refused_before_anything_starts():
    """Two endpoints on one port failed as a bind error in one of the five
    processes, after the weights had loaded."""
    from engine.errors import TandemError

    for flags, message in ((["--metrics-port", "50051"], "--metrics-port 50051"),
                           (["--metrics-port", "8000"], "--metrics-port 8000"),
                           (["--metrics-port", "70000"], "--metrics-port 70000"),
                           (["--grpc-port", "0"], "--grpc-port 0"),
                           (["--http-port", "50051"], "--http-port 50051")):
        args = build_parser().parse_args(["serve", "--device", "cpu", *flags])
        with pytest.raises(TandemError, match=message):
            serve_specs(args, "/tmp/t")
    for flags in (["--metrics-port", "0"], ["--metrics-port", "0", "--http-port", "0"]):
        serve_specs(build_parser().parse_args(["serve", "--device", "cpu", *flags]), "/tmp/t")


def test_serve_specs_passes_the_flags_through():
    args = build_parser().parse_args([
        "serve", "--model", "tiny-qwen3.5", "--host", "0.0.0.0", "--grpc-port", "6000",
        "--metrics-port", "0", "--kv-format", "int8", "--page-size", "32",
        "--max-context-tokens", "4096", "--live-slots", "4", "--snapshot-slots", "8",
        "--max-batch", "8", "--prefill-chunk", "256", "--gpu-memory-budget", "24GiB",
        "--device", "cuda"])
    kvstore, prefill, decode, router, _ = serve_specs(args, "/tmp/t")
    assert kvstore.argv[3:5] == ("--model", "tiny-qwen3.5")
    assert kvstore.argv[-2:] == ("--gpu-memory-budget", "24GiB")
    assert kvstore.argv[kvstore.argv.index("--device") + 1] == "cuda"
    assert "int8" in kvstore.argv and "32" in kvstore.argv and "4096" in kvstore.argv
    # the store plans the chunk and the worker runs the store's
    assert kvstore.argv[kvstore.argv.index("--prefill-chunk-tokens") + 1] == "256"
    assert "--chunk" not in prefill.argv and prefill.argv[-2:] == ("--device", "cuda")
    assert decode.argv[-4:] == ("--max-batch", "8", "--device", "cuda")
    assert router.argv[-6:] == ("--host", "0.0.0.0", "--port", "6000", "--metrics-port", "0")
    assert router.health_target == "127.0.0.1:6000"  # a wildcard bind is probed locally
    args.host = "::"
    assert serve_specs(args, "/tmp/t")[3].health_target == "[::1]:6000"
    args.weights = "int4"  # the store loads (and plans) the weights; workers map them
    argv = serve_specs(args, "/tmp/t")[0].argv
    assert argv[argv.index("--weights") + 1] == "int4"


def test_serve_specs_refuses_socket_paths_too_long_for_unix_sockets():
    from engine.errors import TandemError

    args = build_parser().parse_args(["serve", "--device", "cpu"])
    with pytest.raises(TandemError, match="TMPDIR"):
        serve_specs(args, "/tmp/" + "d" * 120)


def test_dist_transfers_refuse_two_workers_on_one_gpu_before_anything_starts(monkeypatch):
    """On one H200 the disaggregated service started, then its first request
    failed: NCCL's "Duplicate GPU detected : rank 1 and rank 0 both on CUDA
    device" (12-05 17:11). Peer copies on one GPU, one GPU a worker, and
    gloo through host memory go."""
    from engine.errors import TandemError

    def specs(*flags):
        args = build_parser().parse_args(["serve", "--topology", "disaggregated", *flags])
        return serve_specs(args, "/tmp/t")

    for flags in (["--device", "cuda"], ["--devices", "cuda:0,cuda"],
                  ["--prefill-workers", "2", "--devices", "cuda:0,cuda:1,cuda:1"]):
        with pytest.raises(TandemError, match=r"--kv-transfer peer"):
            specs(*flags)
    specs("--device", "cuda", "--kv-transfer", "peer")
    specs("--devices", "cuda:0,cuda:1")
    specs("--device", "cpu")  # gloo takes any number of ranks
    monkeypatch.setenv("TANDEM_TRANSFER_BACKEND", "gloo")  # through host memory
    specs("--device", "cuda")
