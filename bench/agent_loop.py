"""Agent loop through the real service: every turn resends the whole
conversation as chat text plus about `--new-tokens` tokens of new user text,
and the service must serve what it has seen from its prefix cache.

Per turn: prompt tokens, tokens served from the cache, the reused ratio
(cached over what the previous turn's prompt and answer made reusable; the
resent answer is text, so it may tokenize differently from what was
generated), time to first token, and where the router saw that time go (its
tandem_ttft_phase_seconds: tokenize, reserve, prefill; and cache, which runs
after the first token is sent)."""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys

from bench.common import environment, print_table, write_json
from bench.service import Service, add_service_arguments, run_against_service

WORDS = ("the agent reads a file then calls a tool and writes the result into the log so that "
         "next turn sees every step of work done before with numbers like 42 and 1024 in it").split()


# The router's time-to-first-token phases (tandem_ttft_phase_seconds); the
# last, cache, runs after the first token is sent
BEFORE_FIRST_TOKEN = ("tokenize", "reserve", "prefill")
PHASES = (*BEFORE_FIRST_TOKEN, "cache")


def user_text(turn: int, chars: int) -> str:
    rng = random.Random(turn)
    words, size = [f"Turn {turn}:"], 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench agent-loop", description=__doc__.splitlines()[0])
    add_service_arguments(p, max_context_tokens=131072)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=1024, help="new user tokens per turn (about)")
    p.add_argument("--first-turn-tokens", type=int, default=None,
                   help="tokens of the first user message (about; default --new-tokens): the "
                        "files an agent read before its loop, so the conversation can grow "
                        "past 100K tokens in 20 turns")
    p.add_argument("--output-tokens", type=int, default=32, help="answer tokens per turn")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_against_service(parser().parse_args(argv), run)


def chars_per_token(svc: Service) -> float:
    """Characters per token of this model's tokenizer on the loop's text,
    from a probe request (whose prefill also pays the server's first-use
    compilation before turn 1 is timed). Models differ by 4x: the dummy
    27B's byte-level tokenizer against a BPE one."""
    text = user_text(0, min(4096, svc.max_context_tokens // 2))  # fits at a char a token
    probe = svc.generate(messages=[("user", text)], max_new_tokens=1)
    return max(1.0, len(text) / max(1, probe.prompt_tokens))


def run(svc: Service, args) -> dict:
    """The loop against a running service; prints the table, returns the JSON."""
    turns, rows = [], []
    messages: list[tuple[str, str]] = []
    per_token = chars_per_token(svc)
    reusable = 0
    first = args.first_turn_tokens or args.new_tokens
    for turn in range(1, args.turns + 1):
        tokens = first if turn == 1 else args.new_tokens
        messages.append(("user", user_text(turn, int(tokens * per_token))))
        before = svc.phase_seconds()
        r = svc.generate(messages=messages, max_new_tokens=args.output_tokens)
        after = svc.phase_seconds()
        phases = {name: after[name] - before.get(name, 0.0) for name in PHASES if name in after}
        ratio = min(1.0, r.cached_tokens / reusable) if reusable else None
        turns.append({"turn": turn, "prompt_tokens": r.prompt_tokens,
                      "cached_tokens": r.cached_tokens, "reusable_tokens": reusable,
                      "reused_ratio": ratio, "ttft_s": r.ttft_s, "phases_s": phases})
        rows.append([turn, r.prompt_tokens, r.cached_tokens, reusable,
                     "-" if ratio is None else f"{100 * ratio:.1f}", r.ttft_s,
                     *(f"{1e3 * phases.get(name, float('nan')):.0f}" for name in PHASES)])
        reusable = r.prompt_tokens + len(r.token_ids)
        messages.append(("assistant", r.text))
    later = turns[1:]
    overall = (sum(t["cached_tokens"] for t in later) /
               max(1, sum(t["reusable_tokens"] for t in later))) if later else None
    payload = {"env": environment(), "args": vars(args), "turns": turns, "reused_ratio": overall,
               "later_ttft_s": ttft_summary(later)}
    write_json(args.json, payload)
    print_table(f"agent loop ({args.model or 'embedded'}, {args.device}, {args.kv_format} KV)",
                ["turn", "prompt", "cached", "reusable", "reused %", "TTFT s",
                 *(f"{name} ms" for name in PHASES)], rows)
    if overall is not None:
        summary = payload["later_ttft_s"]
        print(f"reused over turns 2..{args.turns}: {100 * overall:.1f}% of reusable tokens; "
              f"TTFT median {summary['median']:.3f} s, p90 {summary['p90']:.3f} s; "
              f"last TTFT {turns[-1]['ttft_s']:.3f} s at {turns[-1]['prompt_tokens']} tokens")
    return payload


def ttft_summary(turns: list[dict]) -> dict | None:
    """Median and p90 (nearest rank) time to first token of the turns that
    resend a conversation: turn 1 prefills everything and is not one."""
    if not turns:
        return None
    ttfts = sorted(t["ttft_s"] for t in turns)
    p90 = ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)]
    return {"median": statistics.median(ttfts), "p90": p90, "turns": len(ttfts)}


if __name__ == "__main__":
    sys.exit(main())
