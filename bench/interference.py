"""Decode smoothness while a long prefill shares the device, through the
real service: inter-token latency (ITL) of one decoding request idle, then
while another request's `--prefill-tokens`-token prompt is prefilled; and the
prefill's throughput alone and while decode runs."""
from __future__ import annotations

import argparse
import sys
import threading
import time

from bench.common import environment, print_table, write_json
from bench.service import Service, StreamResult, add_service_arguments, run_against_service


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 250 + 1 for i in range(n)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench interference", description=__doc__.splitlines()[0])
    add_service_arguments(p, max_context_tokens=65536)
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--decode-tokens", type=int, default=256,
                   help="tokens the decoding request generates (must outlast the prefill)")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_against_service(parser().parse_args(argv), run)


def run(svc: Service, args) -> dict:
    """Against a running service; prints the table, returns the JSON."""
    svc.generate(token_ids=prompt(1, 64), max_new_tokens=8)  # warm-up (graphs, kernels)
    idle = svc.generate(token_ids=prompt(2, 64), max_new_tokens=args.decode_tokens)
    solo = svc.generate(token_ids=prompt(3, args.prefill_tokens), max_new_tokens=1)

    busy = StreamResult(started=0.0)
    thread = threading.Thread(target=svc.generate, kwargs=dict(
        token_ids=prompt(4, 64), max_new_tokens=args.decode_tokens, into=busy))
    thread.start()
    while len(busy.stamps) < 4 and thread.is_alive():  # decode is streaming
        time.sleep(0.01)
    shared = svc.generate(token_ids=prompt(5, args.prefill_tokens), max_new_tokens=1)
    thread.join()
    window = (shared.started, shared.stamps[0])
    during = [b - a for a, b in zip(busy.stamps, busy.stamps[1:])
              if window[0] <= b <= window[1]]
    idle_itl = idle.inter_token_s
    solo_rate = args.prefill_tokens / solo.ttft_s
    shared_rate = args.prefill_tokens / shared.ttft_s
    result = {
        "idle_itl_p50_ms": 1e3 * percentile(idle_itl, 50),
        "idle_itl_p99_ms": 1e3 * percentile(idle_itl, 99),
        "busy_itl_p50_ms": 1e3 * percentile(during, 50),
        "busy_itl_p99_ms": 1e3 * percentile(during, 99),
        "busy_itl_samples": len(during),
        "prefill_solo_tok_s": solo_rate, "prefill_shared_tok_s": shared_rate,
        "prefill_kept_pct": 100 * shared_rate / solo_rate,
    }
    payload = {"env": environment(), "args": vars(args), "result": result}
    write_json(args.json, payload)
    print_table(f"interference ({args.model or 'embedded'}, {args.device}, prefill "
                f"{args.prefill_tokens} tokens in chunks of {args.prefill_chunk})",
                ["", "ITL p50 ms", "ITL p99 ms", "samples", "prefill tok/s"],
                [["idle", result["idle_itl_p50_ms"], result["idle_itl_p99_ms"], len(idle_itl),
                  solo_rate],
                 ["during prefill", result["busy_itl_p50_ms"], result["busy_itl_p99_ms"],
                  len(during), shared_rate]])
    print(f"p99 during prefill / idle p50: "
          f"{result['busy_itl_p99_ms'] / result['idle_itl_p50_ms']:.2f}x; prefill keeps "
          f"{result['prefill_kept_pct']:.0f}% of its solo throughput")
    return payload


if __name__ == "__main__":
    sys.exit(main())
