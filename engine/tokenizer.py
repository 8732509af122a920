"""Text <-> token ids, chat templates and streaming detokenization.

Owns one `Tokenizer` interface with three sources:
  * a Hugging Face directory (tokenizer.json + tokenizer_config.json ...),
  * GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys), rebuilt into an HF
    fast tokenizer so both paths share one implementation (the Rust
    `tokenizers` library),
  * `ByteTokenizer`, a trivial byte vocabulary for random-weight dummy shapes.

It also owns chat-template rendering (jinja2, sandboxed, with the helpers HF
templates expect) and `IncrementalDetokenizer`, which turns a token stream into
text deltas that never split a UTF-8 character.

Nothing here knows about models, devices or requests.
"""
from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer

from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

# --- GGUF vocabulary conventions (llama.cpp's llama_token_type) ------------
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes, keyed by `tokenizer.ggml.pre`. They are the
# ones llama.cpp's llama-vocab.cpp and the models' own tokenizer.json use.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_OF_PRE = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}
# GPT-2's regex after splitting every digit on its own (SmolLM, StarCoder).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}
# Plain GPT-2 byte-level pre-tokenization.
_GPT2_PRE = {"default", "gpt2", "gpt-2"}
# Qwen's own tokenizer.json NFC-normalizes input before splitting.
_NFC_PRE = {"qwen2", "deepseek-r1-qwen", "qwen35"}

# Special tokens that end a turn or a document in common chat formats. A token
# joins `eos_token_ids` only if it exists AND is registered special, so a
# vocabulary that merely spells "<|end|>" as text is never cut short.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>",
                       "<|end_of_text|>", "<end_of_turn>", "<|end|>")

# What a model without a chat template gets (documented in apply_chat_template).
CHATML_FALLBACK = "chatml"


# ===========================================================================
# The common interface
# ===========================================================================
class BaseTokenizer:
    """What the engine needs from any tokenizer. Subclasses fill in the
    token-level methods; chat templating is shared."""

    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    chat_template: str | None = None

    # token level -------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # chat --------------------------------------------------------------
    def _template_for(self, tools: list[dict] | None) -> str | None:
        return self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt text for a conversation.

        Renders the model's jinja template with the variables HF templates
        expect (messages, tools, add_generation_prompt, bos_token, eos_token and
        any extra kwargs such as enable_thinking). A model without a template
        gets plain ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per
        message, then `<|im_start|>assistant\\n` when add_generation_prompt.
        A template that never reads `tools` (and ChatML) gets tools, tool calls
        and tool results as text in Qwen's format instead (`tools_as_text`).
        The result is text: encode it with add_special_tokens=False, since the
        template writes any BOS itself.
        """
        _check_messages(messages)
        template = self._template_for(tools)
        if not template_takes_tools(template) and _uses_tools(messages, tools):
            messages, tools = tools_as_text(messages, tools), None
        if template is None:
            return render_chatml(messages, add_generation_prompt)
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                    if v is not None}
        return render_chat_template(template, messages=messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    **specials, **kwargs)


# ===========================================================================
# The real tokenizer: an HF fast tokenizer plus the facts around it
# ===========================================================================
class Tokenizer(BaseTokenizer):
    """A `tokenizers.Tokenizer` with BOS/EOS policy, stop tokens and a chat
    template. Build it with `from_hf_dir` or `from_gguf`.

    The BOS policy lives in the fast tokenizer's post-processor, so
    `encode(text)` adds BOS exactly when the model's config says so and
    `encode(text, add_special_tokens=False)` never does.
    """

    def __init__(self, fast: FastTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Iterable[int | None] = (),
                 chat_template: str | None = None,
                 named_templates: dict[str, str] | None = None) -> None:
        self._fast = fast
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = fast.token_to_id(bos_token) if bos_token is not None else None
        self.chat_template = chat_template
        self._named_templates = named_templates or {}
        first_eos = [fast.token_to_id(eos_token)] if eos_token is not None else []
        self.eos_token_ids = _stop_token_ids(fast, [*first_eos, *eos_token_ids])
        # read back from the post-processor rather than trusting a flag
        probe = fast.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(probe) and probe[0] == self.bos_token_id

    # --- construction ---------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json and its companions from a model directory."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (tandem reads only fast tokenizers; "
                                 "re-save the tokenizer with transformers' save_pretrained)")
        try:
            fast = FastTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelLoadError(f"{file}: cannot read the tokenizer ({e})") from e
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        bos = (_token_text(config.get("bos_token"))
               or _id_text(fast, model_config.get("bos_token_id")))
        eos = (_token_text(config.get("eos_token"))
               or _id_text(fast, model_config.get("eos_token_id")))
        # transformers rebuilds the post-processor from the flags when they are
        # given explicitly or when tokenizer.json has none; we do the same.
        if "add_bos_token" in config or "add_eos_token" in config or fast.post_processor is None:
            try:
                _set_bos_eos(fast, bos if config.get("add_bos_token") else None,
                             eos if config.get("add_eos_token") else None)
            except ModelLoadError as e:
                raise ModelLoadError(f"{path}: {e}") from e
        default, named = _hf_chat_templates(path, config)
        return cls(fast, bos_token=bos, eos_token=eos,
                   eos_token_ids=[*_as_ids(generation.get("eos_token_id")),
                                  *_as_ids(model_config.get("eos_token_id"))],
                   chat_template=default, named_templates=named)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF file describes (`reader` is a
        gguf.GGUFReader). Supports `tokenizer.ggml.model` "gpt2" (byte-level
        BPE) and "llama" (SentencePiece-style BPE with byte fallback)."""
        meta = _GGUFVocab(reader)
        if meta.model == "gpt2":
            fast = _byte_level_bpe(meta)
        elif meta.model == "llama":
            fast = _sentencepiece_bpe(meta)
        else:
            raise UnsupportedModelError(
                f"tokenizer model {meta.model!r} is not supported; tandem reads 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies")
        _register_special_tokens(fast, meta.tokens, meta.types)
        bos, eos = meta.token(meta.bos_id), meta.token(meta.eos_id)
        _set_bos_eos(fast, bos if meta.add_bos else None, eos if meta.add_eos else None)
        return cls(fast, bos_token=bos, eos_token=eos, eos_token_ids=[meta.eot_id, meta.eom_id],
                   chat_template=meta.chat_template, named_templates=meta.named_templates)

    # --- token level ----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def fast(self) -> FastTokenizer:
        """The underlying HF `tokenizers.Tokenizer`."""
        return self._fast

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works and encode holds it:
        # the router tokenizes on a thread while its event loop streams the
        # other requests' tokens (12 MB of text is 5 s of tokenizing)
        return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._fast.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._fast.id_to_token(token_id)

    def _template_for(self, tools: list[dict] | None) -> str | None:
        # HF convention: a "tool_use" template, when a model ships one, is for tool calls
        if tools and "tool_use" in self._named_templates:
            return self._named_templates["tool_use"]
        return self.chat_template


# ===========================================================================
# GGUF vocabularies
# ===========================================================================
def _gguf_value(reader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


class _GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF file, read once."""

    def __init__(self, reader) -> None:
        self.model = _gguf_value(reader, "tokenizer.ggml.model")
        self.pre = _gguf_value(reader, "tokenizer.ggml.pre", "default")
        self.tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens") or []
        if not self.tokens:
            raise ModelLoadError("the file has no tokenizer.ggml.tokens: it carries no vocabulary")
        self.types: list[int] = (_gguf_value(reader, "tokenizer.ggml.token_type")
                                 or [_NORMAL] * len(self.tokens))
        self.scores: list[float] | None = _gguf_value(reader, "tokenizer.ggml.scores")
        self.merges: list[str] | None = _gguf_value(reader, "tokenizer.ggml.merges")
        self.bos_id = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
        self.eos_id = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
        self.eot_id = _gguf_value(reader, "tokenizer.ggml.eot_token_id")
        self.eom_id = _gguf_value(reader, "tokenizer.ggml.eom_token_id")
        self.unk_id = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
        # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise
        self.add_bos = bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token",
                                        self.model == "llama"))
        self.add_eos = bool(_gguf_value(reader, "tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(_gguf_value(reader, "tokenizer.ggml.add_space_prefix", True))
        self.chat_template = _gguf_value(reader, "tokenizer.chat_template")
        # llama.cpp writes extra named templates as tokenizer.chat_template.<name>
        prefix = "tokenizer.chat_template."
        self.named_templates = {key[len(prefix):]: _gguf_value(reader, key)
                                for key in reader.fields if key.startswith(prefix)}

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_spelling(token: str) -> str:
    return "".join(_byte_alphabet()[b] for b in token.encode("utf-8"))


def _vocab_dict(tokens: list[str], types: list[int], respell=None) -> dict[str, int]:
    """token -> id, keeping the first id of a duplicated spelling."""
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if respell is not None and kind not in (_CONTROL, _USER_DEFINED, _UNKNOWN):
            token = respell(token)
        vocab.setdefault(token, i)
    return vocab


def _file_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        # the Rust BPE refuses merges of unknown pieces; a file with one is odd
        # but the rest of its merges are still right
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    return pairs


def _byte_level_bpe(meta: _GGUFVocab) -> FastTokenizer:
    alphabet = set(_byte_alphabet().values())

    def respell(token: str) -> str:
        # a normal token written outside the byte alphabet is raw text: spell it as bytes
        return token if set(token) <= alphabet else _byte_level_spelling(token)

    vocab = _vocab_dict(meta.tokens, meta.types, respell)
    merges = _file_merges(meta.merges or [], vocab)
    # Llama 3's tokenizer takes a whole-word vocabulary hit before merging
    ignore_merges = meta.pre in ("llama-bpe", "llama3", "llama-v3")
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    fast.pre_tokenizer = _byte_level_pre_tokenizer(meta.pre)
    if meta.pre in _NFC_PRE:
        fast.normalizer = normalizers.NFC()
    fast.decoder = decoders.ByteLevel()
    return fast


def _byte_level_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLIT_OF_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_OF_PRE[pre]), behavior="isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRE:
        log.warning("GGUF pre-tokenizer %r is not known to tandem; using GPT-2's split, "
                    "which may tokenize some text differently from llama.cpp", pre)
    return gpt2


def _sentencepiece_bpe(meta: _GGUFVocab) -> FastTokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral v1): '▁' marks spaces, byte
    fallback tokens <0xNN> cover the rest, merge order follows scores."""
    vocab = _vocab_dict(meta.tokens, meta.types)
    if meta.merges:
        merges = _file_merges(meta.merges, vocab)
    else:
        merges = _merges_from_scores(meta.tokens, meta.types, meta.scores, vocab)
    unk = meta.token(meta.unk_id)
    if unk is None:
        unk = next((t for t, k in zip(meta.tokens, meta.types) if k == _UNKNOWN), None)
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                                    fuse_unk=True, byte_fallback=True))
    fast.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if meta.add_space_prefix else "never",
        split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    fast.decoder = decoders.Sequence(steps)
    return fast


def _merges_from_scores(tokens, types, scores, vocab) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the pair whose result scores highest; listing
    every (left, right) split of every normal token, best score first,
    gives the same order to a rank-based BPE."""
    if scores is None:
        raise ModelLoadError("a SentencePiece vocabulary without scores or merges "
                             "cannot be rebuilt")
    ranked = []
    for token, kind, score in zip(tokens, types, scores):
        if kind != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _register_special_tokens(fast: FastTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special (matched whole, skippable on decode);
    user-defined ones are matched whole but are ordinary text. Both keep
    their file ids because their spelling is already in the model vocab."""
    control = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if t and k in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if t and k == _USER_DEFINED]
    if control:
        fast.add_special_tokens(control)
    if user:
        fast.add_tokens(user)


def _set_bos_eos(fast: FastTokenizer, bos: str | None, eos: str | None) -> None:
    """Make encode(add_special_tokens=True) add exactly these tokens."""
    specials = [(t, fast.token_to_id(t)) for t in (bos, eos) if t is not None]
    if any(i is None for _, i in specials):
        raise ModelLoadError(f"BOS/EOS token {specials} is not in the vocabulary")
    single = ([bos] if bos else []) + ["$A"] + ([eos] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    fast.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))


def _stop_token_ids(fast: FastTokenizer, candidates: Iterable[int | None]) -> tuple[int, ...]:
    """EOS ids from the config, then registered special end-of-turn tokens."""
    vocab = fast.get_vocab_size(with_added_tokens=True)
    ids = [i for i in candidates if isinstance(i, int) and 0 <= i < vocab]
    special = {i for i, t in fast.get_added_tokens_decoder().items() if t.special}
    for text in _END_OF_TURN_TOKENS:
        i = fast.token_to_id(text)
        if i is not None and i in special:
            ids.append(i)
    return tuple(dict.fromkeys(ids))


# ===========================================================================
# HF directory helpers
# ===========================================================================
def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as text or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_text(fast: FastTokenizer, value: Any) -> str | None:
    ids = _as_ids(value)
    return fast.id_to_token(ids[0]) if ids else None


def _as_ids(value: Any) -> list[int]:
    """generation_config's eos_token_id is an int or a list of ints."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _hf_chat_templates(path: Path, config: dict) -> tuple[str | None, dict[str, str]]:
    """(default template, named templates). chat_template.jinja wins over
    chat_template.json, which wins over tokenizer_config.json."""
    raw: Any = config.get("chat_template")
    if (path / "chat_template.json").is_file():
        raw = _read_json(path / "chat_template.json").get("chat_template", raw)
    if (path / "chat_template.jinja").is_file():
        raw = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(raw, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
        return named.get("default", next(iter(named.values()), None)), named
    return (raw if isinstance(raw, str) else None), {}


# ===========================================================================
# Chat templates
# ===========================================================================
class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for
    training masks in some HF templates; for inference it just renders."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ': prompts are not HTML
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not compile (line {e.lineno}: "
                             f"{e.message})") from e


@lru_cache(maxsize=32)
def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable at all (Qwen's,
    Llama 3.1's do; SmolLM2's does not)."""
    if template is None:
        return False
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.exceptions.TemplateSyntaxError:
        return False  # _compiled reports it when rendering


def _uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n"
                  "<tools>")
TOOLS_INSTRUCTIONS = ("</tools>\n\nFor each function call, return a json object with function "
                      "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                      "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def tools_as_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Tools for a template that cannot render them, written as Qwen2.5 does:
    the function signatures in a `<tools>` block of the system message (added
    when there is none), each assistant tool call as a `<tool_call>{json}</tool_call>`
    line after its text, each tool result as a user turn in `<tool_response>`
    tags. The model then answers in the format the gateway parses."""
    out = [dict(m) for m in messages]
    if tools:
        block = "\n".join([TOOLS_PREAMBLE, *(_tojson(t) for t in tools), TOOLS_INSTRUCTIONS])
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{_content_text(out[0].get('content'))}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    for m in out:
        if m.get("tool_calls"):
            calls = [_tool_call_text(c) for c in m.pop("tool_calls")]
            m["content"] = "\n".join(filter(None, [_content_text(m.get("content")), *calls]))
        elif m.get("role") == "tool":
            m["role"] = "user"
            m["content"] = f"<tool_response>\n{_content_text(m.get('content'))}\n</tool_response>"
    return out


def _tool_call_text(call: dict) -> str:
    function = call.get("function", call)
    return ("<tool_call>\n" + _tojson({"name": function.get("name"),
                                        "arguments": function.get("arguments")})
            + "\n</tool_call>")


def render_chat_template(template: str, **variables: Any) -> str:
    """Render an HF-style chat template; a template that rejects the
    conversation (raise_exception, bad fields) is the request's fault."""
    compiled = _compiled(template)
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequestError(f"the chat template rejected the conversation: {e}") from e
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e


def render_chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    parts = [f"<|im_start|>{m['role']}\n{_content_text(m.get('content'))}<|im_end|>\n"
             for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    """OpenAI-style content may be a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidRequestError("messages must be a list of objects, each with a string 'role'")


# ===========================================================================
# Streaming detokenization
# ===========================================================================
class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a UTF-8 character.

    Prefix/read offsets: `prefix` marks the start of a small window of already
    emitted tokens that gives the next token its context (a byte-level token
    may be half a character; a SentencePiece token's leading '▁' depends on
    what precedes it), `read` marks the end of what was emitted. Each push
    decodes only the window and emits the text beyond the window's old text,
    unless that text ends in U+FFFD (an incomplete character: wait for more
    bytes). Work per token is bounded by the window, not by the output length.

    Contract: "".join(push(t) for t in ids) + flush() == tokenizer.decode(ids).
    The deltas describe the generated ids alone, so `prompt_ids` is accepted
    for the callers' convenience but not decoded: left context from the prompt
    would make the text differ from decode(ids) (a SentencePiece decoder keeps
    a leading space it strips at the start; a character split across the
    prompt boundary would be completed rather than shown as U+FFFD).
    """

    _TRIM_AFTER = 64  # drop emitted ids from the front once this many pile up

    def __init__(self, tokenizer: BaseTokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0    # end of the emitted tokens
        self._prefix_text = ""  # decode(ids[prefix:read]), kept to save a decode per push

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """The text this token completes (often "", while a character is partial)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Whatever is held back, even an incomplete character (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        return self._emit(text) if len(text) > len(self._prefix_text) else self._advance("")

    def _emit(self, text: str) -> str:
        return self._advance(text[len(self._prefix_text):])

    def _advance(self, delta: str) -> str:
        # the tokens just emitted become the context window of the next push
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        if self._prefix >= self._TRIM_AFTER:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta


# ===========================================================================
# Dummy models
# ===========================================================================
class ByteTokenizer(BaseTokenizer):
    """Bytes as tokens, for random-weight shapes: ids 0..255 are the bytes,
    256 is <bos>, 257 is <eos>; ids above that (a dummy vocabulary is larger)
    decode to nothing. The literal text "<bos>"/"<eos>" encodes to those ids.
    No chat template: the ChatML fallback, written as plain bytes."""

    BOS_ID, EOS_ID = 256, 257
    _SPECIALS = {"<bos>": BOS_ID, "<eos>": EOS_ID}
    _SPECIAL_SPLIT = re.compile("(<bos>|<eos>)")

    def __init__(self, vocab_size: int, add_bos_token: bool = True) -> None:
        if vocab_size < 258:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 258 (256 bytes, <bos>, <eos>), "
                             f"got {vocab_size}")
        self._vocab_size = int(vocab_size)
        self.bos_token, self.eos_token = "<bos>", "<eos>"
        self.bos_token_id = self.BOS_ID
        self.eos_token_ids = (self.EOS_ID,)
        self.add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS_ID] if add_special_tokens and self.add_bos_token else []
        for piece in self._SPECIAL_SPLIT.split(text):
            if piece in self._SPECIALS:
                ids.append(self._SPECIALS[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i in (self.BOS_ID, self.EOS_ID) and not skip_special_tokens:
                out += (self.bos_token if i == self.BOS_ID else self.eos_token).encode()
        return out.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self._SPECIALS:
            return self._SPECIALS[token]
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        if match:
            return int(match.group(1), 16)
        match = re.fullmatch(r"<unused(\d+)>", token)
        if match and 258 <= int(match.group(1)) < self._vocab_size:
            return int(match.group(1))
        return None

    def id_to_token(self, token_id: int) -> str | None:
        if 0 <= token_id < 256:
            return f"<0x{token_id:02X}>"
        if token_id == self.BOS_ID:
            return self.bos_token
        if token_id == self.EOS_ID:
            return self.eos_token
        return f"<unused{token_id}>" if token_id < self._vocab_size else None
