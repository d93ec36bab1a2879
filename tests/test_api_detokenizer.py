"""Frontend text handling with no server: IncrementalDetokenizer on the real tokenizer, logprob clamping."""

from __future__ import annotations

import json
import math
import random

import pytest

from common.model_source import resolve_model
from frontend.detokenizer import IncrementalDetokenizer
from frontend.serving import clamp, dumps
from frontend.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "北京是中国的首都。上海是一个大城市。日本語で「こんにちは」",
    "Emoji: 🍕🐶🐱🎉👩‍👩‍👧 and accents: café naïve Ærøskøbing",
    "def f(x):\n    return x ** 2  # tabs\tand  double  spaces",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).path)


def run(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, **kw):
    detok = IncrementalDetokenizer(tok, prompt or [], **kw)
    deltas = [detok.add(t) for t in ids]
    return [*deltas, detok.finish()], detok


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("Some prompt text:")
    deltas, _ = run(tok, ids, prompt)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    if not text.isascii():  # split characters were really held back somewhere
        assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_random_tokens_never_emit_a_partial_character(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas, _ = run(tok, ids)
        full = tok.decode(ids)
        assert "".join(deltas) == full.rstrip("\ufffd")  # only a character cut off at the very end is dropped
        assert all("\ufffd" not in d for d in deltas[:-1] if "\ufffd" not in full)


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("Hi there") + [2] + tok.encode(" more")
    assert "".join(run(tok, ids)[0]) == "Hi there more"
    assert "".join(run(tok, ids, skip_special_tokens=False)[0]) == "Hi there<|im_end|> more"


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_across_token_boundaries(tok, text):
    ids = tok.encode(text)
    rng = random.Random(text)
    for _ in range(20):
        start = rng.randrange(len(text) - 3)
        stop = text[start : start + rng.randrange(1, 6)]
        expected = text[: text.find(stop)]
        deltas, detok = run(tok, ids, stop=["never there", stop])
        assert "".join(deltas) == expected and detok.stop_reason == stop
        # Nothing streamed before the end ever contained (a prefix of) the stop string past the cut.
        shown = ""
        for d in deltas:
            shown += d
            assert expected.startswith(shown)
        kept, _ = run(tok, ids, stop=[stop], include_stop_str_in_output=True)
        assert "".join(kept) == text[: text.find(stop) + len(stop)]


def test_held_back_prefix_is_released_when_no_stop_follows(tok):
    ids = tok.encode("The end is near, said the end")
    deltas, detok = run(tok, ids, stop=["end of story"])
    assert "".join(deltas) == "The end is near, said the end" and detok.stop_reason is None
    # "end" waited for more tokens (it could have grown into the stop string) until the generation ended.
    assert "".join(deltas[:-1]) == "The end is near, said the " and deltas[-1] == "end"


def test_min_tokens_ignores_early_stop_strings(tok):
    ids = tok.encode("stop here and stop there")
    deltas, _ = run(tok, ids, stop=["stop"], min_tokens=3)
    assert "".join(deltas) == "stop here and "


def test_non_finite_logprobs_are_clamped_to_valid_json():
    values = [clamp(x) for x in (-math.inf, math.nan, -1e30, -0.5, 0.0)]
    assert values == [-9999.0, -9999.0, -9999.0, -0.5, 0.0]
    assert json.loads(dumps({"logprobs": values}))["logprobs"] == values
