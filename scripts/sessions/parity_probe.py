"""Why the service's greedy tokens differ from the offline engine's on CUDA
(12-05: three tests of tests/test_service*.py): rounding or a bug?
A dummy shape's CPU reference takes the weights CUDA draws (the first probe,
12-05 14:51, compared two different models).

For one model (tiny-qwen3.5, or the embedded GGUF when present) and the
hybrid test's prompt: CPU fp32 is the reference. Printed per CUDA path:
the greedy ids' first difference from the reference, and the largest
|logit - reference logit| over the prompt's last position and the
teacher-forced continuation (the reference's own ids), with each A/B
switch of the GPU path turned off in turn (a subprocess each). A bug shows
as one path (or one switch) far from the others; rounding as all of them
at about the same distance.

    [PROBE_KV=bf16] python scripts/sessions/parity_probe.py MODEL [SWITCH=VALUE ...]

PROBE_KV: the KV format of every path, the service's included (default rk4,
the tests' format; on the CPU, bf16 compute against fp32 moves rk4's logits
by 5-7 units on the embedded model, bf16 KV's by 0.6, 12-05).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

PAGE = 16
NEW = 20
KV = os.environ.get("PROBE_KV", "rk4")


def prompt_of(loaded) -> list[int]:
    vocab = loaded.config.vocab_size
    return [(7 * i + 3) % min(vocab, 250) for i in range(40)]


def forced_logits(loaded, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """All positions' logits of `tokens`, prefilled in chunks of the given ends."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    options = {"dtype": loaded.dtype} if KV == "bf16" else {}
    cache = PagedKVCache(loaded.config, CacheShape(-(-len(tokens) // PAGE), PAGE, 1),
                         loaded.device, make_format(KV, **options))
    table = tuple(range(cache.shape.num_pages))
    slot = 0 if loaded.config.is_hybrid else -1
    out, start = [], 0
    with torch.inference_mode():
        for end in chunks:
            seq = SequenceInput(tuple(tokens[start:end]), start, table, slot)
            out.append(loaded.model(ForwardBatch.build([seq], PAGE, loaded.device), cache,
                                    all_logits=True).float().cpu())
            start = end
    return torch.cat(out)


def load(model: str, device: str):
    """The model on `device`; on the CPU, a dummy shape takes the values CUDA
    draws (engine/weights/dummy.py draws with each device's own generator)."""
    from engine.config import shape_names
    from engine.loader import load_model
    from tests.test_service import _take_parameters

    loaded = load_model(None if model == "embedded" else model, device=device, progress=False)
    if device == "cpu" and model in shape_names() and torch.cuda.is_available():
        _take_parameters(loaded.model, load_model(model, device="cuda", progress=False).model)
    return loaded


def one_run(model: str, device: str) -> dict:
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams

    loaded = load(model, device)
    prompt = prompt_of(loaded)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=1, kv_format=KV))
    ids = engine.generate_ids(prompt, SamplingParams(temperature=0.0, max_new_tokens=NEW,
                                                     ignore_eos=True))
    return {"ids": ids, "prompt": prompt}


def logits_run(model: str, device: str, tokens: list[int], n_prompt: int) -> dict:
    loaded = load(model, device)
    whole = forced_logits(loaded, tokens, [len(tokens)])
    split = forced_logits(loaded, tokens, [32, n_prompt, len(tokens)])  # the service's snapshot page
    return {"whole": whole[n_prompt - 1:].tolist(), "split": split[n_prompt - 1:].tolist()}


def child(model: str, device: str, tokens_json: str | None) -> None:
    result = one_run(model, device)
    if tokens_json:
        tokens = json.loads(tokens_json)
        result.update(logits_run(model, device, tokens, len(result["prompt"])))
    print("RESULT " + json.dumps(result))


def run_child(model: str, device: str, tokens, env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    proc = subprocess.run([sys.executable, __file__, "--child", model, device,
                           json.dumps(tokens) if tokens else ""],
                          env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        return {"error": proc.stderr[-1500:]}
    return json.loads(line[-1][7:])


def main() -> None:
    model = sys.argv[1]
    ref = run_child(model, "cpu", None, {})
    tokens = ref["prompt"] + ref["ids"]
    ref = run_child(model, "cpu", tokens, {})
    base = torch.tensor(ref["whole"])
    print(f"{model}, {KV} KV: CPU fp32 ids {ref['ids']}")
    print(f"  CPU top1 - top2 per position: "
          f"{[round(x, 3) for x in (base.topk(2, -1).values[:, 0] - base.topk(2, -1).values[:, 1]).tolist()]}")
    print(f"  CPU split vs whole: {(torch.tensor(ref['split']) - base).abs().max().item():.4f}")
    switches = [{}] + [dict([kv.split("=", 1)]) for kv in sys.argv[2:]]
    for env in switches:
        got = run_child(model, "cuda", tokens, env)
        if "error" in got:
            print(f"  cuda {env}: ERROR {got['error']}")
            continue
        first = next((i for i, (a, b) in enumerate(zip(got["ids"], ref["ids"])) if a != b), None)
        whole, split = torch.tensor(got["whole"]), torch.tensor(got["split"])
        print(f"  cuda {env or 'defaults'}: ids {'same' if first is None else f'differ from {first}'}; "
              f"max |dlogit| whole {(whole - base).abs().max().item():.3f}, "
              f"split {(split - base).abs().max().item():.3f}, "
              f"at the prompt's end {(whole[0] - base[0]).abs().max().item():.3f} / "
              f"{(split[0] - base[0]).abs().max().item():.3f}; argmax agrees "
              f"{(whole.argmax(-1) == base.argmax(-1)).float().mean().item():.2f} / "
              f"{(split.argmax(-1) == base.argmax(-1)).float().mean().item():.2f}")
    service_probe(model, ref, base)


def service_probe(model: str, ref: dict, base: torch.Tensor) -> None:
    """`tandem serve --device cuda` on the same prompt: its greedy ids, and how
    far each lies under the CPU argmax when teacher-forced through the CPU model."""
    import tempfile

    os.environ["TANDEM_TEST_DEVICE"] = "cuda"
    from tandem.v1 import generation_pb2 as pb
    from tests.test_service import Service, _generate

    svc = Service(tempfile.mkdtemp(), model=None if model == "embedded" else model,
                  extra=("--kv-format", KV))
    try:
        ids, _, _ = _generate(svc.stub, token_ids=pb.TokenIds(ids=ref["prompt"]),
                              sampling=pb.SamplingParameters(temperature=0.0),
                              max_new_tokens=NEW, ignore_eos=True, cache_salt="probe")
    finally:
        svc.close()
    loaded = load(model, "cpu")
    n = len(ref["prompt"])
    forced = forced_logits(loaded, ref["prompt"] + ids, [n + len(ids)])[n - 1:n - 1 + len(ids)]
    gap = forced.max(-1).values - forced.gather(-1, torch.tensor(ids)[:, None])[:, 0]
    first = next((i for i, (a, b) in enumerate(zip(ids, ref["ids"])) if a != b), None)
    print(f"  service (cuda): ids {'same' if first is None else f'differ from {first}'} {ids}; "
          f"its tokens under the CPU argmax (teacher-forced): max {gap.max().item():.3f}, "
          f"per position {[round(x, 3) for x in gap.tolist()]}")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4] or None)
    else:
        main()
