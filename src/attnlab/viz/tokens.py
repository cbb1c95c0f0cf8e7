"""Token labels as people read them: a tokenizer's word-start and byte markers turned back into text.

    >>> pretty_tokens(["The", "Ġcapital", "Ġof", "ĠFrance", "Ċ"])        # GPT-2 / Llama-3 / SmolLM2 byte-level BPE
    ['The', 'capital', 'of', 'France', '↵']
    >>> pretty_tokens(["▁The", "▁cap", "ital", "<0x0A>"])                # SentencePiece (Llama-2, T5)
    ['The', 'cap', 'ital', '↵']
    >>> pretty_tokens(["[CLS]", "play", "##ing", "[SEP]"])                # WordPiece (BERT, MiniLM)
    ['[CLS]', 'play', 'ing', '[SEP]']

The label is what the tokenizer decodes the one token to (``tokenizer.convert_tokens_to_string([t])``), with
the word-start space dropped and line breaks, tabs and tokens of spaces shown (↵, ⇥, ␣). The views keep the
raw token beside it (shown on hover), since two raw tokens may share a label.
"""
from __future__ import annotations

import re

__all__ = ["pretty_tokens", "pretty_token"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()
_BYTE_MARKS = ("Ġ", "Ċ", "ĉ")  # space, newline, tab in byte-level BPE
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _scheme(tokens: list[str]) -> str:
    """"bytes" (byte-level BPE), "sentencepiece" or "plain" (WordPiece and anything else)."""
    if any(m in t for t in tokens for m in _BYTE_MARKS) and all(c in _BYTES for t in tokens for c in t):
        return "bytes"
    if any("▁" in t for t in tokens):
        return "sentencepiece"
    return "plain"


def _shown(s: str) -> str:
    """Whitespace made visible where it is all there is, dropped where it only marks a word start."""
    s = s.replace("\r\n", "↵").replace("\n", "↵").replace("\r", "↵").replace("\t", "⇥")
    core = s.strip(" ")
    return core if core else "␣" * len(s) if s else s


def pretty_token(token: str, scheme: str = "plain") -> str:
    """One token's label under ``scheme`` (see :func:`pretty_tokens`)."""
    if scheme == "bytes":
        text = bytes(_BYTES[c] for c in token).decode("utf-8", errors="replace")
        return _shown(text)
    if scheme == "sentencepiece":
        text = _SP_BYTE.sub(lambda m: bytes([int(m.group(1), 16)]).decode("latin-1"), token).replace("▁", " ")
        return _shown(text)
    if token.startswith("##") and len(token) > 2:  # WordPiece: a piece continuing the word before it
        return token[2:]
    return token


def pretty_tokens(tokens) -> list[str]:
    """Labels for ``tokens`` (strings from ``tokenizer.convert_ids_to_tokens``), one per token; the scheme
    (byte-level BPE, SentencePiece, WordPiece) is read from the tokens themselves."""
    tokens = [str(t) for t in tokens]
    scheme = _scheme(tokens)
    return [pretty_token(t, scheme) for t in tokens]
