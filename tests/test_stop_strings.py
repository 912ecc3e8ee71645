"""hybrid_engine/stop_strings.py against the plain scans it replaced (one str.find / endswith per
stop string, kept here as the reference), and SamplingParams' cap on the number of stops."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine import SamplingParams
from hybrid_engine.sampling_params import MAX_STOP_STRINGS
from hybrid_engine.stop_strings import StopStrings


def first_match_reference(text: str, start: int, stops: list[str]):
    hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def held_back_reference(text: str, stops: list[str]) -> int:
    longest = 0
    for stop in stops:
        for m in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:m]):
                longest = m
                break
    return longest


# A small alphabet, so that stop strings overlap, share prefixes and occur often.
TEXT = st.text(alphabet="abc\n", max_size=40)
STOPS = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=6), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(text=TEXT, stops=STOPS, data=st.data())
def test_first_match_and_held_back_equal_the_plain_scans(text, stops, data):
    start = data.draw(st.integers(0, len(text)), label="start")
    matcher = StopStrings(stops)
    assert matcher.longest == max(map(len, stops))
    assert matcher.first_match(text, start) == first_match_reference(text, start, stops)
    assert matcher.held_back(text) == held_back_reference(text, stops)


def test_cases_worth_naming():
    m = StopStrings(["abc", "ab", "bcd", "x"])
    assert m.first_match("zabcd", 0) == (1, "ab")       # two start at 1: the smaller string, as min() did
    assert m.first_match("zabcd", 2) == (2, "bcd")      # nothing may start before `start`
    assert m.first_match("zabcd", 3) is None
    assert m.held_back("zzab") == 2                     # "ab" is a stop, but also the start of "abc"
    assert m.held_back("zzbc") == 2 and m.held_back("zzx") == 0 and m.held_back("") == 0


class CountingStopStrings(StopStrings):
    steps = 0

    def _step(self, node, ch):
        CountingStopStrings.steps += 1
        return super()._step(node, ch)


def transitions(stops: list[str], text: str) -> int:
    matcher = CountingStopStrings(stops)
    CountingStopStrings.steps = 0
    matcher.first_match(text, len(text) - 4 - matcher.longest + 1)     # 4 new characters, as per token
    matcher.held_back(text)
    return CountingStopStrings.steps


def test_a_tokens_check_costs_the_same_for_one_stop_string_and_for_the_most_allowed():
    """Issue 37: each of 10,000 stop strings was scanned for after every token."""
    text = "def read_config(path):\n    with open(path) as f:\n" * 20
    many = [f"{i:08d}" for i in range(MAX_STOP_STRINGS - 1)] + ["zzzzzzzz"]
    assert transitions(many, text) == transitions(["zzzzzzzz"], text) == (4 + 7) + 7


def test_the_number_of_stop_strings_is_capped():
    SamplingParams(stop=[str(i) for i in range(MAX_STOP_STRINGS)]).validate(vocab_size=10)
    with pytest.raises(ValueError, match=f"^stop must hold at most {MAX_STOP_STRINGS} strings, got 10000$"):
        SamplingParams(stop=[str(i) for i in range(10_000)]).validate(vocab_size=10)


def test_the_automaton_follows_the_stop_list():
    p = SamplingParams(stop=["a"])
    built = p.stop_strings
    assert p.stop_strings is built and built.stops == ["a"]
    p.stop.append("b")                      # in place: validate() (the engine's admission) rebuilds it
    p.validate(vocab_size=10)
    assert p.stop_strings.stops == ["a", "b"]
    p.stop = "c"
    assert p.stop_strings.stops == ["c"]
    copied = copy.deepcopy(p)               # immutable once built: copies share it
    assert copied.stop_strings is p.stop_strings and copied.stop == p.stop and copied.stop is not p.stop


def test_the_servers_streamed_text_never_sends_a_piece_of_a_stop_string():
    from hybrid_engine.serve.text_stream import StreamedText
    stream = StreamedText(StopStrings(["</end>", "STOP"]))
    sent = [stream.delta(text, finished=False) for text in ("ab<", "ab</e", "ab</x", "ab</xS", "ab</xST")]
    assert sent == ["ab", "", "</x", "", ""]
    assert stream.delta("ab</xST", finished=True) == "ST"
