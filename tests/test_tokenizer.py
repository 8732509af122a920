"""Tokenizers: the one rebuilt from the embedded GGUF against transformers'
tokenizer from the same file, chat templates against transformers'
apply_chat_template, streaming detokenization, the tokenizer.json path and
the byte tokenizer of dummy models."""
from __future__ import annotations

import json

import gguf
import pytest

from engine.errors import InvalidRequestError, ModelLoadError
from engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer
from engine.weights.gguf import embedded_model_path, open_gguf

EMBEDDED = embedded_model_path()

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "Call 555-0123 or 1234567890; pi is 3.14159265358979 and 2**64 = 18446744073709551616.",
    "naïve café, Ünïcödé 😀🎉👩‍👩‍👧 日本語のテキスト 中文 한국어 Ω≈ç√",
    "spaces:   three,\ttab,\n\n\nnewlines,    trailing   ",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they're here; we'll see. DON'T SHOUT",
    "",
]
MULTIBYTE = "日本語のテキスト 😀🎉 and ünïcödé 👩‍👩‍👧 中文 ✓ — done"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? <b>&amp;</b>"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(EMBEDDED))  # a gguf.GGUFReader (subclass)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(EMBEDDED.parent), gguf_file=EMBEDDED.name)


# ---------------------------------------------------------------------------
# GGUF tokenizer vs transformers
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_decode_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens(ours, reference):
    assert ours.encode("<|im_start|>") == [1] and ours.token_to_id("<|im_end|>") == 2
    assert ours.id_to_token(1) == "<|im_start|>"
    assert ours.vocab_size == len(reference) == 49152
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.add_bos_token is False  # SmolLM2's metadata says no BOS
    # eos from metadata first, then registered end-of-turn specials
    assert ours.eos_token_ids[0] == reference.eos_token_id == 2
    assert set(ours.eos_token_ids) == {2, 0}  # <|im_end|>, <|endoftext|>


def test_chat_template_matches_transformers(ours, reference):
    for messages in (CONVERSATION, CONVERSATION[1:]):  # with and without a system turn
        for prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == expected


def test_chat_template_helpers(ours):
    ours_template = ours.chat_template
    try:
        ours.chat_template = ("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|"
                              "{{ tools[0].name }}|{{ bos_token }}|{{ enable_thinking }}"
                              "{% if messages | length > 1 %}{{ raise_exception('one only') }}{% endif %}")
        text = ours.apply_chat_template([{"role": "user", "content": "<a & b>"}],
                                        tools=[{"name": "calc"}], enable_thinking=False)
        assert text == '[{"role": "user", "content": "<a & b>"}]|4|calc|<|im_start|>|False'
        with pytest.raises(InvalidRequestError, match="one only"):
            ours.apply_chat_template(CONVERSATION, tools=[{"name": "calc"}])
        with pytest.raises(InvalidRequestError):
            ours.apply_chat_template("not a list")
    finally:
        ours.chat_template = ours_template


def test_chatml_fallback_without_template():
    tok = ByteTokenizer(512)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------
def _stream(tokenizer, ids, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(i) for i in ids]
    return deltas, detok.flush()


def test_incremental_detokenizer_multibyte(ours):
    ids = ours.encode(MULTIBYTE * 3, add_special_tokens=False)
    deltas, tail = _stream(ours, ids, prompt=ours.encode("<|im_start|>assistant\n"))
    assert "".join(deltas) + tail == ours.decode(ids) == MULTIBYTE * 3
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some characters span tokens and were held back


def test_incremental_detokenizer_specials_and_whitespace(ours):
    for text in TEXTS:
        ids = ours.encode(text)
        deltas, tail = _stream(ours, ids)
        assert "".join(deltas) + tail == ours.decode(ids), text


def test_incremental_detokenizer_flushes_a_cut_character():
    tok = ByteTokenizer(300)
    ids = list("ok 😀".encode())[:-2]  # the emoji loses its last two bytes
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) == "ok " and tail == "\ufffd"
    assert "".join(deltas) + tail == tok.decode(ids)


def test_incremental_detokenizer_window_stays_small(ours):
    detok = IncrementalDetokenizer(ours)
    ids = ours.encode("word " * 2000, add_special_tokens=False)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == "word " * 2000
    assert len(detok._ids) < 100  # emitted tokens are dropped: O(1) work per token


# ---------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------
def test_hf_dir_round_trip(tmp_path, ours, reference):
    reference.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text) == reference.encode(text), text
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.apply_chat_template(CONVERSATION) == ours.apply_chat_template(CONVERSATION)
    assert loaded.eos_token_ids[0] == 2 and loaded.bos_token_id == 1
    assert not loaded.add_bos_token


def test_hf_dir_flags_and_generation_config(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["add_bos_token"] = True
    config_file.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos_token and tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id
    assert 5 in tok.eos_token_ids  # a list in generation_config.json
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---------------------------------------------------------------------------
# Byte tokenizer for dummy models
# ---------------------------------------------------------------------------
def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(512)
    ids = tok.encode(MULTIBYTE)
    assert ids[0] == tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    assert max(ids[1:]) < 256 and tok.decode(ids[1:]) == MULTIBYTE
    assert tok.decode(ids, skip_special_tokens=True) == MULTIBYTE
    assert tok.encode("a<eos>", add_special_tokens=False) == [97, 257]
    assert tok.decode([97, 300, 257]) == "a<eos>"  # ids past the bytes decode to nothing
    assert tok.vocab_size == 512 and tok.token_to_id("<0x61>") == 97 and tok.id_to_token(97) == "<0x61>"
    with pytest.raises(ValueError, match="258"):
        ByteTokenizer(257)


# ---------------------------------------------------------------------------
# Other GGUF vocabularies, on tiny synthetic files, against transformers
# ---------------------------------------------------------------------------
SYNTHETIC_TEXTS = ["the cat in the hat 1234567", "  the\n\nthe\t<|im_start|>x<|im_end|><think>",
                   "I'LL héllo 😀 wörld", ""]


def _write_vocab_gguf(path, model: str, tokens, types, *, pre=None, merges=None, scores=None):
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(tokens.index("<s>") if "<s>" in tokens else 0)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _byte_level_vocab():
    from engine.tokenizer import _byte_alphabet

    tokens = list(_byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a t", "Ġ c", "Ġc at", "1 2", "12 3", "Ġ h"]
    tokens += [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    return tokens + specials, [1] * len(tokens) + [3, 3, 3, 4], merges


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2", "qwen35"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    from transformers import AutoTokenizer

    tokens, types, merges = _byte_level_vocab()
    _write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, pre=pre, merges=merges)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "v.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="v.gguf")
    for text in SYNTHETIC_TEXTS:
        assert tok.encode(text) == ref.encode(text), (pre, text)
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("<think>", add_special_tokens=False)) == 1
    assert tok.eos_token_ids == (tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"))


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    """llama.cpp (and SmolLM's own tokenizer.json) split every digit before
    GPT-2's regex; transformers' GGUF loader does not know "smollm", so this
    one is checked by its rule rather than against transformers."""
    tokens, types, merges = _byte_level_vocab()
    built = {}
    for pre in ("smollm", "default"):
        _write_vocab_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, types, pre=pre, merges=merges)
        built[pre] = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / f"{pre}.gguf"))
    digits = built["smollm"].encode("x 1234567")
    assert [built["smollm"].decode([i]) for i in digits] == ["x", " ", *"1234567"]
    assert len(built["default"].encode("x 1234567")) < len(digits)  # "12", "123" merge there
    for text in ("the cat in the hat", "  the\n\nthe\t<|im_start|>x<think>"):
        assert built["smollm"].encode(text) == built["default"].encode(text)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    """tokenizer.ggml.model "llama": '▁' pieces, byte fallback, merges from scores."""
    from transformers import AutoTokenizer

    pieces = ["▁", "t", "h", "e", "c", "a", "i", "n", "▁t", "he", "▁the", "at", "▁c", "▁cat",
              "in", "▁in", "1", "2"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
              "<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 3, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    _write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert tok.add_bos_token  # llama.cpp's default for SentencePiece vocabularies
    for text in SYNTHETIC_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        deltas, tail = _stream(tok, ids)
        assert "".join(deltas) + tail == tok.decode(ids)


# ---------------------------------------------------------------------------
# Tools in chat templates
# ---------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'},
]
# A template that takes tools, in the way Qwen's does (a <tools> system block,
# tool calls from message.tool_calls, tool results as user turns).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_reach_a_template_that_takes_them(ours, reference):
    saved = ours.chat_template
    try:
        ours.chat_template = TOOL_TEMPLATE
        expected = reference.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=True,
                                                 chat_template=TOOL_TEMPLATE)
        assert ours.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS) == expected
        assert "<tools>" in expected and "# Tools" not in expected  # no fallback block
    finally:
        ours.chat_template = saved


def test_tools_fallback_for_a_template_without_them(ours, reference):
    from engine.tokenizer import template_takes_tools, tools_as_text

    assert not template_takes_tools(ours.chat_template) and template_takes_tools(TOOL_TEMPLATE)
    text = ours.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    # the model's own template renders the rewritten conversation (transformers as the oracle)
    rewritten = tools_as_text(TOOL_CONVERSATION, TOOLS)
    assert text == reference.apply_chat_template(rewritten, tokenize=False,
                                                 add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response>" in text
    # a system message keeps its text, the block goes after it
    with_system = ours.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            *TOOL_CONVERSATION[:1]], tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # no tools anywhere: the plain rendering, untouched
    assert ours.apply_chat_template(CONVERSATION) == reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)
