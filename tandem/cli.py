"""`tandem` command line. Subcommands parse flags into config dataclasses and
hand them to the packages that do the work; errors we raise on purpose are
printed as one line on stderr with exit status 2, never as a traceback."""
from __future__ import annotations

import argparse
import sys

from engine.errors import TandemError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to one prompt, offline, in this process",
                       description="Sends PROMPT as one user message through the model's chat "
                                   "template and streams the reply to stdout (logs go to stderr).")
    p.add_argument("prompt", help="the user message")
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or dummy shape (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    import torch

    from engine.llm import OfflineEngine
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, max_new_tokens=args.max_new_tokens)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = OfflineEngine(load_model(args.model, device=device))
    if args.raw:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = engine.chat_prompt(messages + [{"role": "user", "content": args.prompt}])
    for event in engine.generate([prompt], params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


_BENCHES = {"decode": "bench.decode"}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints a table, optionally JSON)",
                       add_help=False)
    p.add_argument("which", choices=sorted(_BENCHES))
    p.set_defaults(run=None)


def _run_bench(which: str, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(_BENCHES[which]).main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    try:
        if args.command == "bench":
            return _run_bench(args.which, rest)
        if rest:
            build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
        return args.run(args)
    except TandemError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
