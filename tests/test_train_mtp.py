"""`tandem train-mtp`: the corpus, the prompt masking, the held-out measure
and that training moves the head toward the base model's greedy choices."""
from dataclasses import replace

import pytest
import torch

from bench.speculative import CHAT, CODE
from engine.loader import load_model
from engine.speculative.prompts import (DEV_CHAT, DEV_CODE, NATURAL_CHAT, TEST_CHAT, TEST_CODE,
                                        VARIED_CODE_TASKS,
                                        VARIED_LANGUAGES, chat_requests, code_tasks,
                                        extract_question,
                                        question_requests, training_prompts, varied_prompts)
from engine.speculative.train import (IGNORE, Corpus, DevChoice, EngineKV, Example, TrainConfig,
                                      _token_bounded_groups, base_features, dev_examples,
                                      evaluate, generate_corpus, head_forward, head_from_file,
                                      init_head, make_examples, pack_examples, pairs_at_depth,
                                      train_head, unrolled_loss)


def test_benchmark_prompts_are_held_out_of_training():
    prompts = set(training_prompts())
    assert len(prompts) == len(training_prompts()) > 500
    assert not prompts & set(CHAT + CODE)


def test_dev_prompts_are_held_out_too():
    dev = set(DEV_CHAT + DEV_CODE)
    assert len(dev) == 36 and not dev & set(CHAT + CODE) and not dev & set(training_prompts())


def test_the_third_held_out_set_is_held_out_of_training_dev_and_the_first_six():
    test = set(TEST_CHAT + TEST_CODE)
    assert len(test) == 48 and not test & {*CHAT, *CODE, *DEV_CHAT, *DEV_CODE}
    every = set(training_prompts()) | set(varied_prompts(100_000)) | set(chat_requests())
    assert not test & every


# Words of the dev set's, both benchmark sets' and DEV_CODE's chat subjects:
# no hand-written chat request (NATURAL_CHAT, chat_requests/*.txt) may use
# one, so the held-out figures read subjects the head never trained on.
# (VARIED_TOPICS predates the dev set and touches a few.)
HELD_OUT_SUBJECT_WORDS = (
    "refrigerator", "fridge", "hik(e|ing)", "sky", "sleep", "climate", "weather", "robots?",
    "bees?", "honey", "study(ing)?", "salt(y)?", "ocean", "thunder", "deserts?", "day off",
    "from home", "apartment", "blacksmith", "purr", "soup", "friendship", "good friend",
    "vaccines?", "immune", "credit card", "stress", "train station", "roots?", "adopt",
    "exercise", "rainbow", "autumn", "leaders?", "airplanes?", "lighthouse", "gps", "snacks?",
    "budget", "future self", "eclipses?", "dreams?", "closet", "feedback", "ancient rome",
    "submarines?", "spicy", "basketball")


@pytest.mark.parametrize("source", ["NATURAL_CHAT", "chat_requests"])
def test_hand_written_requests_avoid_every_held_out_subject(source):
    import re

    requests = list(NATURAL_CHAT) if source == "NATURAL_CHAT" else chat_requests()
    assert len(requests) == len(set(requests)) >= 1000
    assert not set(requests) & {*CHAT, *CODE, *DEV_CHAT, *DEV_CODE}
    for word in HELD_OUT_SUBJECT_WORDS:
        hits = [p for p in requests if re.search(rf"\b{word}\b", p.lower())]
        assert not hits, (word, hits[:3])
    assert all(p.isascii() and p == p.strip() and p[-1] in ".?!" for p in requests)


def test_the_request_files_add_69500_requests_of_their_own():
    requests = chat_requests()
    assert len(requests) >= 69500 and not set(requests) & set(NATURAL_CHAT)


def test_code_tasks_avoid_the_held_out_code_subjects_and_join_the_varied_prompts():
    tasks = code_tasks()
    assert len(tasks) == len(set(tasks)) >= 160 and not set(tasks) & set(VARIED_CODE_TASKS)
    for word in ("fibonacci", "stack", "debounce", "longest line", "buffer", "first letter",
                 "prime", "queue", "reverse", "words in a text", "linked list", "sorted lists",
                 "throttle"):
        assert not [t for t in tasks if word in t.lower()], word
    every = varied_prompts(100_000)
    for task in tasks[:8]:  # each task asked in every language, once
        asked = [p for p in every if f"that {task}" in p]
        assert len(asked) == len(dict.fromkeys(VARIED_LANGUAGES)), (task, asked)


def test_varied_prompts_are_distinct_seeded_mixed_and_never_a_benchmark_prompt():
    every = varied_prompts(100_000)
    assert len(set(every)) == len(every) > 2000
    assert not set(every) & set(CHAT + CODE)
    # no benchmark subject either (exercise, rainbows, autumn leaves, leaders,
    # flight, lighthouses; Fibonacci, stacks, debouncing, ...)
    for word in ("exercise", "rainbow", "autumn", "leader", "airplane", "lighthouse",
                 "fibonacci", "stack", "debounce", "longest line", "buffer", "first letter"):
        assert not [p for p in every if word in p.lower()], word
    assert not set(every) & set(DEV_CHAT + DEV_CODE)
    # the natural requests are all there, some in the tail train-mtp holds out
    for natural in (NATURAL_CHAT, chat_requests()):
        assert set(natural) <= set(every) and set(natural) & set(every[-len(every) // 10:])
    first = varied_prompts(200)
    assert first == every[:200] == varied_prompts(200, seed=0) != varied_prompts(200, seed=1)
    code = sum(("function" in p or "class" in p or " code " in p) for p in first)
    assert 0.25 * len(first) < code < 0.6 * len(first)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", device="cpu", progress=False)


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.pt"
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, corpus_path=str(path))
    made = generate_corpus(tiny, cfg)
    again = generate_corpus(tiny, cfg)  # read back, not regenerated
    assert (again.samples, again.prompt_lengths, again.greedy) == \
        (made.samples, made.prompt_lengths, made.greedy)
    return made


def test_a_corpus_file_is_a_cache_that_only_answers_new_prompts(tiny, corpus, tmp_path,
                                                               monkeypatch):
    """More prompts over a saved corpus: only their samples are generated, the
    old ones are read back unchanged, and fewer prompts take a subset while
    the file keeps everything it ever held."""
    import engine.speculative.train as train

    path = tmp_path / "corpus.pt"
    Corpus(corpus.samples[:20], corpus.prompt_lengths[:20], corpus.greedy[:20]).save(str(path))
    asked = []
    real = train._generated
    monkeypatch.setattr(train, "_generated",
                        lambda engine, prompts, params: asked.append(len(prompts))
                        or real(engine, prompts, params))
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=12, corpus_path=str(path))
    grown = generate_corpus(tiny, cfg)
    assert asked == [4]  # prompts 11 and 12, two samples each
    assert grown.samples[:20] == corpus.samples[:20] and grown.greedy == [True, False] * 12
    assert len(Corpus.load(str(path)).samples) == 24
    fewer = generate_corpus(tiny, TrainConfig(samples_per_prompt=1, new_tokens=12, max_prompts=10,
                                              corpus_path=str(path)))
    assert asked == [4] and fewer.samples == corpus.samples[:20:2] and all(fewer.greedy)
    assert len(Corpus.load(str(path)).samples) == 24


def test_corpus_is_prompt_plus_answer_with_one_greedy_sample_per_prompt(corpus):
    assert len(corpus.samples) == 40 and corpus.greedy == [True, False] * 20
    for tokens, n in zip(corpus.samples, corpus.prompt_lengths):
        assert 0 < n < len(tokens) <= n + 12


def test_prompt_positions_carry_no_label(tiny, corpus):
    for e, n in zip(make_examples(tiny.model, corpus), corpus.prompt_lengths):
        assert bool((e.labels[:n] == IGNORE).all()) and bool((e.labels[n:] != IGNORE).all())
        # the label is the base's own greedy choice: greedy answers follow it
        if e.greedy:
            assert e.labels[n:-1].tolist() == e.tokens[n + 1:].tolist()


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen3.5"])
def test_features_of_a_batch_equal_each_sample_alone(model_name, corpus):
    """base_features runs many samples in one forward: each sample's hidden
    and greedy choices are what a forward of it alone gives (the hybrid
    model's GDN state stays in its own slot)."""
    model = load_model(model_name, device="cpu", progress=False).model
    samples = [t[:40] for t in corpus.samples[:5]]
    together = base_features(model, samples)
    for tokens, (hidden, greedy, _) in zip(samples, together):
        [(alone_hidden, alone_greedy, _)] = base_features(model, [tokens])
        assert hidden.shape == (len(tokens), model.config.hidden_size)
        torch.testing.assert_close(hidden, alone_hidden, rtol=1e-4, atol=1e-4)
        assert greedy.tolist() == alone_greedy.tolist()


def test_feature_groups_keep_order_and_bound_their_tokens():
    samples = [[0] * n for n in (5, 5, 3, 12, 1, 1)]
    assert _token_bounded_groups(samples, 10) == [[0, 1], [2], [3], [4, 5]]


def test_packed_samples_see_only_themselves(tiny, corpus):
    """pack_examples: each sample's pairs get the head outputs and labels they
    get alone, at every depth; pairs that would span two samples get none."""
    model = tiny.model
    a, b, c = make_examples(model, corpus)[:3]
    packed = pack_examples([a, b, c])
    head = init_head(model)
    for r in (1, 2):
        pairs = pairs_at_depth(packed, r)
        with torch.no_grad():
            together = head_forward(model, head, packed.hidden[:pairs.n],
                                    packed.tokens[r:r + pairs.n], pairs.positions, pairs.mask)
        start = 0
        for e in (a, b, c):
            alone = pairs_at_depth(e, r)
            with torch.no_grad():
                out = head_forward(model, head, e.hidden[:alone.n], e.tokens[r:r + alone.n],
                                   alone.positions)
            torch.testing.assert_close(together[start:start + alone.n], out,
                                       rtol=1e-4, atol=1e-4)
            assert pairs.labels[start:start + alone.n].tolist() == alone.labels.tolist()
            # the last r pairs of a sample would read the next sample's tokens
            assert bool((pairs.labels[start + alone.n:start + len(e.tokens)] == IGNORE).all())
            start += len(e.tokens)


def test_the_engine_kv_unroll_keeps_packed_samples_and_chains_apart(tiny, corpus):
    """EngineKV on packed samples gives each sample's rows, at every depth,
    what the sample's own unroll gives (the bank is read only within a
    sample); and a deeper row changes only with its own chain's entries: the
    depth-r output of chain i does not move when another chain's earlier
    depths are disturbed, where the dense unroll's does."""
    model = tiny.model
    a, b, c = make_examples(model, corpus)[:3]
    packed = pack_examples([a, b, c])
    torch.manual_seed(0)
    head = init_head(model, layers=2)
    with torch.no_grad():
        for p in head.parameters():  # away from init's identities, so every term matters
            p.add_(torch.randn_like(p) * 0.02)

    def unroll(e, engine_kv, poke=None):
        kv = EngineKV(len(head.layers)) if engine_kv else None
        h, outs = e.hidden[:-1].float(), []
        for r in (1, 2, 3):
            pairs = pairs_at_depth(e, r)
            h = h[:pairs.n]
            if poke is not None and r == 2:  # disturb every chain's depth-2 input but one
                h = h + poke[:pairs.n]
            h = head_forward(model, head, h, e.tokens[r:r + pairs.n], pairs.positions,
                             pairs.mask, kv)
            outs.append(h)
        return outs

    with torch.no_grad():
        together = unroll(packed, True)
        start = 0
        for e in (a, b, c):
            for t, o in zip(together, unroll(e, True)):
                torch.testing.assert_close(t[start:start + len(o)], o, rtol=1e-4, atol=1e-4)
            start += len(e.tokens)

        kept = 5  # chain 5's depth-2 input stays; every other chain's moves
        poke = torch.randn_like(a.hidden[:-1].float()) * 3
        poke[kept] = 0
        for engine_kv, moves in ((True, False), (False, True)):
            calm, stirred = unroll(a, engine_kv)[2][kept], unroll(a, engine_kv, poke)[2][kept]
            assert (not torch.allclose(calm, stirred, atol=1e-5)) == moves


@pytest.mark.parametrize("batch_samples, soft_targets, engine_kv",
                         [(1, False, False), (4, True, False), (4, True, True)])
def test_training_lowers_the_loss_and_the_measure_is_consistent(tiny, corpus, batch_samples,
                                                                soft_targets, engine_kv):
    model = tiny.model
    examples = make_examples(model, corpus)
    lm_head = model.output_embedding.detach().float()
    before_head = init_head(model)

    def loss(head):  # on the greedy labels, whatever the training targets
        with torch.no_grad():
            return sum(float(unrolled_loss(model, head, lm_head, e, 3, engine_kv=engine_kv))
                       for e in examples)

    before = loss(before_head)
    head, stats = train_head(tiny, TrainConfig(samples_per_prompt=2, new_tokens=12,
                                               max_prompts=20, max_steps=60, lr=3e-3,
                                               corpus_path=None, batch_samples=batch_samples,
                                               soft_targets=soft_targets,
                                               engine_kv=engine_kv), corpus=corpus)
    after = loss(head)
    assert stats["steps"] == 60 and after < 0.9 * before
    # expected length = 1 + sum over depths of P(all drafts so far right) <= 1 + sum accuracies
    assert 1.0 <= stats["expected_length"] <= 1 + sum(stats["accuracy"]) + 1e-9
    assert 1.0 <= stats["loop_length"] <= 1 + 3
    again = evaluate(model, head, lm_head, [e for e in examples if e.greedy], 3)
    assert len(again["accuracy"]) == 3 and all(0 <= a <= 1 for a in again["accuracy"])


def test_the_dev_measure_keeps_the_best_head_seen(tiny, corpus):
    """dev_every_steps: the returned head is the measured one whose worse of
    chat and code loop length was highest, and it reads that figure again."""
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, max_steps=12, lr=3e-2,
                      corpus_path=None, batch_samples=2, dev_every_steps=4, dev_new_tokens=12)
    head, stats = train_head(tiny, cfg, corpus=corpus)
    history = stats["dev"]["history"]
    assert sorted(history) == [4, 8, 12]
    best = max(history, key=lambda step: min(history[step].values()))
    assert stats["dev"]["chosen_step"] == best
    dev = dev_examples(tiny, 12)
    assert [len(dev["chat"]), len(dev["code"])] == [len(DEV_CHAT), len(DEV_CODE)]
    lm_head = tiny.model.output_embedding.detach().float()
    for kind, examples in dev.items():
        again = evaluate(tiny.model, head, lm_head, examples, 3, engine_kv=True)["loop_length"]
        assert again == pytest.approx(history[best][kind], abs=1e-9)


def test_a_continued_head_is_measured_before_its_first_step(tiny, corpus, tmp_path):
    """--init-head with --dev-every: step 0, the head continued from, is a
    candidate, so a training that only makes it worse ends with it."""
    from engine.speculative.heads import head_state, save_head

    path = tmp_path / "start.mtp.safetensors"
    save_head(path, tiny.config, head_state(init_head(tiny.model)))
    start = head_from_file(tiny.model, str(path))
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, max_steps=4, lr=10.0,
                      corpus_path=None, batch_samples=2, dev_every_steps=4, dev_new_tokens=12,
                      init_head_path=str(path))
    head, stats = train_head(tiny, cfg, corpus=corpus)
    history = stats["dev"]["history"]
    assert sorted(history) == [0, 4] and min(history[4].values()) < min(history[0].values())
    assert stats["dev"]["chosen_step"] == 0
    assert all(torch.equal(head.state_dict()[k].cpu(), v) for k, v in start.state_dict().items())


def test_a_worse_last_head_gives_way_to_the_best_one_measured(tiny, corpus):
    model = tiny.model
    examples = make_examples(model, corpus)
    lm_head = model.output_embedding.detach().float()
    choice = DevChoice({"chat": examples[:6:2], "code": examples[6:12:2]}, lm_head, 3)
    head = init_head(model)
    good = {k: v.clone() for k, v in head.state_dict().items()}
    choice.measure(model, head, 1)
    with torch.no_grad():  # a head that drafts noise
        head.fc.weight.normal_(std=10.0)
    choice.measure(model, head, 2)
    assert choice.score(2) < choice.score(1)
    picked = choice.choose(model, head, 2)
    assert picked["chosen_step"] == 1 and len(picked["history"]) == 2
    assert all(torch.equal(head.state_dict()[k], v) for k, v in good.items())


@pytest.mark.parametrize("reply, question", [
    ("Question: What is a black hole made of?", "What is a black hole made of?"),
    ('Sure! Here is one:\n\n"How do bees find their way home?"', "How do bees find their way home?"),
    ("1. Write a Go function that reverses a slice.\n2. Another", "Write a Go function that reverses a slice."),
    ("**Request:** Can you explain how tides work?", "Can you explain how tides work?"),
    ("Bees.", None),                      # too short to be a question
    ("What about the", None),             # cut off: no final punctuation
    ("", None),
])
def test_a_written_question_is_its_first_line_of_content(reply, question):
    assert extract_question(reply) == question


def test_self_instruct_asks_the_model_for_questions(monkeypatch):
    """The embedded model on the CPU answers the first question requests;
    each reply is its own sampled text (seeded: the same again)."""
    from engine.llm import EngineConfig, OfflineEngine
    from engine.speculative import train

    loaded = load_model(None, device="cpu", progress=False)  # the embedded model
    engine = OfflineEngine(loaded, EngineConfig(max_batch=4, max_context=256))
    asked = []
    real = engine.chat_prompt
    monkeypatch.setattr(engine, "chat_prompt", lambda m: asked.append(m[0]["content"]) or real(m))
    replies = train.written_replies(engine, 2, seed=1, new_tokens=8)
    assert asked == question_requests()[:2]
    assert len(replies) == 2 and all(r.strip() for r in replies)
    assert train.written_replies(engine, 1, seed=1, new_tokens=8) == replies[:1]


def test_picked_questions_are_clean_distinct_and_new():
    from engine.speculative.train import pick_questions

    replies = ["Question: How do tides work?", "Sure:\nHow do tides work?", "no",
               "What is a held-out prompt here?", "Why is the sky blue?", "Why do cats purr?"]
    assert pick_questions(replies, 5, {"What is a held-out prompt here?"}) == \
        ["How do tides work?", "Why is the sky blue?", "Why do cats purr?"]
    assert pick_questions(replies, 2, set()) == ["How do tides work?",
                                                 "What is a held-out prompt here?"]


def test_soft_targets_are_the_bases_distribution(tiny, corpus):
    """With soft_targets the loss is the cross-entropy to the base's softmax
    (recomputed from its final hidden): never below that distribution's
    entropy, and not the greedy loss."""
    model = tiny.model
    e = make_examples(model, corpus)[0]
    lm_head = model.output_embedding.detach().float()
    pairs = pairs_at_depth(e, 1)
    labelled = pairs.labels != IGNORE
    target = torch.softmax(e.hidden[1:1 + pairs.n] @ lm_head.T, -1)[labelled]
    entropy = float(-(target * target.log()).sum(-1).mean())
    head = init_head(model)
    with torch.no_grad():
        soft = float(unrolled_loss(model, head, lm_head, e, 1, soft_targets=True))
        hard = float(unrolled_loss(model, head, lm_head, e, 1))
    assert soft >= entropy - 1e-4 and abs(soft - hard) > 1e-3


def test_cold_soft_targets_become_the_greedy_loss(tiny, corpus):
    """The soft targets' temperature: near 0 the target is the base's argmax,
    i.e. the greedy labels' cross-entropy; at 1 it is the plain softmax; and
    a setting out of range is refused."""
    model = tiny.model
    e = make_examples(model, corpus)[0]
    lm_head = model.output_embedding.detach().float()
    head = init_head(model)
    with torch.no_grad():
        hard = float(unrolled_loss(model, head, lm_head, e, 2))
        cold = float(unrolled_loss(model, head, lm_head, e, 2, True, temperature=1e-4))
        plain = float(unrolled_loss(model, head, lm_head, e, 2, True))
        warm = float(unrolled_loss(model, head, lm_head, e, 2, True, temperature=1.0))
    assert abs(cold - hard) < 1e-4 * max(1.0, hard)
    assert plain == warm and abs(plain - hard) > 1e-3
    with pytest.raises(ValueError, match="target temperature"):
        TrainConfig(target_temperature=0.0)


def test_speculation_steps_jump_over_accepted_runs():
    """The loop keeps each step's run of correct drafts plus the target's
    token and starts the next chain after them; drafts never pass the answer's
    end. Prompt of 3, answer of 8: the first token from the prefill, then
    chains start at pair prompt + out - 2."""
    from engine.speculative.train import speculation_steps

    correct = torch.zeros(3, 12, dtype=torch.bool)
    correct[:, 2] = True           # out=1: a full run of 3 -> 4 tokens
    correct[0, 6] = True           # out=5: one draft, then a miss -> 2 tokens
    correct[:, 8] = True           # out=7: the cap (8 - 7 - 1 = 0) allows none -> 1 token
    assert speculation_steps(correct, 3, 8, 3) == (3, 4)
    assert speculation_steps(torch.zeros(3, 12, dtype=torch.bool), 3, 8, 3) == (7, 0)


def test_varied_prompts_join_the_corpus_after_the_built_in_ones(tiny):
    """--varied N: N more prompts answered, after the built-in ones (so the
    held-out tenth of the samples is theirs)."""
    with pytest.raises(ValueError):
        TrainConfig(varied=-1)
    cfg = TrainConfig(samples_per_prompt=1, new_tokens=8, max_prompts=10, varied=4,
                      corpus_path=None)
    corpus = generate_corpus(tiny, cfg)
    assert len(corpus.samples) == 14
    for sample, n, text in zip(corpus.samples[10:], corpus.prompt_lengths[10:], varied_prompts(4)):
        assert text in tiny.tokenizer.decode(sample[:n])


def test_a_generation_stopped_midway_keeps_the_answers_it_saved(tiny, corpus, tmp_path,
                                                                  monkeypatch):
    """The cache is written after every few batches: a run killed after its
    first chunk (a device call's time limit) leaves those answers for the next."""
    import engine.speculative.train as train

    path = tmp_path / "corpus.pt"
    calls = []
    real = train._generated

    def stopped_after_one_chunk(engine, prompts, params):
        calls.append(len(prompts))
        if len(calls) > 1:
            raise KeyboardInterrupt("the call's time limit")
        return real(engine, prompts, params)

    monkeypatch.setattr(train, "_generated", stopped_after_one_chunk)
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=10, max_batch=1,
                      corpus_path=str(path))
    with pytest.raises(KeyboardInterrupt):
        generate_corpus(tiny, cfg)
    chunk = train._SAVE_EVERY_BATCHES * cfg.max_batch
    assert calls == [chunk, chunk]
    kept = Corpus.load(str(path))
    assert kept.samples == corpus.samples[:chunk]  # the same answers as one uninterrupted run


def test_corpus_only_answers_into_the_cache_and_trains_nothing(tmp_path, capsys):
    """`train-mtp --corpus-only`: the answers land in --corpus (a cache the
    training call reads back), no head is written."""
    from tandem.cli import main

    assert main(["train-mtp", "--corpus-only", "--device", "cpu"]) == 2
    assert "--corpus-only needs --corpus FILE" in capsys.readouterr().err
    missing = str(tmp_path / "none.safetensors")
    assert main(["train-mtp", "--init-head", missing, "--device", "cpu"]) == 2
    assert f"--init-head {missing}: no such file" in capsys.readouterr().err
    assert main(["train-mtp", "--corpus-only", "--corpus", str(tmp_path / "c.pt"),
                 "--init-head", missing, "--device", "cpu"]) == 2
    assert "--corpus-only trains none" in capsys.readouterr().err
    path, out = tmp_path / "corpus.pt", tmp_path / "head.safetensors"
    argv = ["train-mtp", "--corpus-only", "--corpus", str(path), "--out", str(out),
            "--device", "cpu", "--max-prompts", "10", "--samples-per-prompt", "1",
            "--new-tokens", "8", "--max-batch", "10"]
    assert main(argv) == 0
    corpus = Corpus.load(str(path))
    assert len(corpus.samples) == 10 and all(corpus.greedy) and not out.exists()
    assert all(len(s) - n == 8 for s, n in zip(corpus.samples, corpus.prompt_lengths))
    assert "holds the 10 samples of this recipe" in capsys.readouterr().out


def test_training_continues_from_a_head_file(tiny, corpus, tmp_path):
    """--init-head: a saved head loads back as it was written (bf16) and a
    training of zero steps returns it unchanged; a fresh start would not."""
    from engine.errors import ModelLoadError
    from engine.speculative.heads import head_state, save_head

    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, max_steps=20, lr=3e-3,
                      corpus_path=None, batch_samples=2)
    trained, _ = train_head(tiny, cfg, corpus=corpus)
    path = tmp_path / "head.mtp.safetensors"
    save_head(path, tiny.config, head_state(trained))
    loaded = head_from_file(tiny.model, str(path))
    for name, t in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16).float()), name
    again, _ = train_head(tiny, replace(cfg, max_steps=0, init_head_path=str(path)), corpus=corpus)
    fresh = init_head(tiny.model).state_dict()
    assert all(torch.equal(again.state_dict()[k].cpu(), v) for k, v in loaded.state_dict().items())
    assert not all(torch.equal(fresh[k], v) for k, v in loaded.state_dict().items())
    other = load_model("tiny-qwen3.5", device="cpu", progress=False)
    with pytest.raises(ModelLoadError, match="not made for this model"):
        head_from_file(other.model, str(path))


def test_answers_from_several_processes_equal_one_process(tiny, corpus, tmp_path):
    """--gen-processes 2: the prompts are dealt to two processes (each loads
    the model itself); the merged cache holds exactly the answers one process
    gives, greedy and sampled (each sample keeps its number and seed), and no
    shard file is left behind."""
    with pytest.raises(ValueError, match="gen-processes"):
        TrainConfig(gen_processes=0)
    path = tmp_path / "corpus.pt"
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, corpus_path=str(path),
                      max_batch=4, gen_processes=2)
    made = generate_corpus(tiny, cfg)
    assert (made.samples, made.prompt_lengths, made.greedy) == \
        (corpus.samples, corpus.prompt_lengths, corpus.greedy)
    kept = Corpus.load(str(path))
    assert sorted(map(tuple, kept.samples)) == sorted(map(tuple, corpus.samples))
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.pt"]
    unsaved = generate_corpus(tiny, replace(cfg, corpus_path=None))  # temporary shard files
    assert unsaved.samples == corpus.samples


def test_a_stopped_multi_process_run_leaves_shards_the_next_run_reads(tiny, corpus, tmp_path,
                                                                     monkeypatch):
    """Shard files a killed run left (a device call's limit) are merged into
    the cache by the next run, with their sample numbers, and removed."""
    import engine.speculative.train as train

    path = tmp_path / "corpus.pt"
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, corpus_path=str(path))
    full = {}
    for tokens, n, greedy in zip(corpus.samples, corpus.prompt_lengths, corpus.greedy):
        full[(tuple(tokens[:n]), 0 if greedy else 1)] = tokens[n:]
    odd = [(key, answer) for key, answer in full.items() if key[1] == 1][:5]  # second samples only
    torch.save(odd, train._shard_path(str(path), 3))
    generated = []
    real = train._generated
    monkeypatch.setattr(train, "_generated",
                        lambda engine, prompts, params: generated.append(len(prompts))
                        or real(engine, prompts, params))
    made = generate_corpus(tiny, cfg)
    assert sum(generated) == len(full) - len(odd)  # the shard's five were not asked again
    assert (made.samples, made.greedy) == (corpus.samples, corpus.greedy)
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.pt"]



def test_each_new_best_head_is_written_while_training_runs(tiny, corpus, tmp_path):
    """train_head's on_best with train-mtp's writer: each new best head is on
    disk as it is found (a run killed at a device call's limit keeps it), a
    whole file each time, and the last one written is the head returned."""
    from safetensors import safe_open

    from engine.speculative.heads import best_head_writer, head_state

    out = tmp_path / "head.safetensors"
    write = best_head_writer(out, tiny.config, "tiny-llama")
    written = []

    def write_and_read_back(head, step, lengths):
        write(head, step, lengths)
        with safe_open(str(out), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        assert meta["dev_chosen_step"] == str(step) and meta["checkpoint"] == "yes"
        assert float(meta["dev_chat_loop_length"]) == pytest.approx(lengths["chat"], abs=1e-3)
        state = head_state(head)
        assert sorted(tensors) == sorted(state)
        for name, t in state.items():
            assert torch.equal(tensors[name], t.detach().to(torch.bfloat16).cpu()), name
        assert not (tmp_path / "head.safetensors.partial").exists()
        written.append((step, {k: v.clone() for k, v in tensors.items()}))

    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, max_steps=12, lr=3e-2,
                      corpus_path=None, batch_samples=2, dev_every_steps=4, dev_new_tokens=12)
    head, stats = train_head(tiny, cfg, corpus=corpus, on_best=write_and_read_back)
    assert written and written[0][0] == 4
    assert [step for step, _ in written][-1] == stats["dev"]["chosen_step"]
    for name, t in head_state(head).items():
        assert torch.equal(written[-1][1][name], t.detach().to(torch.bfloat16).cpu()), name


@pytest.mark.parametrize("top_id", [49151, 65535, 248319])
def test_a_corpus_file_round_trips_and_older_files_still_load(tmp_path, top_id):
    """Corpus.save packs the tokens into one tensor (uint16 while every id
    fits, int32 past that: the 27B's vocabulary is 248,320); files of the
    earlier format (lists) still load."""
    corpus = Corpus([[1, 2, 3, top_id], [7], [top_id, 0]], [2, 1, 1], [True, False, True])
    path = str(tmp_path / "corpus.pt")
    corpus.save(path)
    packed = torch.load(path)
    assert packed["tokens"].dtype == (torch.uint16 if top_id < 2 ** 16 else torch.int32)
    again = Corpus.load(path)
    assert (again.samples, again.prompt_lengths, again.greedy) == (
        corpus.samples, corpus.prompt_lengths, corpus.greedy)
    torch.save({"samples": corpus.samples, "prompt_lengths": corpus.prompt_lengths,
                "greedy": corpus.greedy}, path)
    old = Corpus.load(path)
    assert (old.samples, old.prompt_lengths, old.greedy) == (
        corpus.samples, corpus.prompt_lengths, corpus.greedy)


def test_bf16_features_give_the_loss_of_their_fp32_widening(tiny, corpus):
    """On a GPU base_features keeps the hidden in bf16 (half the memory of a
    28 M-token corpus): the loss and the held-out measure widen it, so bf16
    features give exactly what the same values stored in fp32 give."""
    model = tiny.model
    e = make_examples(model, corpus)[0]
    narrow = Example(e.tokens, e.hidden.to(torch.bfloat16), e.labels, e.greedy)
    wide = Example(e.tokens, narrow.hidden.float(), e.labels, e.greedy)
    lm_head = model.output_embedding.detach().float()
    head = init_head(model)
    with torch.no_grad():
        for soft in (False, True):
            assert float(unrolled_loss(model, head, lm_head, narrow, 3, soft)) == \
                float(unrolled_loss(model, head, lm_head, wide, 3, soft))
        assert evaluate(model, head, lm_head, [narrow], 3) == \
            evaluate(model, head, lm_head, [wide], 3)


def test_a_grown_head_starts_as_the_file_head_and_trains_its_new_layer(tiny, corpus, tmp_path):
    """--init-head FILE --head-layers 2: the file's layer is kept and the new one
    passes the residual stream through (o_proj and down_proj zero), so the grown
    head computes the file's head's outputs exactly; training then moves the
    new layer; a head never shrinks."""
    from engine.speculative.heads import head_state, save_head

    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, max_steps=10, lr=3e-3,
                      corpus_path=None, batch_samples=2)
    one, _ = train_head(tiny, cfg, corpus=corpus)
    path = tmp_path / "one.mtp.safetensors"
    save_head(path, tiny.config, head_state(one))
    kept, grown = head_from_file(tiny.model, str(path)), head_from_file(tiny.model, str(path), 2)
    assert (len(kept.layers), len(grown.layers)) == (1, 2)
    e = make_examples(tiny.model, corpus)[0]
    inputs = (e.hidden[:-1].float(), e.tokens[1:], torch.arange(len(e.tokens) - 1))
    with torch.no_grad():
        assert torch.equal(head_forward(tiny.model, grown, *inputs),
                           head_forward(tiny.model, kept, *inputs))
    trained, _ = train_head(tiny, replace(cfg, init_head_path=str(path), head_layers=2),
                            corpus=corpus)
    assert len(trained.layers) == 2
    assert trained.layers[1].self_attn.o_proj.weight.abs().sum() > 0
    assert trained.layers[1].mlp.down_proj.weight.abs().sum() > 0
    two = tmp_path / "two.mtp.safetensors"
    save_head(two, tiny.config, head_state(trained))
    assert len(head_from_file(tiny.model, str(two)).layers) == 2
    with pytest.raises(ValueError, match="cannot shrink"):
        head_from_file(tiny.model, str(two), 1)
    with pytest.raises(ValueError, match="head-layers"):
        TrainConfig(head_layers=0)


def test_train_mtp_refuses_to_shrink_an_init_head(tiny, tmp_path, capsys):
    from engine.speculative.heads import head_state, save_head
    from tandem.cli import main

    path = tmp_path / "two.mtp.safetensors"
    save_head(path, tiny.config, head_state(init_head(tiny.model, 2)))
    assert main(["train-mtp", "--init-head", str(path), "--head-layers", "1"]) == 2
    assert "holds 2 layers" in capsys.readouterr().err


def test_a_grown_head_with_its_file_frozen_trains_only_its_new_layer(tiny, corpus, tmp_path,
                                                                     capsys):
    """--init-lr-scale 0: what the file held (norms, fc, its layer) keeps its
    bits, the new layer moves; a file head with nothing grown is refused."""
    from engine.speculative.heads import head_state, save_head
    from tandem.cli import main

    path = tmp_path / "one.mtp.safetensors"
    save_head(path, tiny.config, head_state(init_head(tiny.model, 1)))
    before = head_from_file(tiny.model, str(path), 2).state_dict()
    cfg = TrainConfig(samples_per_prompt=2, new_tokens=12, max_prompts=20, max_steps=6, lr=3e-3,
                      corpus_path=None, batch_samples=2, init_head_path=str(path), head_layers=2,
                      init_lr_scale=0.0)
    trained, _ = train_head(tiny, cfg, corpus=corpus)
    after = trained.state_dict()
    moved = {name for name, t in after.items() if not torch.equal(t.cpu(), before[name])}
    assert moved and all(name.startswith("layers.1.") for name in moved), moved
    assert {"layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"} <= moved
    with pytest.raises(ValueError, match="init-lr-scale"):
        TrainConfig(init_lr_scale=0.5)  # no --init-head to scale
    assert main(["train-mtp", "--init-head", str(path), "--init-lr-scale", "0"]) == 2
    assert "leaves nothing to train" in capsys.readouterr().err


# ------------------------------------------------ streams and the feature probe


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen3.5"])
def test_a_kept_stream_is_what_the_layers_up_to_it_compute(model_name, corpus):
    """CausalLM.forward(streams=...) keeps the residual stream after the named
    layers without changing the forward: the stream after layer i, normed, is
    the final hidden of the model cut after layer i."""
    import copy

    model = load_model(model_name, device="cpu", progress=False).model
    samples = [t[:30] for t in corpus.samples[:3]]
    last = model.config.num_layers - 1
    kept = base_features(model, samples, stream_layers=(last, 0))
    plain = base_features(model, samples)
    cuts = {}
    for i in (0, last):
        cuts[i] = copy.deepcopy(model)
        cuts[i].model.layers = cuts[i].model.layers[:i + 1]
    for tokens, with_streams, without in zip(samples, kept, plain):
        assert torch.equal(with_streams.hidden, without.hidden)
        assert torch.equal(with_streams.greedy, without.greedy) and without.streams is None
        assert with_streams.streams.shape == (len(tokens), 2, model.config.hidden_size)
        for slot, i in enumerate((last, 0)):   # the slots keep the order asked for
            [cut] = base_features(cuts[i], [tokens])
            torch.testing.assert_close(model.model.norm(with_streams.streams[:, slot]),
                                       cut.hidden, rtol=1e-5, atol=1e-5)


def test_examples_keep_the_streams_they_are_asked_for(tiny, corpus):
    plain = make_examples(tiny.model, corpus)
    kept = make_examples(tiny.model, corpus, stream_layers=(1, 0))
    h = tiny.model.config.hidden_size
    for a, b in zip(plain, kept):
        assert a.streams is None and b.streams.shape == (len(b.tokens), 2, h)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.hidden, b.hidden)
    # in the order asked: slot 0 holds layer 1's stream, which the final norm reads
    first = kept[0]
    torch.testing.assert_close(tiny.model.model.norm(first.streams[:, 0]), first.hidden,
                               rtol=1e-5, atol=1e-5)


def test_the_feature_probe_starts_as_the_head_and_trains_only_its_fusion(tiny, corpus):
    """bench.mtp_features: a zero fusion drafts exactly as the head does; the
    control's slots hold h; training moves fuse and lowers its loss, and the
    frozen head keeps every bit."""
    from bench import mtp_features as probe

    model = tiny.model
    examples = make_examples(model, corpus, stream_layers=(0, 1))
    head = init_head(model)
    head.requires_grad_(False)
    lm_head = model.output_embedding.detach().float()
    zero = probe.Fusion(model.config.hidden_size, 2)
    greedy = [e for e in examples if e.greedy]
    assert evaluate(model, head, lm_head, probe.with_probe_input(zero, "features", greedy), 3) \
        == evaluate(model, head, lm_head, greedy, 3)
    h, slots = probe.probe_inputs("control", examples[0])
    assert torch.equal(slots[:, 1], h) and torch.equal(slots[:, 0], h)
    h, slots = probe.probe_inputs("features", examples[0])
    assert torch.equal(slots, examples[0].streams.float())

    before = {k: v.clone() for k, v in head.state_dict().items()}
    batch = examples[:4]
    vocab_head = lm_head[torch.unique(torch.cat([e.tokens for e in examples]))]
    with torch.no_grad():
        start = float(probe.depth1_loss(model, head, zero, "features", batch, vocab_head))
    fusion, steps = probe.train_fusion(model, head, "features", examples, budget_s=4.0, lr=1e-2,
                                       batch_samples=4, seed=0)
    assert steps > 0 and fusion.fuse.weight.abs().sum() > 0
    assert all(torch.equal(v, before[k]) for k, v in head.state_dict().items())
    with torch.no_grad():
        after = float(probe.depth1_loss(model, head, fusion, "features", batch, vocab_head))
    assert after < start


def test_the_probe_slices_whole_prompts_apart(corpus):
    from bench.mtp_features import corpus_slice

    training, held = corpus_slice(corpus, samples=20, per_prompt=2, held_fraction=0.25, seed=3)
    assert len(training.samples) + len(held.samples) == 20 and len(held.samples) >= 2

    def prompts(c):
        return {tuple(s[:n]) for s, n in zip(c.samples, c.prompt_lengths)}
    assert not prompts(training) & prompts(held)
    assert all(c.greedy[0::2] == [True] * (len(c.samples) // 2) for c in (training, held))
    with pytest.raises(SystemExit, match="whole groups"):
        corpus_slice(Corpus(corpus.samples[:3], corpus.prompt_lengths[:3], corpus.greedy[:3]),
                     samples=2, per_prompt=2, held_fraction=0.5, seed=0)
