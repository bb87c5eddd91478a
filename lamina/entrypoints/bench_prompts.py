"""The prompts of `lamina bench serve`: `num` prompts of exactly `input_len` seeded random token ids.

Where does the vocabulary come from:
- a tokenizer (`--tokenizer DIR`, else the server's model directory, the `root` of its /v1/models
  entry, when it is readable here): its base vocabulary without its special tokens; chat prompts are
  those ids decoded to text;
- no tokenizer (`--tokenizer none`, `--skip-tokenizer-init`, or a server that says it has none:
  /tokenizer_info answers 400 `no_tokenizer`, as `lamina serve --skip-tokenizer-init` or
  `--preset` does): every id of `[0, vocab_size)`, `vocab_size` from the server's /v1/models entry
  (lamina reports it). Such prompts go to /v1/completions as token ids; the output is token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_TOKENIZER = "none"  # --tokenizer none


@dataclass
class PromptSource:
    """Where the prompts' ids come from: a tokenizer, or the id range [0, vocab_size)."""

    tokenizer: Any | None = None
    vocab_size: int | None = None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def describe(self) -> str:
        if self.tokenizer is not None:
            return f"tokenizer {getattr(self.tokenizer, 'name_or_path', '') or type(self.tokenizer).__name__}"
        return f"random ids of [0, {self.vocab_size}) (no tokenizer)"


async def server_has_tokenizer(client) -> bool | None:
    """True / False when the server says whether it has a tokenizer (vLLM's GET /tokenizer_info:
    200, or 400 with code `no_tokenizer`); None when it does not say (no such route, an error)."""
    import httpx

    try:
        resp = await client.get("/tokenizer_info")
    except httpx.HTTPError:
        return None
    if resp.status_code == 200:
        return True
    try:
        code = (resp.json().get("error") or {}).get("code")
    except ValueError:
        return None
    return False if code == "no_tokenizer" else None


def choose_source(args, card: dict, server_tokenizer: bool | None) -> PromptSource:
    """The prompt source for `args` (`--tokenizer`, `--skip-tokenizer-init`) against a server whose
    /v1/models entry is `card` and that has a tokenizer (`server_tokenizer`: True, False, unknown)."""
    no_tokenizer = getattr(args, "skip_tokenizer_init", False) or (args.tokenizer or "").lower() == NO_TOKENIZER
    if no_tokenizer or (server_tokenizer is False and args.tokenizer is None):
        return PromptSource(vocab_size=_vocab_size(args, card))
    return PromptSource(tokenizer=load_tokenizer(args.tokenizer, card))


def _vocab_size(args, card: dict) -> int:
    given = getattr(args, "vocab_size", None)
    if given is not None and given < 1:
        raise ValueError(f"--vocab-size must be >= 1, got {given}")
    vocab = given or card.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError("without a tokenizer the prompts are random ids of [0, vocab_size), and the server's "
                         "/v1/models entry has no vocab_size (lamina serve reports it): pass --vocab-size N")
    return vocab


def load_tokenizer(path: str | None, card: dict):
    from transformers import AutoTokenizer

    if path is None:
        path = card.get("root")
        if not path or not Path(path).is_dir():
            raise ValueError(f"the server's model directory ({path!r}) is not readable here: pass --tokenizer, the "
                             "served model's tokenizer directory (the random prompts need its vocabulary), or "
                             "--tokenizer none to send random ids of [0, vocab_size)")
    return AutoTokenizer.from_pretrained(path)


def random_token_prompts(vocab_size: int, num: int, input_len: int, seed: int) -> list[list[int]]:
    """`num` lists of `input_len` ids drawn uniformly from [0, vocab_size), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num)]


def make_prompts(source: PromptSource, num: int, input_len: int, seed: int, as_text: bool) -> list[list[int] | str]:
    """`num` prompts of `input_len` random ids (decoded to text when `as_text`, which needs a tokenizer)."""
    tokenizer = source.tokenizer
    if tokenizer is None:
        if as_text:
            raise ValueError("/v1/chat/completions needs text prompts, and there is no tokenizer to write them "
                             "with: use --endpoint /v1/completions (token-id prompts)")
        return random_token_prompts(source.vocab_size, num, input_len, seed)
    special = set(tokenizer.all_special_ids)
    ids = [t for t in range(tokenizer.vocab_size) if t not in special]
    rng = random.Random(seed)
    prompts = [[rng.choice(ids) for _ in range(input_len)] for _ in range(num)]
    return [tokenizer.decode(p) for p in prompts] if as_text else prompts
