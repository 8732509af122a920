"""The service on the hybrid Qwen3.5 shape (tiny, dummy weights): GDN state
snapshots at the prompt's end and at the finished request's last page
boundary let the next agent turn skip the conversation so far, and the
continued output equals the offline engine's full recomputation."""
import pytest

from tandem.v1 import generation_pb2 as pb
from tests.test_service import Service, _generate, assert_greedy, oracle_engine

PAGE = 16


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("hybrid"), model="tiny-qwen3.5")
    yield svc
    svc.close()


def test_agent_turns_restore_snapshots_and_match_offline(service):
    offline = oracle_engine("tiny-qwen3.5")
    prompt = [(7 * i + 3) % 250 for i in range(40)]
    cached = []
    for turn in range(3):
        ids, _, complete = _generate(service.stub, token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParameters(temperature=0.0),
                                     max_new_tokens=20, ignore_eos=True, cache_salt="agent")
        assert_greedy(offline, prompt, ids, 20, ignore_eos=True, label=f"turn {turn}")
        cached.append(complete.usage.cached_tokens)
        previous = len(prompt) + len(ids)
        prompt = prompt + ids + [(5 * i + turn) % 250 for i in range(10)]
        if turn:
            # the last page boundary the previous turn's state passed: (len - 1) // PAGE * PAGE
            assert cached[-1] == (previous_turn_len - 1) // PAGE * PAGE
        previous_turn_len = previous
    assert cached[0] == 0
    stats = service.store_stats()
    assert stats.snapshots >= 2 and stats.held_pages == 0 and stats.held_slots == 0


def test_the_same_whole_page_prompt_again_is_served_from_the_cache(service):
    prompt = [(11 * i + 7) % 250 for i in range(3 * PAGE)]  # exactly three pages
    runs = [_generate(service.stub, token_ids=pb.TokenIds(ids=prompt),
                      sampling=pb.SamplingParameters(temperature=0.0), max_new_tokens=4,
                      ignore_eos=True, cache_salt="retry") for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert [r[2].usage.cached_tokens for r in runs] == [0, 2 * PAGE]
