"""Stop strings across token boundaries, hold-back, stop tokens and max tokens."""

from __future__ import annotations

import pytest

from bloomery_jax.engine.stops import StopConditions, StopStrings
from bloomery_jax.errors import ConfigError


def run(stops, deltas):
    m = StopStrings(stops)
    out = []
    for d in deltas:
        text, hit = m.feed(d)
        out.append(text)
        if hit:
            return out, True
    return out, False


def test_stop_string_split_across_tokens():
    out, hit = run(["</end>"], ["Hello <", "/e", "nd> never"])
    assert hit and "".join(out) == "Hello "
    assert out == ["Hello ", "", ""]  # "<" and "</e" were held back, then dropped with the match


def test_held_text_released_when_it_is_not_a_stop():
    out, hit = run(["STOP"], ["ab S", "T", "x", "yz"])
    assert not hit
    assert out == ["ab ", "", "STx", "yz"]


def test_earliest_of_several_stops_and_overlapping_prefix():
    out, hit = run(["bc", "abcd"], ["xab", "cd"])
    assert hit and "".join(out) == "x"  # "abcd" (at 1) starts before "bc" (at 2)
    out, hit = run(["bc", "abcd"], ["xab", "ce"])
    assert hit and "".join(out) == "xa"
    out, hit = run(["aab"], ["a", "a", "a", "b", "z"])  # the held tail slides: "aa" then "aab"
    assert hit and "".join(out) == "a"


def test_stop_inside_one_delta_and_flush():
    m = StopStrings(["##"])
    assert m.feed("one #") == ("one ", False)
    assert m.held == "#"
    assert m.flush() == "#" and m.held == ""
    assert m.feed("a##b") == ("a", True)


def test_conditions_stop_token_max_tokens_and_strings():
    c = StopConditions.build(max_tokens=3, stop_tokens=[9], stop_strings="zz")
    assert c.on_token(1, "a z", 1) == ("a ", None)
    assert c.on_token(9, "<eos>", 2) == ("z", "stop")  # the stop token's text is not emitted

    c = StopConditions.build(max_tokens=2, stop_strings=["zz"])
    assert c.on_token(1, "a", 1) == ("a", None)
    assert c.on_token(1, "bz", 2) == ("bz", "length")  # held text is released at the end

    c = StopConditions.build(max_tokens=5, stop_strings=["zz"])
    assert c.on_token(1, "az", 1) == ("a", None)
    assert c.on_token(1, "zq", 2) == ("", "stop")
    assert c.finish() == ""


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=2, stop_strings=[""]), dict(max_tokens=1.5)])
def test_bad_stop_conditions_raise(bad):
    with pytest.raises(ConfigError):
        StopConditions.build(**bad)
