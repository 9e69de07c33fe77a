"""Stop strings while streaming: every way of cutting the text into pieces gives the same result."""

from __future__ import annotations

import itertools
import random

import pytest

from unillm._contract._stop import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return (text[: min(hits)], True) if hits else (text, False)


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.feed(p))
        if m.stopped:
            return "".join(out), True, out
    out.append(m.flush())
    return "".join(out), False, out


def splits(text: str, n_cuts: int) -> list[list[str]]:
    result = []
    for cuts in itertools.combinations(range(1, len(text)), n_cuts):
        bounds = [0, *cuts, len(text)]
        result.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return result


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("hello <|end|> world", ["<|end|>"]),
        ("aaab", ["aab"]),  # the match starts inside a held-back partial
        ("abcabd", ["abd", "cab"]),  # the earliest stop wins
        ("no stop here", ["xyz"]),
        ("ends with a partial <|e", ["<|end|>"]),  # held text is flushed at the end
        ("ééé\nDONE", ["\nDONE"]),
    ],
)
def test_every_split_matches_the_reference(text: str, stops: list[str]) -> None:
    want = reference(text, stops)
    for n_cuts in range(min(3, len(text) - 1) + 1):
        for pieces in splits(text, n_cuts):
            got, stopped, _ = run(pieces, stops)
            assert (got, stopped) == want, pieces


def test_random_texts_and_stops() -> None:
    rng = random.Random(7)
    for _ in range(500):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 20)))
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            pieces.append(text[i:j])
            i = j
        got, stopped, _ = run(pieces, stops)
        assert (got, stopped) == reference(text, stops), (text, stops, pieces)


def test_partial_match_is_held_back_not_emitted() -> None:
    _, stopped, out = run(["Hello <", "|e", "nd|> tail"], ["<|end|>"])
    assert stopped
    assert out == ["Hello ", "", ""]  # "<" and "|e" were held until they resolved into the stop


def test_held_text_is_released_when_it_does_not_become_a_stop() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("ART") == "START"
    assert not m.stopped
