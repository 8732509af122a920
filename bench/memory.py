"""Memory and energy of the service at a long context: `tandem serve` with
`--max-context-tokens` (the store lays out that context up front), one
request that prefills `--prompt-tokens` tokens, then the same prompt again
(served from the prefix cache) decoding `--new-tokens` tokens. Reports the
peak memory of every process and in total (NVML on a GPU; on the CPU each
process's peak RSS, whose sum over-counts shared memory) and joules per
generated token over the second request (NVML's energy counter). Both
requests are timed too: the first is the long prompt's prefill (and one
token), the second the decode at that context after a cache hit."""
from __future__ import annotations

import argparse
import sys
import time

from bench.common import environment, print_table, write_json
from bench.interference import prompt
from bench.service import MemorySampler, Service, add_service_arguments, run_against_service


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench memory", description=__doc__.splitlines()[0])
    add_service_arguments(p, max_context_tokens=262144)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_against_service(parser().parse_args(argv), run)


def run(svc: Service, args) -> dict:
    """Against a running service; prints the table, returns the JSON."""
    ids = prompt(9, args.prompt_tokens)
    with MemorySampler(svc) as memory:
        began = time.perf_counter()
        svc.generate(token_ids=ids, max_new_tokens=1)
        prefill_s = time.perf_counter() - began
        with MemorySampler(svc) as energy:
            began = time.perf_counter()
            decoded = svc.generate(token_ids=ids, max_new_tokens=args.new_tokens)
            decode_s = time.perf_counter() - began
    joules = energy.energy_j()
    per_token = joules / len(decoded.token_ids) if joules is not None else None
    processes = {name: b for name, b in sorted(memory.peak.items())}
    payload = {"env": environment(), "args": vars(args), "source": memory.source,
               "peak_bytes": processes, "total_peak_bytes": memory.total_peak,
               "joules": joules, "joules_per_token": per_token,
               "cached_tokens": decoded.cached_tokens, "generated": len(decoded.token_ids),
               "first_request_s": prefill_s, "second_request_s": decode_s}
    write_json(args.json, payload)
    rows = [[name, b / 2**30] for name, b in processes.items()]
    rows.append(["total" if memory.source == "NVML" else "sum of peaks", memory.total_peak / 2**30])
    print_table(f"peak memory ({memory.source}; {args.model or 'embedded'}, {args.device}, "
                f"context {args.max_context_tokens}, {args.kv_format} KV)", ["process", "GiB"], rows)
    print("energy: " + (f"{per_token:.3f} J per generated token ({joules:.1f} J for "
                        f"{len(decoded.token_ids)} tokens)" if per_token is not None
                        else "n/a (no NVML energy counter on this device)"))
    print(f"first request (the prompt's prefill and one token): {prefill_s:.2f} s, "
          f"{len(ids) / prefill_s:.0f} prompt tokens/s; second ({decoded.cached_tokens} "
          f"cached, {len(decoded.token_ids)} tokens): {decode_s:.2f} s")
    return payload


if __name__ == "__main__":
    sys.exit(main())
