"""Each token's own bytes (chat logprobs' `bytes`): a token that holds part of a UTF-8 character decodes to U+FFFD,
but its bytes, joined with its neighbours', give the character back, which is what OpenAI documents `bytes` for."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_chars() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte in a byte-level vocab."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    return {decoder.get("type", ""), *(t for d in decoder.get("decoders") or [] for t in _decoder_types(d))}


def _byte_level(chars: dict[str, int]) -> Callable[[str], bytes]:
    # A character outside the table stands for itself, as tokenizers' ByteLevel decoder reads it.
    return lambda piece: b"".join(bytes([chars[c]]) if c in chars else c.encode() for c in piece)


def _sentencepiece(byte_fallback: bool) -> Callable[[str], bytes]:
    def piece_bytes(piece: str) -> bytes:
        # Byte fallback spells a byte <0xNN>; every other piece is text with U+2581 for a space.
        byte = _BYTE_TOKEN.fullmatch(piece) if byte_fallback else None
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

    return piece_bytes


def token_bytes_table(tok: Tokenizer, tokenizer_json: dict[str, Any]) -> list[bytes] | None:
    """Every token id's bytes, or None for a vocabulary of neither kind (WordPiece, ...), whose tokens are whole
    characters: their text's UTF-8 is their bytes."""
    kinds = _decoder_types(tokenizer_json.get("decoder"))
    if "ByteLevel" in kinds:
        piece_bytes = _byte_level(_gpt2_chars())
    elif kinds & {"ByteFallback", "Metaspace"}:
        piece_bytes = _sentencepiece("ByteFallback" in kinds)
    else:
        return None
    table = [b""] * tok.get_vocab_size(with_added_tokens=True)
    for piece, token_id in tok.get_vocab(with_added_tokens=False).items():
        table[token_id] = piece_bytes(piece)
    # Added tokens the decoder does not read (special or not normalized) are their text.
    for token_id, added in tok.get_added_tokens_decoder().items():
        as_text = added.special or not added.normalized
        table[token_id] = added.content.encode() if as_text else piece_bytes(added.content)
    return table


def joined_bytes_table(tok: Tokenizer, tokenizer_json: dict[str, Any], table: list[bytes] | None) -> list[bytes] | None:
    """`table` when decoding ids is joining their bytes and reading them as UTF-8 (a byte-level decoder and nothing
    else: GPT-2, Llama 3, Qwen, SmolLM), checked against the decoder token by token; None otherwise (SentencePiece
    drops a leading space, WordPiece joins words with spaces). Text then streams with no decode call per token."""
    if table is None or _decoder_types(tokenizer_json.get("decoder")) - {"Sequence"} != {"ByteLevel"}:
        return None
    texts = tok.decode_batch([[i] for i in range(len(table))], skip_special_tokens=False)
    if any(text != piece.decode("utf-8", "replace") for text, piece in zip(texts, table, strict=True)):
        return None
    return table
