"""The token table in host memory (kvstore --embeddings, CausalLM.embed):
the lookup path, the arena split and the refusals, on the CPU. The
cross-device path itself (a CUDA model with its table on the host, graphs
included) is exercised by tests/test_kvstore_process.py's CUDA store test and
tests/test_cuda.py on the GPU."""
from __future__ import annotations

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.loader import load_model
from engine.model import embed_rows
from kvstore.client import StoreClient
from tandem.cli import main as tandem_main
from tests.test_kvstore_process import StoreProcess


def test_embed_rows_matches_the_lookup_for_dense_and_packed_tables():
    dense = load_model("tiny-qwen3.5", progress=False).model.model.embed_tokens
    ids = torch.tensor([5, 0, 511, 5, 17])
    torch.testing.assert_close(embed_rows(dense, ids, torch.device("cpu")), dense(ids),
                               rtol=0, atol=0)
    packed = load_model(None, progress=False, weights="native").model.model.embed_tokens
    assert hasattr(packed, "quant")  # SmolLM2's Q8_0 token table stays packed
    ids = torch.tensor([1, 49151, 300, 1])
    torch.testing.assert_close(embed_rows(packed, ids, torch.device("cpu")), packed(ids),
                               rtol=0, atol=0)


def test_a_forward_given_its_embeddings_equals_the_plain_forward():
    loaded = load_model("tiny-qwen3.5", progress=False)
    model, config = loaded.model, loaded.config

    def run(with_embeds: bool) -> torch.Tensor:
        cache = PagedKVCache(config, CacheShape(8, 8, 2), "cpu",
                             make_format("bf16", dtype=torch.float32))
        batch = ForwardBatch.build([SequenceInput((3, 9, 27, 81), 0, (0,), 0),
                                    SequenceInput((5, 7), 0, (1,), 1)], 8, "cpu")
        if with_embeds:
            batch.input_embeds = model.embed(batch) * 1.0  # a separate tensor, as a graph's
        return model(batch, cache, all_logits=True)

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)


def test_store_keeps_the_table_in_its_host_arena(tmp_path):
    store = StoreProcess(tmp_path, "--model", "tiny-qwen3.5", "--embeddings", "host",
                         "--page-size", "8", "--max-context-tokens", "128", "--live-slots", "1",
                         "--snapshot-slots", "1").wait_serving()
    try:
        with StoreClient.connect(store.socket, "reader") as c:
            table = c.model.model.embed_tokens.weight
            assert c.arenas.host.contains(table) and not c.arenas.weights.contains(table)
            others = [p for n, p in c.model.named_parameters()
                      if not n.startswith("model.embed_tokens.")]
            assert others and all(c.arenas.weights.contains(p) for p in others)
    finally:
        assert store.terminate() == 0


def test_a_tied_table_cannot_go_to_the_host(tmp_path, capsys):
    # SmolLM2 reads its table as the lm_head every step
    assert tandem_main(["plan", "--embeddings", "host", "--gpu-memory-budget", "24GiB"]) == 2
    assert "ties its token table" in capsys.readouterr().err
    assert tandem_main(["plan", "--embeddings", "auto", "--gpu-memory-budget", "24GiB"]) == 0
    assert "token table" not in capsys.readouterr().out


def test_cli_offers_exactly_the_stores_embedding_places():
    """tandem/cli.py spells the choices out to keep its imports light; they
    must stay the store's own list."""
    import argparse

    from kvstore.memory import EMBEDDING_PLACES
    from tandem.cli import _add_embeddings_flag

    parser = argparse.ArgumentParser()
    _add_embeddings_flag(parser)
    action = next(a for a in parser._actions if a.dest == "embeddings")
    assert tuple(action.choices) == EMBEDDING_PLACES and action.default in EMBEDDING_PLACES
