"""Stop checks: finish reasons per token, and the streaming stop-string matcher."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from engine.stopping import FinishReason, StopChecker, StopStringMatcher

EOS = 2


# --------------------------------------------------------------------------
# StopChecker
# --------------------------------------------------------------------------


def test_eos_stops():
    checker = StopChecker(SamplingParams(), eos_token_ids=[EOS])
    assert checker.check_token(5, 1) is None
    assert checker.check_token(EOS, 2) is FinishReason.STOP


def test_ignore_eos_continues_past_eos_but_honours_stop_token_ids():
    params = SamplingParams(ignore_eos=True, stop_token_ids=(7,))
    checker = StopChecker(params, eos_token_ids=[EOS])
    assert checker.check_token(EOS, 1) is None
    assert checker.check_token(7, 2) is FinishReason.STOP


def test_stop_token_ids_stop():
    checker = StopChecker(SamplingParams(stop_token_ids=(11, 12)), eos_token_ids=[])
    assert checker.check_token(12, 1) is FinishReason.STOP
    assert checker.check_token(13, 1) is None


def test_max_new_tokens_gives_length():
    checker = StopChecker(SamplingParams(max_new_tokens=3), eos_token_ids=[EOS])
    assert checker.check_token(5, 2) is None
    assert checker.check_token(5, 3) is FinishReason.LENGTH


def test_stop_token_on_last_step_reports_stop():
    checker = StopChecker(SamplingParams(max_new_tokens=3), eos_token_ids=[EOS])
    assert checker.check_token(EOS, 3) is FinishReason.STOP


def test_finish_reason_values_are_openai_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]


# --------------------------------------------------------------------------
# StopStringMatcher: exact cases
# --------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[tuple[str, bool]]:
    return [matcher.feed(d) for d in deltas]


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert feed_all(m, ["ab", "c"]) == [("ab", False), ("c", False)]
    assert m.flush() == ""


def test_holds_back_possible_prefix_then_releases_it():
    m = StopStringMatcher(["world"])
    assert m.feed("Hello wo") == ("Hello ", False)
    assert m.feed("w") == ("wo", False)  # "wow" cannot continue to "world"; "w" can
    assert m.feed("!") == ("w!", False)
    assert m.flush() == ""


def test_stop_string_spanning_deltas_is_cut():
    m = StopStringMatcher(["wor"])
    assert feed_all(m, ["Hel", "lo w", "o", "rld"]) == [
        ("Hel", False), ("lo ", False), ("", False), ("", True)]
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_text_before_stop_in_same_delta_is_emitted():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("one\n\ntwo") == ("one", True)


def test_overlapping_self_prefix():
    m = StopStringMatcher(["aab"])
    assert feed_all(m, list("aaab")) == [
        ("", False), ("", False), ("a", False), ("", True)]


def test_earliest_completed_match_wins():
    # "bc" completes before "abcd" could; generation stops there.
    m = StopStringMatcher(["abcd", "bc"])
    assert feed_all(m, list("abcd")) == [("", False), ("", False), ("a", True), ("", True)]


def test_longest_match_wins_when_ending_together():
    m = StopStringMatcher(["bc", "abc"])
    assert m.feed("xabc") == ("x", True)


def test_flush_returns_held_partial_match():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.flush() == "ST"


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidRequestError, match="non-empty"):
        StopStringMatcher(["ok", ""])


# --------------------------------------------------------------------------
# StopStringMatcher: the streaming invariant
# --------------------------------------------------------------------------


def expected_visible_text(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference: scan left to right; at the first end position where some
    stop string ends, cut before the longest such stop string."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if text[:end].endswith(s)]
        if ending_here:
            return text[: end - max(map(len, ending_here))], True
    return text, False


ALPHABET = "abc"


@st.composite
def text_split_into_deltas(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=30))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(
    case=text_split_into_deltas(),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
)
def test_stream_emits_full_text_truncated_at_first_stop(case, stops):
    text, deltas = case
    matcher = StopStringMatcher(stops)
    emitted, stopped = [], False
    for delta in deltas:
        emit, stopped_now = matcher.feed(delta)
        assert not (stopped and emit), "nothing may be emitted after a stop"
        emitted.append(emit)
        stopped = stopped or stopped_now
    visible = "".join(emitted) + ("" if stopped else matcher.flush())

    want_text, want_stopped = expected_visible_text(text, stops)
    assert visible == want_text
    assert stopped == want_stopped


@settings(max_examples=200, deadline=None)
@given(
    case=text_split_into_deltas(),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_holds_back_only_the_longest_possible_stop_prefix(case, stops):
    # Holding back more than needed would delay streaming for no reason.
    _, deltas = case
    matcher = StopStringMatcher(stops)
    consumed = shown = ""
    for delta in deltas:
        emit, stopped = matcher.feed(delta)
        if stopped:
            return
        consumed, shown = consumed + delta, shown + emit
        held = consumed[len(shown):]
        assert consumed.startswith(shown)
        longest = max((n for n in range(len(consumed) + 1)
                       if any(s.startswith(consumed[len(consumed) - n:]) and len(s) > n
                              for s in stops)), default=0)
        assert len(held) == longest
