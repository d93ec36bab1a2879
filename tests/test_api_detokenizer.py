"""Frontend text handling with no server: IncrementalDetokenizer on the real tokenizer, logprob clamping."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.model_source import resolve_model
from frontend.api.serving import clamp
from frontend.api.sse import dumps
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.tokenizer import Tokenizer

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


class Pieces:
    """A stand-in tokenizer whose token i decodes to pieces[i]: chooses exactly which text each token adds."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def run_pieces(pieces: list[str], **kw):
    return run(Pieces(pieces), list(range(len(pieces))), **kw)  # type: ignore[arg-type]


def first_stop(text: str, stop: list[str], after: int = 0) -> tuple[int, str] | None:
    """Reference: the stop string match that ends first past `after`, the longer one on a tie, as (end, stop)."""
    for end in range(after + 1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if s and text.endswith(s, 0, end):
                return end, s
    return None


def expected_output(text: str, stop: list[str], include: bool, after: int = 0) -> tuple[str, str | None]:
    match = first_stop(text, stop, after)
    if match is None:
        return text, None
    end, s = match
    return text[: end if include else end - len(s)], s


def held_back(text: str, stop: list[str]) -> int:
    """Reference: the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_stop_that_ends_first_wins_when_two_complete_in_one_delta():
    # "bc" is complete one character before "abcd": a client fed one character at a time stops there.
    deltas, detok = run_pieces(["x", "abcd", "e"], stop=["abcd", "bc"])
    assert "".join(deltas) == "xa" and detok.stop_reason == "bc"
    # Both end at the same character: the longer one, which started earlier, cuts the text first.
    deltas, detok = run_pieces(["x", "abcd", "e"], stop=["cd", "abcd"])
    assert "".join(deltas) == "x" and detok.stop_reason == "abcd"
    deltas, detok = run_pieces(["x", "abcd", "e"], stop=["cd", "abcd"], include_stop_str_in_output=True)
    assert "".join(deltas) == "xabcd" and detok.stop_reason == "abcd"


def test_min_tokens_ignores_stop_strings_wholly_before_it():
    # "bc" ends in the first three tokens, the min_tokens: it never counts, even next to a longer stop string.
    deltas, detok = run_pieces(["a", "b", "c", "d"], stop=["bc", "xxxxxxxx"], min_tokens=3)
    assert "".join(deltas) == "abcd" and detok.stop_reason is None
    # A match that ends in the token after them counts, though it started before.
    deltas, detok = run_pieces(["a", "b", "c", "d"], stop=["cd", "xxxxxxxx"], min_tokens=3)
    assert "".join(deltas) == "ab" and detok.stop_reason == "cd"


def test_min_tokens_lets_no_stop_string_end_the_first_tokens():
    """As vLLM (stop strings checked once len(output_token_ids) > min_tokens): with min_tokens 1 a stop string
    inside the first token does not end the output empty; it used to, the check starting at the min_tokens-th."""
    deltas, detok = run_pieces([" 4", ",", " 5", ","], stop=[" "], min_tokens=1)
    assert "".join(deltas) == " 4," and detok.stop_reason == " "
    # An earlier match of the same stop string is not found again later: "a a" is wholly in the first two tokens.
    deltas, detok = run_pieces(["a a", " ", "b", " a a"], stop=["a a"], min_tokens=2)
    assert "".join(deltas) == "a a b " and detok.stop_reason == "a a"


def test_long_stop_strings_cost_time_linear_in_the_text(tok):
    rng = random.Random(0)
    words = TEXTS[0].replace(",", "").replace(".", "").replace("!", "").lower().split() + ["and", "a", "then"]
    text = " ".join(rng.choice(words) for _ in range(1500))
    ids = tok.encode(text)[:1500]
    # Sixteen ~4,000-character stop strings of the same words (so they partly match all the time) that never occur.
    stop = [" ".join(rng.choice(words) for _ in range(1000))[:4000] + f" zq{i}" for i in range(16)]
    start = time.process_time()
    deltas, detok = run(tok, ids, stop=stop)
    elapsed = time.process_time() - start
    assert "".join(deltas) == tok.decode(ids) and detok.stop_reason is None
    # About 0.04 s; checking every prefix of every stop string on every token took about 27 s here.
    assert elapsed < 1.0


pieces_st = st.lists(st.text("ab", max_size=3) | st.text("abc", max_size=5), max_size=30)
stops_st = st.lists(st.text("ab", max_size=6) | st.text("abc", min_size=1, max_size=3), min_size=1, max_size=4)


@settings(derandomize=True, max_examples=400, deadline=None)
@given(pieces=pieces_st, stop=stops_st, include=st.booleans(), min_tokens=st.integers(0, 8), data=st.data())
@example(pieces=["aa", "aab", "aaab"], stop=["aaab", "aab"], include=False, min_tokens=0, data=None)
@example(pieces=["a", "a", "a", "b"], stop=["aaab", "aa"], include=False, min_tokens=2, data=None)
@example(pieces=["abab", "ab"], stop=["ababab", "bab", "ab"], include=False, min_tokens=2, data=None)
def test_stop_strings_match_a_reference_over_the_whole_text(pieces, stop, include, min_tokens, data):
    text = "".join(pieces)
    if data is not None and text:  # a substring of the text, so that some stop string is often found
        start = data.draw(st.integers(0, len(text) - 1))
        stop = [*stop, text[start : start + data.draw(st.integers(1, 6))]]
    deltas, detok = run_pieces(pieces, stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    after = len("".join(pieces[:min_tokens]))  # the first min_tokens tokens' text: no stop string ends in it
    assert ("".join(deltas), detok.stop_reason) == expected_output(text, stop, include, after)
    # Until it stops, each delta shows all the text but the part that could still grow into a stop string.
    fed = shown = ""
    for piece, delta in zip(pieces, deltas, strict=False):
        fed, shown = fed + piece, shown + delta
        if first_stop(fed, stop, after) is not None:
            break
        assert shown == fed[: len(fed) - (0 if include else held_back(fed, stop))]
        assert len(fed) - len(shown) <= max(max(len(s) for s in stop) - 1, 0)


words_st = st.lists(st.sampled_from(["the", " the", " end", "end", " là", "!", " 🍕", "\n", " a", "aa"]), max_size=25)
real_stops_st = st.lists(st.sampled_from(["the end", "e", "end", " a", "aa", "aaa", "🍕", "là!", "\n the"]), min_size=1,
                         max_size=3)  # fmt: skip


@settings(derandomize=True, max_examples=60, deadline=None)
@given(words=words_st, stop=real_stops_st, include=st.booleans())
def test_stop_strings_match_a_reference_with_the_real_tokenizer(tok, words, stop, include):
    ids = tok.encode("".join(words))
    deltas, detok = run(tok, ids, stop=stop, include_stop_str_in_output=include)
    assert ("".join(deltas), detok.stop_reason) == expected_output(tok.decode(ids), stop, include)


class DecodeOnly:
    """The real tokenizer without its joined bytes: the detokenizer decodes windows of ids."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


def test_joined_bytes_stream_what_decoding_windows_streams(tok):
    """Byte-level vocabularies skip the per-token decode calls: the same text as decoding windows, on random ids
    drawn mostly from partial characters and special tokens, with specials skipped or not; never a delta that ends
    in U+FFFD, which could still be the start of a character."""
    assert tok.joined_bytes is not None and tok.special_ids == {i for i in range(17)}
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 100
    rng = random.Random(1)
    for trial in range(300):
        pool = [partial, sorted(tok.special_ids), range(tok.vocab_size)]
        ids = [rng.choice(rng.choice(pool)) for _ in range(rng.randrange(1, 30))]
        skip = trial % 2 == 0
        fast, _ = run(tok, ids, skip_special_tokens=skip)
        window, _ = run(DecodeOnly(tok), ids, skip_special_tokens=skip)  # type: ignore[arg-type]
        assert "".join(fast) == "".join(window) == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
        assert not any(d.endswith("\ufffd") for d in fast), (ids, fast)


def test_joined_bytes_only_where_decoding_joins_bytes(tmp_path):
    """A SentencePiece-style decoder (Metaspace drops the leading space) keeps decoding windows."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\u2581hi": 1, "\u2581there": 2, "!": 3}
    raw = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    sp = Tokenizer(tmp_path)
    assert sp.joined_bytes is None
    deltas, _ = run(sp, [1, 2, 3])
    assert "".join(deltas) == sp.decode([1, 2, 3]) == "hi there!"
