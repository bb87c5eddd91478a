"""The text of one token in a logprobs answer.

A token is decoded on its own. Byte-level BPE tokenizers (Qwen's) split characters outside ASCII
into several tokens, and such a token alone is not valid UTF-8: decoding gives U+FFFD. As vLLM
does, such a token is written as its raw bytes, `"bytes:\\xe4\\xbd"` (the letters `\\x` and two hex
digits per byte), so a client can join the bytes of consecutive tokens back into text.
"""

from __future__ import annotations

import functools
import re

__all__ = ["logprob_token_text", "token_bytes"]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte-fallback pieces


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of the 256 bytes is one printable character
    (printable Latin-1 bytes stand for themselves, the rest are shifted to 256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping: dict[str, int] = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The raw bytes a token stands for, or None when the tokenizer's vocabulary does not say."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(piece, str):
        return None
    match = _BYTE_FALLBACK.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    decoder = _byte_level_decoder()
    if all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    return None


def logprob_token_text(tokenizer, token_id: int) -> str:
    """The token's text; `bytes:\\x..` for a token that is only part of a UTF-8 character."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tokenizer, token_id)
    if raw is None:
        return text
    try:
        raw.decode("utf-8")
        return text  # whole characters (the token really holds U+FFFD)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
