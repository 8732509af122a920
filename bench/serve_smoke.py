"""End-to-end smoke timing of `tandem serve`: starts the four processes, sends
a prompt of N token ids, then the next "agent turn" (prompt + output + 256 new
tokens), and reports time to first token, decode rate and cached tokens per
turn, and the GPU memory of every process (NVML) at the end.

A first look, not the agent-loop benchmark (that one lives with the GPU fast
path): it proves the processes, shared memory and prefix cache work on a
device and gives the plain-PyTorch baseline."""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import environment, print_table, write_json
from tandem.ports import free_port


def _turn(stub, pb, prompt, new_tokens):
    started = time.perf_counter()
    first = None
    stamps, complete = [], None
    for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=new_tokens,
                                              ignore_eos=True,
                                              sampling=pb.SamplingParameters(temperature=0.0)),
                           timeout=600):
        if r.HasField("chunk"):
            now = time.perf_counter()
            first = first or now
            stamps.append((now, list(r.chunk.token_ids)))
        else:
            complete = r.complete
    ids = [t for _, ts in stamps for t in ts]
    decode_s = stamps[-1][0] - stamps[0][0]
    return {"prompt_tokens": len(prompt), "cached_tokens": complete.usage.cached_tokens,
            "ttft_s": first - started, "decode_tok_s": (len(ids) - 1) / decode_s if decode_s else 0.0,
            "output": ids}


def _gpu_processes() -> list[dict]:
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        rows = []
        for p in procs:
            try:
                cmd = open(f"/proc/{p.pid}/cmdline", "rb").read().split(b"\0")
                name = next((c.decode() for c in cmd if c.endswith((b".server",))), "python")
            except OSError:
                name = "?"
            rows.append({"pid": p.pid, "process": name, "bytes": p.usedGpuMemory or 0})
        rows.append({"pid": 0, "process": "device total used", "bytes": total})
        return rows
    except Exception:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_smoke", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.5-27b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-context-tokens", type=int, default=32768)
    ap.add_argument("--gpu-memory-budget", default=None)
    ap.add_argument("--kv-format", default="rk4")
    ap.add_argument("--speculative", default="none", help="none, mtp or ngram (tandem serve's flag)")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import grpc

    from tandem.v1 import generation_pb2 as pb
    from tandem.v1 import generation_pb2_grpc as pb_grpc

    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", args.model, "--device", args.device,
           "--kv-format", args.kv_format, "--grpc-port", str(port), "--metrics-port", str(free_port()),
           "--max-context-tokens", str(args.max_context_tokens), "--live-slots", "4", "--http-port", "0",
           "--snapshot-slots", "8", "--socket-dir", tempfile.mkdtemp(prefix="tandem-bench-"),
           "--speculative", args.speculative, "--draft-tokens", str(args.draft_tokens)]
    if args.gpu_memory_budget:
        cmd += ["--gpu-memory-budget", args.gpu_memory_budget]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.wait()
        print(f"tandem serve did not start (exit {proc.returncode})", file=sys.stderr)
        return 1
    startup = time.perf_counter() - t0
    try:
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        prompt = [(7 * i + 11) % 250 for i in range(args.prompt_tokens)]
        turns = [_turn(stub, pb, prompt, args.new_tokens)]
        follow = prompt + turns[0]["output"] + [(3 * i + 5) % 250 for i in range(256)]
        turns.append(_turn(stub, pb, follow, args.new_tokens))
        gpu = _gpu_processes()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    rows = [[i + 1, t["prompt_tokens"], t["cached_tokens"], t["ttft_s"], t["decode_tok_s"]]
            for i, t in enumerate(turns)]
    write_json(args.json, {"env": environment(), "args": vars(args), "startup_s": startup,
                           "turns": [{k: v for k, v in t.items() if k != "output"} for t in turns],
                           "gpu_processes": gpu})
    print(f"startup (all four processes healthy): {startup:.1f} s")
    if gpu:
        print_table("GPU memory (NVML)", ["pid", "process", "GiB"],
                    [[g["pid"], g["process"], g["bytes"] / 2**30] for g in gpu])
    print_table(f"tandem serve {args.model} ({args.device}, {args.kv_format} KV, speculative "
                f"{args.speculative})",
                ["turn", "prompt", "cached", "TTFT s", "decode tok/s"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
