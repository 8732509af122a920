"""`tandem` command line. Subcommands parse flags into config dataclasses and
hand them to the packages that do the work; errors we raise on purpose are
printed as one line on stderr with exit status 2, never as a traceback."""
from __future__ import annotations

import argparse
import os
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
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu or cuda (default: cuda when present)")
    p.add_argument("--weights", default="auto", help="auto (default: a low-bit GGUF/GPTQ file stays packed on CUDA, dequantized on "
                        "the CPU), native (stay packed on any device), bf16 (dequantize); for a "
                        "dummy shape a recipe: int4, q4_k_m, q4_k_s, q8_0, gptq-int4 (default bf16)")
    _add_speculative_flags(p)
    p.set_defaults(run=_run_generate)


def _add_speculative_flags(p) -> None:
    p.add_argument("--speculative", choices=["none", "mtp", "ngram"], default="none",
                   help="speculative decoding: the model's MTP head (shipped, or trained with "
                        "`tandem train-mtp`), prompt lookup (ngram), or none (default)")
    p.add_argument("--draft-tokens", type=int, default=3, metavar="K",
                   help="draft tokens verified per step, 1..4 (default 3)")


def _speculative_config(args):
    from engine.speculative import SpeculativeConfig

    return SpeculativeConfig(args.speculative, args.draft_tokens)


def _run_generate(args) -> int:
    import torch

    from engine.llm import EngineConfig, OfflineEngine
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, max_new_tokens=args.max_new_tokens)
    speculative = _speculative_config(args)  # bad flags fail before the model loads
    device = _compute_device(args.device)
    engine = OfflineEngine(load_model(args.model, device=device, weights=args.weights),
                           EngineConfig(speculative=speculative))
    if args.raw:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = engine.chat_prompt(messages + [{"role": "user", "content": args.prompt}])
    for event in engine.generate([prompt], params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if speculative.enabled:
        t = engine.spec_totals
        print(f"tandem: speculative {speculative.method} k={speculative.num_draft_tokens}: mean "
              f"accepted length {engine.mean_accepted_length:.2f} tokens per target forward "
              f"({t['accepted']} of {t['drafted']} drafts accepted in {t['steps']} steps)",
              file=sys.stderr)
    return 0


def _compute_device(asked: str | None) -> str:
    """--device, or cuda when present; cuda asked for where there is none is a
    one-line error, not a traceback from deep in the loader."""
    import torch

    if asked == "cuda" and not torch.cuda.is_available():
        raise TandemError("--device cuda: torch sees no CUDA device here; use --device cpu")
    return asked or ("cuda" if torch.cuda.is_available() else "cpu")


def _add_train_mtp(sub) -> None:
    p = sub.add_parser("train-mtp", help="train an MTP head for a model that has none",
                       description="Self-distillation: the model answers built-in chat and code "
                                   "prompts, and a head of Qwen3.5's MTP structure learns to "
                                   "predict its greedy token two positions ahead. Writes a bf16 "
                                   "safetensors file where --model finds it (see README).")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory "
                                                 "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="output file (default: where --model looks)")
    p.add_argument("--time-budget", type=float, default=600.0, help="training seconds")
    p.add_argument("--samples-per-prompt", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--depth", type=int, default=3, help="unrolled draft steps trained")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=16,
                   help="sequences generated at once (64-128 on a GPU)")
    p.add_argument("--max-prompts", type=int, default=None,
                   help="use only the first N built-in prompts (default: all)")
    p.add_argument("--gen-processes", type=int, default=1, metavar="N",
                   help="answer the missing prompts in N processes at once, each with its own "
                        "copy of the model (default 1; for a small model on a GPU, where one "
                        "process leaves it mostly idle, 4-8, under CUDA MPS if you can)")
    p.add_argument("--corpus", default=None,
                   help="file of generated samples, a cache keyed by prompt: the answers it "
                        "holds are reused, missing ones generated and added")
    p.add_argument("--self-instruct", type=int, default=0, metavar="N",
                   help="also answer N questions the model writes itself (varied phrasing)")
    p.add_argument("--varied", type=int, default=0, metavar="N",
                   help="also answer N naturally phrased prompts of many shapes (questions, "
                        "how-tos, emails, stories; code requests in several phrasings)")
    p.add_argument("--batch-samples", type=int, default=8,
                   help="samples packed into one sequence per optimizer step (default 8)")
    p.add_argument("--soft-targets", action=argparse.BooleanOptionalAction, default=True,
                   help="train on the base's whole next-token distribution (default), "
                        "or with --no-soft-targets on its greedy token")
    p.add_argument("--target-temperature", type=float, default=1.0,
                   help="temperature of the soft targets (default 1.0; below 1 sharpens them "
                        "toward the base's greedy token, which greedy acceptance checks)")
    p.add_argument("--dev-every", type=int, default=0, metavar="STEPS",
                   help="measure the head on the dev prompts' answers every STEPS steps and "
                        "write the best head seen (the worse of chat and code decides), not "
                        "the last; each new best is written at once, so a run stopped early "
                        "leaves its best head so far; 0 (default): the last")
    p.add_argument("--init-head", default=None, metavar="FILE",
                   help="continue training this head file (an earlier train-mtp output) instead "
                        "of starting from the base's last layer, so that a training longer "
                        "than one device call runs as several")
    p.add_argument("--head-layers", type=int, default=None, metavar="N",
                   help="decoder layers of the head (Qwen3.5's mtp_num_hidden_layers; default: "
                        "as many as --init-head's file has, else 1); more than --init-head's "
                        "file grows it by layers that start as identities")
    p.add_argument("--init-lr-scale", type=float, default=1.0, metavar="F",
                   help="learning rate of the parameters --init-head's file holds, as a "
                        "fraction of --lr (default 1; 0 freezes them, so a head grown with "
                        "--head-layers trains its new layers alone)")
    p.add_argument("--engine-kv", action=argparse.BooleanOptionalAction, default=False,
                   help="train deeper drafts to attend as the engine's do (the depth-1 keys "
                        "of verified tokens and the chain's own drafts; train.EngineKV) "
                        "instead of the dense unroll's depth-r keys of other chains, which "
                        "the engine never holds (default: dense, what the shipped head "
                        "trained with). The dev and held-out figures are the engine's either way")
    p.add_argument("--corpus-only", action="store_true",
                   help="answer the prompts missing from --corpus, save it and stop (no "
                        "training): generation and training can then run on different "
                        "machines or in separate calls")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu or cuda (default: cuda when present)")
    p.set_defaults(run=_run_train_mtp)


def _check_train_mtp_flags(args) -> None:
    """Flag combinations and files, before the model loads."""
    from pathlib import Path

    if args.corpus_only and not args.corpus:
        raise TandemError("--corpus-only needs --corpus FILE (the file the answers are saved to)")
    if args.corpus_only and args.init_head:
        raise TandemError("--init-head trains a head; --corpus-only trains none: drop one")
    if args.init_head and not Path(args.init_head).is_file():
        raise TandemError(f"--init-head {args.init_head}: no such file (give an earlier "
                          "train-mtp output)")
    if args.init_head and (args.head_layers is not None or args.init_lr_scale == 0):
        from safetensors import safe_open

        from engine.speculative.heads import head_layer_count

        with safe_open(args.init_head, framework="pt") as f:
            held = head_layer_count(f.keys())
        if args.head_layers is not None and args.head_layers < held:
            raise TandemError(f"--head-layers {args.head_layers}: --init-head {args.init_head} "
                              f"holds {held} layers, and a head cannot shrink")
        if args.init_lr_scale == 0 and (args.head_layers or held) <= held:
            raise TandemError(f"--init-lr-scale 0 freezes the {held} layers of --init-head "
                              f"{args.init_head}, which leaves nothing to train: grow it with "
                              f"--head-layers {held + 1}")


def _run_train_mtp(args) -> int:
    from pathlib import Path

    import torch

    from engine.loader import load_model
    from engine.speculative.heads import best_head_writer, head_paths, head_state, save_head
    from engine.speculative.train import TrainConfig, generate_corpus, train_head

    _check_train_mtp_flags(args)
    try:
        cfg = TrainConfig(samples_per_prompt=args.samples_per_prompt, new_tokens=args.new_tokens,
                          depth=args.depth, lr=args.lr, time_budget_s=args.time_budget,
                          seed=args.seed, max_batch=args.max_batch, max_prompts=args.max_prompts,
                          corpus_path=args.corpus, self_instruct=args.self_instruct,
                          varied=args.varied,
                          batch_samples=args.batch_samples, soft_targets=args.soft_targets,
                          target_temperature=args.target_temperature,
                          dev_every_steps=args.dev_every, init_head_path=args.init_head,
                          gen_processes=args.gen_processes, head_layers=args.head_layers,
                          init_lr_scale=args.init_lr_scale, engine_kv=args.engine_kv)
    except ValueError as e:
        raise TandemError(str(e)) from e
    device = _compute_device(args.device)
    # dense weights (the head starts as a copy of the last layer, and trains on
    # them); a head from an earlier train-mtp is ignored (and replaced)
    loaded = load_model(args.model, device=device, progress=False, weights="bf16",
                        trained_head=False)
    if loaded.config.mtp_num_layers:
        raise TandemError(f"{loaded.source} ships its own MTP head; nothing to train")
    if loaded.source.startswith("dummy:"):
        raise TandemError("train-mtp needs real weights (a GGUF file or HF directory)")
    if (args.head_layers or 1) > len(loaded.config.attention_layers):
        raise TandemError(f"--head-layers {args.head_layers}: a head starts from the base's last "
                          f"full-attention layers, and {loaded.source} has "
                          f"{len(loaded.config.attention_layers)}")
    if args.corpus_only:
        corpus = generate_corpus(loaded, cfg)
        print(f"tandem: {args.corpus} holds the {len(corpus.samples)} samples of this recipe "
              f"({sum(map(len, corpus.samples))} tokens); no head trained")
        return 0
    source = Path(loaded.source)
    # the embedded model's head ships in this package; any other goes beside its model
    out = Path(args.out) if args.out else head_paths(source)[-1 if args.model is None else 0]
    head, stats = train_head(loaded, cfg,
                             on_best=best_head_writer(out, loaded.config, source.name))
    metadata = {"base_model": source.name, "train_steps": str(stats["steps"]),
                "held_out_accuracy": ",".join(f"{a:.3f}" for a in stats["accuracy"]),
                "held_out_expected_length": f"{stats['expected_length']:.3f}",
                "held_out_loop_length": f"{stats['loop_length']:.3f}"}
    if "dev" in stats:
        metadata["dev_chosen_step"] = str(stats["dev"]["chosen_step"])
        metadata.update({f"dev_{kind}_loop_length": f"{length:.3f}"
                         for kind, length in stats["dev"]["loop_length"].items()})
    save_head(out, loaded.config, head_state(head), metadata)
    print(f"tandem: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB; on held-out greedy "
          f"answers: draft accuracy by depth {[round(a, 3) for a in stats['accuracy']]}, "
          f"expected mean accepted length {stats['expected_length']:.2f}, tokens per verify "
          f"step in the speculative loop {stats['loop_length']:.2f})")
    return 0


_BENCHES = {"decode": "bench.decode", "prefill": "bench.prefill", "agent-loop": "bench.agent_loop",
            "interference": "bench.interference", "memory": "bench.memory",
            "kv-quality": "bench.kv_quality", "kv-ablation": "bench.kv_ablation",
            "disagg": "bench.disagg"}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints a table, optionally JSON)",
                       add_help=False)
    p.add_argument("which", choices=sorted(_BENCHES))
    p.set_defaults(run=None)


def _run_bench(which: str, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(_BENCHES[which]).main(rest)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the service: kvstore, prefill, decode, router and "
                                     "the OpenAI HTTP gateway",
                       description="Starts the processes in order, each once the previous "
                                   "one reports SERVING, prints one line to stdout when all are "
                                   "up, and runs until Ctrl-C or SIGTERM. Internal traffic goes "
                                   "over unix sockets in a private temporary directory.")
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or dummy shape (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address of the public gRPC API")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics port")
    p.add_argument("--kv-format", default="int8",
                   help="KV cache format: int8 (default), rk4p (4.5 bits, whole-page 4-bit with "
                        "bf16 sinks and newest pages), rk4 (4.5 bits per token), bf16")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default 16; 32 for rk4p)")
    p.add_argument("--max-context-tokens", type=int, default=65536)
    p.add_argument("--live-slots", type=int, default=16, help="sequences that can run at once")
    p.add_argument("--snapshot-slots", type=int, default=64,
                   help="cached hybrid-state snapshots kept for the prefix cache")
    _add_embeddings_flag(p)
    p.add_argument("--max-batch", type=int, default=16, help="decode batch size")
    _add_prefill_chunk_flag(p)
    p.add_argument("--prefill-sm-percent", type=int, default=None,
                   help="under CUDA MPS (a running nvidia-cuda-mps-control -d): the share of "
                        "the GPU's SMs the prefill worker may fill (its "
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so that decode steps find SMs "
                        "free while a long prompt prefills; no effect without MPS "
                        "(docs/ARCHITECTURE.md, sharing one GPU)")
    p.add_argument("--decode-sm-percent", type=int, default=None,
                   help="under CUDA MPS: the decode worker's share of the SMs. A decode step "
                        "is bound by memory bandwidth, which fewer SMs can still draw, so a "
                        "capped decode leaves the prefill more of the SMs it is bound by")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode steps eagerly instead of replaying CUDA graphs (GPU only)")
    p.add_argument("--gpu-memory-budget", default=None,
                   help="e.g. 24GiB: the kvstore refuses to start when its plan exceeds it")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when a GPU is present")
    p.add_argument("--socket-dir", default=None,
                   help="directory for the internal unix sockets (default: a private temp dir)")
    p.add_argument("--weights", default="auto", help="auto (default: a low-bit GGUF/GPTQ file stays packed on CUDA, dequantized on "
                        "the CPU), native (stay packed on any device), bf16 (dequantize); for a "
                        "dummy shape a recipe: int4, q4_k_m, q4_k_s, q8_0, gptq-int4 (default bf16)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="port of the OpenAI-compatible HTTP API on --host; 0 = do not start it")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the HTTP API "
                        "(default: $TANDEM_API_KEY, else no key)")
    _add_speculative_flags(p)
    t = p.add_argument_group("topology (docs/ARCHITECTURE.md, Disaggregated topology)")
    t.add_argument("--topology", choices=["shared", "disaggregated"], default="shared",
                   help="shared (default): one store that prefill and decode both map; "
                        "disaggregated: every worker has its own store (on its own device) and "
                        "finished prefill pages move to the decode worker's store")
    t.add_argument("--prefill-workers", type=int, default=1, help="disaggregated: N prefill workers")
    t.add_argument("--decode-workers", type=int, default=1, help="disaggregated: M decode workers")
    t.add_argument("--devices", default=None,
                   help="disaggregated: comma-separated device per worker, prefill workers "
                        "first then decode workers (e.g. cuda:0,cuda:1), or one for all "
                        "(default: --device)")
    t.add_argument("--kv-transfer", choices=["dist", "peer"], default="dist",
                   help="disaggregated: dist = torch.distributed send/recv (gloo on CPU, NCCL "
                        "on CUDA; works across hosts); peer = prefill workers map the decode "
                        "stores and copy (shm on CPU, CUDA IPC peer copies; one host)")
    t.add_argument("--transfer-port", type=int, default=0,
                   help="disaggregated, dist: TCP port of the process group's rendezvous on "
                        "127.0.0.1 (default: a free one)")
    p.set_defaults(run=_run_serve)


# engine.loader.EMBEDDED, spelled out: importing engine.loader pulls in torch,
# which this process (it only supervises) never needs.
_EMBEDDED_MODEL = "embedded"
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL
API_KEY_ENV = "TANDEM_API_KEY"  # openai_api.__main__.API_KEY_ENV, without importing aiohttp
_MAX_DRAFT_TOKENS = 4  # engine.speculative.MAX_DRAFT_TOKENS, without importing torch


def serve_specs(args, socket_dir: str) -> list:
    """The processes of `tandem serve`, in start order, for parsed ARGS (with
    args.device already chosen) and sockets under SOCKET_DIR: kvstore,
    prefill, decode, router, and the OpenAI HTTP gateway unless --http-port 0."""
    from tandem.supervisor import ProcessSpec

    _check_serve_flags(args)
    sock = _socket_paths(socket_dir, ("kvstore", "prefill", "decode"))
    if getattr(args, "topology", "shared") == "disaggregated":
        return _disaggregated_specs(args, socket_dir)
    if getattr(args, "prefill_workers", 1) != 1 or getattr(args, "decode_workers", 1) != 1:
        raise TandemError("--prefill-workers/--decode-workers need --topology disaggregated "
                          "(the shared topology runs one of each over one store)")
    device = args.device
    py = sys.executable
    kvstore = _kvstore_argv(args, sock["kvstore"], device)
    prefill = [py, "-m", "prefill.server", "--store", sock["kvstore"], "--socket", sock["prefill"],
               "--device", device]  # the chunk: the store's, which its plan sized
    decode = [py, "-m", "decode.server", "--store", sock["kvstore"], "--socket", sock["decode"],
              "--max-batch", str(args.max_batch), "--device", device]
    if getattr(args, "no_cuda_graphs", False):
        decode.append("--no-cuda-graphs")
    router = [py, "-m", "router.server", "--store", sock["kvstore"], "--prefill", sock["prefill"],
              "--decode", sock["decode"], "--host", args.host, "--port", str(args.grpc_port),
              "--metrics-port", str(args.metrics_port)]
    # The kvstore loads the weights (minutes for a large GGUF); workers map them.
    specs = [
        ProcessSpec("kvstore", kvstore, f"unix://{sock['kvstore']}", False, start_timeout_s=900),
        ProcessSpec("prefill", prefill, f"unix://{sock['prefill']}", True, start_timeout_s=300,
                    env=_mps_share_env(args, "prefill_sm_percent")),
        ProcessSpec("decode", decode, f"unix://{sock['decode']}", True, start_timeout_s=300,
                    env=_mps_share_env(args, "decode_sm_percent")),
        ProcessSpec("router", router, _local_target(args.host, args.grpc_port), False,
                    start_timeout_s=120),
    ]
    return specs + _gateway_specs(args)


def _mps_share_env(args, flag: str) -> tuple[tuple[str, str], ...]:
    """A worker's SM share under MPS: the client's active thread percentage."""
    share = getattr(args, flag, None)
    return () if share is None else (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(share)),)


def _check_serve_flags(args) -> None:
    if not 1 <= args.grpc_port < 65536:
        raise TandemError(f"--grpc-port {args.grpc_port} must be in 1..65535")
    if not 0 <= args.http_port < 65536 or args.http_port == args.grpc_port:
        raise TandemError(f"--http-port {args.http_port} must be in 1..65535 (0 = no HTTP API) "
                          "and differ from --grpc-port")
    if not 0 <= args.metrics_port < 65536 or (
            args.metrics_port and args.metrics_port in (args.grpc_port, args.http_port)):
        # caught here, not as a bind error in one of five processes after the
        # weights have loaded
        raise TandemError(f"--metrics-port {args.metrics_port} must be in 1..65535 (0 = no "
                          "metrics endpoint) and differ from --grpc-port and --http-port")
    for flag in ("prefill_sm_percent", "decode_sm_percent"):
        share = getattr(args, flag, None)
        if share is not None and not 1 <= share <= 100:
            raise TandemError(f"--{flag.replace('_', '-')} must be in 1..100, got {share}")
    if not 1 <= args.draft_tokens <= _MAX_DRAFT_TOKENS:
        raise TandemError(f"--draft-tokens must be in 1..{_MAX_DRAFT_TOKENS}, got "
                          f"{args.draft_tokens}")


def _socket_paths(socket_dir: str, names) -> dict:
    sock = {name: os.path.join(socket_dir, f"{name}.sock") for name in names}
    too_long = [p for p in sock.values() if len(os.fsencode(p)) > _UNIX_PATH_MAX]
    if too_long:
        raise TandemError(f"socket path {too_long[0]!r} is longer than {_UNIX_PATH_MAX} bytes; "
                          "set TMPDIR to a shorter directory")
    return sock


def _kvstore_argv(args, socket: str, device: str) -> list[str]:
    kvstore = [sys.executable, "-m", "kvstore.server", "--model", args.model or _EMBEDDED_MODEL,
               "--socket", socket, "--kv-format", args.kv_format,
               "--max-context-tokens", str(args.max_context_tokens),
               "--live-slots", str(args.live_slots), "--snapshot-slots", str(args.snapshot_slots),
               "--prefill-chunk-tokens", str(args.prefill_chunk or "auto"), "--device", device,
               # the store lays out the drafter's memory; the workers and the router
               # read the setting from it
               "--speculative", args.speculative, "--draft-tokens", str(args.draft_tokens)]
    if args.page_size is not None:  # else the store picks the format's own
        kvstore += ["--page-size", str(args.page_size)]
    if getattr(args, "weights", "auto") != "auto":
        kvstore += ["--weights", args.weights]
    if getattr(args, "embeddings", "auto") != "auto":
        kvstore += ["--embeddings", args.embeddings]
    if args.gpu_memory_budget:
        kvstore += ["--gpu-memory-budget", str(args.gpu_memory_budget)]
    return kvstore


def _devices(args) -> list[str]:
    n = args.prefill_workers + args.decode_workers
    given = [d.strip() for d in (args.devices or args.device).split(",") if d.strip()]
    if len(given) == 1:
        given = given * n
    if len(given) != n:
        raise TandemError(f"--devices lists {len(given)} devices for {n} workers "
                          f"({args.prefill_workers} prefill + {args.decode_workers} decode): "
                          "give one per worker, prefill workers first, or one for all")
    bad = [d for d in given if d != "cpu" and not (d == "cuda" or d.startswith("cuda:")
                                                   and d[5:].isdigit())]
    if bad:
        raise TandemError(f"--devices: {bad[0]!r} is not cpu, cuda or cuda:N")
    if args.kv_transfer == "dist":
        _check_one_rank_per_gpu(given)
    return given


def _check_one_rank_per_gpu(devices: list[str]) -> None:
    """NCCL refuses two ranks of a group on one GPU ("Duplicate GPU
    detected"), and only once both have started and a transfer is asked.
    (transfer.group.BACKEND_ENV, spelled out: this process never imports torch.)"""
    if os.environ.get("TANDEM_TRANSFER_BACKEND", "").strip() not in ("", "nccl"):
        return  # gloo: through host memory, any number of ranks a GPU
    named = [d if d != "cuda" else "cuda:0" for d in devices if d != "cpu"]
    shared = sorted({d for d in named if named.count(d) > 1})
    if shared:
        raise TandemError(
            f"--kv-transfer dist puts {named.count(shared[0])} workers on {shared[0]}, and NCCL "
            "joins one rank per GPU: give each worker its own GPU with --devices (e.g. "
            "cuda:0,cuda:1), copy between the stores on one GPU with --kv-transfer peer, or "
            "send through host memory with TANDEM_TRANSFER_BACKEND=gloo")


def _disaggregated_specs(args, socket_dir: str) -> list:
    """A store per worker (each on its device), N prefill and M decode workers
    in one transfer group (prefill i = rank i, decode j = rank N + j), a router
    over all of them."""
    from tandem.ports import free_port
    from tandem.supervisor import ProcessSpec

    n, m = args.prefill_workers, args.decode_workers
    if not (1 <= n <= 64 and 1 <= m <= 64):
        raise TandemError("--prefill-workers and --decode-workers must be in 1..64")
    devices = _devices(args)
    prefills = [f"prefill-{i}" for i in range(n)]
    decodes = [f"decode-{j}" for j in range(m)]
    workers = prefills + decodes
    sock = _socket_paths(socket_dir, workers + [f"kvstore-{w}" for w in workers])
    port = args.transfer_port or free_port()
    if not 0 < port < 65536:
        raise TandemError(f"--transfer-port {port} must be in 1..65535")
    py = sys.executable
    group = ["--transfer-world", str(n + m), "--transfer-prefill", str(n),
             "--transfer-addr", f"127.0.0.1:{port}", "--transfer-method", args.kv_transfer]
    # peer copies need no group, so a worker can be restarted; a process group
    # cannot take a new member in a dead one's place, so with dist a worker's
    # death stops the service
    restartable = args.kv_transfer == "peer"
    specs = [ProcessSpec(f"kvstore-{w}", _kvstore_argv(args, sock[f"kvstore-{w}"], d),
                         f"unix://{sock[f'kvstore-{w}']}", False, start_timeout_s=900)
             for w, d in zip(workers, devices)]
    for rank, (w, d) in enumerate(zip(workers, devices)):
        common = ["--store", sock[f"kvstore-{w}"], "--socket", sock[w], "--device", d,
                  "--transfer-rank", str(rank), *group]
        if rank < n:
            argv = [py, "-m", "prefill.server", *common]
            if args.kv_transfer == "peer":
                argv += ["--peer-stores", ",".join(sock[f"kvstore-{x}"] for x in decodes)]
        else:
            argv = [py, "-m", "decode.server", *common, "--max-batch", str(args.max_batch)]
            if getattr(args, "no_cuda_graphs", False):
                argv.append("--no-cuda-graphs")
        specs.append(ProcessSpec(w, argv, f"unix://{sock[w]}", restartable, start_timeout_s=300))
    router = [py, "-m", "router.server", "--host", args.host, "--port", str(args.grpc_port),
              "--metrics-port", str(args.metrics_port), "--kv-transfer", args.kv_transfer]
    for w in prefills:
        router += ["--prefill-group", f"{sock[f'kvstore-{w}']}={sock[w]}"]
    for w in decodes:
        router += ["--decode-group", f"{sock[f'kvstore-{w}']}={sock[w]}"]
    # the router waits for every worker's transfer path (the group forms once all joined)
    specs.append(ProcessSpec("router", router, _local_target(args.host, args.grpc_port), False,
                             start_timeout_s=900))
    return specs + _gateway_specs(args)


def _gateway_specs(args) -> list:
    from tandem.supervisor import ProcessSpec

    specs = []
    if args.http_port:
        # the gateway holds no state: a crash is reported and it is restarted
        gateway = [sys.executable, "-m", "openai_api", "--router", _local_target(args.host, args.grpc_port),
                   "--host", args.host, "--port", str(args.http_port)]
        key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
        specs.append(ProcessSpec("openai", gateway,
                                 f"http://{_local_target(args.host, args.http_port)}/health", True,
                                 start_timeout_s=120, env=((API_KEY_ENV, key),)))
    return specs


def _local_target(host: str, port: int) -> str:
    """Where this machine reaches a server bound to HOST:PORT."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _default_device() -> str:
    """cuda when NVML sees a GPU we may use, else cpu (without importing torch)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return "cuda" if pynvml.nvmlDeviceGetCount() > 0 else "cpu"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver, no device: all mean "no GPU"
        return "cpu"


def _run_serve(args) -> int:
    import shutil
    import tempfile

    from tandem.supervisor import StartupInterrupted, Supervisor

    args.device = args.device or _default_device()
    owned = args.socket_dir is None
    socket_dir = tempfile.mkdtemp(prefix="tandem-") if owned else args.socket_dir  # mode 0700
    try:
        with Supervisor(serve_specs(args, socket_dir)) as supervisor:
            supervisor.start()
            model = args.model or _EMBEDDED_MODEL
            http = f", OpenAI HTTP API on :{args.http_port}" if args.http_port else ""
            print(f"tandem: serving {model} on {args.host}:{args.grpc_port} "
                  f"(metrics on :{args.metrics_port}{http})", flush=True)
            return supervisor.run()
    except StartupInterrupted:
        return 130
    finally:
        if owned:
            shutil.rmtree(socket_dir, ignore_errors=True)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="print the memory plan of a configuration, loading no weights",
                       description="Plans every byte the service would take on the GPU (all "
                                   "processes: weights, KV pages, GDN state slots and snapshots, "
                                   "MTP, activations, CUDA graphs, allocator slack) from the "
                                   "model's config and tensor table. Exit status 0 when it fits "
                                   "--gpu-memory-budget, 1 when it does not (the line that does "
                                   "not fit and what to change on stderr), 2 on bad input.")
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or dummy shape (default: embedded)")
    p.add_argument("--weights", default="auto", help="auto (default: a low-bit GGUF/GPTQ file stays packed on CUDA, dequantized on "
                        "the CPU), native (stay packed on any device), bf16 (dequantize); for a "
                        "dummy shape a recipe: int4, q4_k_m, q4_k_s, q8_0, gptq-int4 (default bf16)")
    p.add_argument("--kv-format", default="int8", help="int8 (default), rk4p, rk4 or bf16")
    # --max-context-tokens as well: serve's name, and the one the over-budget advice gives
    p.add_argument("--context", "--max-context-tokens", dest="context", type=int, default=65536,
                   help="tokens the KV page pool holds (tandem serve --max-context-tokens)")
    _add_speculative_flags(p)
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default 16; 32 for rk4p)")
    p.add_argument("--live-slots", type=int, default=1, help="sequences running at once")
    p.add_argument("--snapshot-slots", type=int, default=8, help="GDN prefix-cache snapshots")
    _add_prefill_chunk_flag(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                   help="the device planned for (default cuda)")
    p.add_argument("--gpu-memory-budget", required=True, help="e.g. 24GiB")
    _add_embeddings_flag(p)
    p.set_defaults(run=_run_plan)


def _add_prefill_chunk_flag(p) -> None:
    from engine.chunking import AUTO_PREFILL_CHUNK_CAP, AUTO_PREFILL_CHUNK_CPU, parse_prefill_chunk

    p.add_argument("--prefill-chunk", type=parse_prefill_chunk, default="auto",
                   help="tokens per prefill forward, which sizes the activation reserve: auto "
                        f"(default) is on a GPU the largest up to {AUTO_PREFILL_CHUNK_CAP} the "
                        f"memory budget fits (4-bit weights prefill faster in larger chunks), on "
                        f"the CPU {AUTO_PREFILL_CHUNK_CPU}")


def _add_embeddings_flag(p) -> None:
    p.add_argument("--embeddings", default="auto", choices=["auto", "host", "device"],
                   help="where an untied token table lives: auto (host memory on a GPU: a 27B's "
                        "table is 0.7-2.4 GiB a step reads a few rows of), host or device")


def _run_plan(args) -> int:
    from engine.loader import default_dtype, plan_inputs
    from kvstore.plan import OverBudgetError, parse_bytes
    from kvstore.server import ServerOptions, plan_for

    import torch

    try:
        device = torch.device(args.device)
        # the very options `tandem serve` would give the store, so the plans agree
        options = ServerOptions(
            socket="(plan)", model=args.model, kv_format=args.kv_format,
            page_size=args.page_size, max_context_tokens=args.context,
            live_slots=args.live_slots, snapshot_slots=args.snapshot_slots,
            gpu_memory_budget=parse_bytes(args.gpu_memory_budget), device=args.device,
            prefill_chunk_tokens=args.prefill_chunk, weights=args.weights,
            speculative=_speculative_config(args), embeddings=args.embeddings)
        inputs = plan_inputs(args.model, args.weights, device)
        plan = plan_for(options, inputs.config, default_dtype(device), inputs.weight_bytes,
                        inputs.label, inputs.embedding_bytes, inputs.packed_in_features)
    except ValueError as e:
        raise TandemError(str(e)) from e
    try:
        plan.check()
    except OverBudgetError as e:
        print(e, file=sys.stderr)
        return 1
    print(plan.table())
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk to a running server (keeps the conversation)")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.set_defaults(run=_run_chat)


def _run_chat(args) -> int:
    from tandem.chat import chat_loop

    return chat_loop(args.address, args.system, args.temperature, args.max_new_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_chat(sub)
    _add_plan(sub)
    _add_bench(sub)
    _add_train_mtp(sub)
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
