"""Each token's own bytes (chat logprobs' `bytes`): a character split over tokens decodes to U+FFFD per token, but
the tokens' bytes joined are its UTF-8; byte-level (GPT-2, SmolLM) and SentencePiece byte-fallback vocabularies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from common.model_source import resolve_model
from frontend.text.tokenizer import Tokenizer

TEXTS = [" 😀", "naïve café 日本語 😀🎉 𝔘", "\u200b\ufeff tab\t\n end"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).path)


def test_a_split_character_joins_from_its_tokens_bytes(tok):
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tok.token_text(ids[-1])  # the emoji is split over tokens
    assert b"".join(tok.token_bytes(t) for t in ids) == " 😀".encode()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode(), text


def test_whole_tokens_bytes_are_their_text(tok):
    """Every token whose bytes are whole characters (special tokens too) has its text's bytes."""
    for token_id in range(tok.vocab_size):
        data = tok.token_bytes(token_id)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            assert "\ufffd" in tok.token_text(token_id), token_id
            continue
        assert text == tok.token_text(token_id), token_id


def sentencepiece_dir(tmp: Path) -> Path:
    """A Llama-style tokenizer: U+2581 for spaces and <0xNN> tokens for bytes outside its vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ("\u2581", "a", "\u2581a", "é", "\u2581é"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "a"), ("\u2581", "é")]
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])  # fmt: skip
    hf.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return tmp


def test_sentencepiece_byte_fallback_tokens_are_their_bytes(tmp_path):
    tok = Tokenizer(sentencepiece_dir(tmp_path))
    ids = tok.encode("a é😀 a", add_special_tokens=False)
    assert tok.token_text(ids[-3]) == "\ufffd"  # a byte of the emoji
    # The pre-tokenizer's leading U+2581 is a space in the bytes, as it is in mid-text decoding.
    assert b"".join(tok.token_bytes(t) for t in ids) == " a é😀 a".encode()
    assert tok.token_bytes(vocab_id(tok, "<0x0A>")) == b"\n" and tok.token_bytes(vocab_id(tok, "<s>")) == b"<s>"


def vocab_id(tok: Tokenizer, piece: str) -> int:
    return tok._tok.token_to_id(piece)
