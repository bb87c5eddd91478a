"""Tests for lamina.engine.detokenizer (offline byte-level BPE tokenizer)."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lamina.engine.detokenizer import IncrementalDetokenizer, find_stop_string

CORPUS = [
    "Hello world, this is a small test corpus for the tokenizer.",
    "The quick brown fox jumps over the lazy dog. Stop here!",
    "你好，世界！这是一个测试。我们喜欢机器学习。",
    "Emoji time 😀🎉 fun 👍 and more 🚀 rockets.",
    "Numbers 12345 and symbols #$%&*() are fine.",
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


TEXTS = [
    "Hello world, the quick brown fox.",
    "你好，世界！机器学习很有趣。",
    "Mixed 中文 and emoji 😀🎉🦀 text 👍🏽 end",
    "🚀🚀🚀 unseen 漢字 ñ é ü 🧪",
]


def _stream(tokenizer, prompt, ids, chunk_sizes, **kw):
    detok = IncrementalDetokenizer(tokenizer, prompt, **kw)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        deltas.append(detok.push(ids[i : i + size]))
        i += size
        k += 1
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [[1], [2], [3, 1], [100]])
def test_incremental_equals_full_decode(tokenizer, text, chunks):
    prompt = tokenizer.encode("Prompt: 你好 ")
    ids = tokenizer.encode(text)
    detok, deltas = _stream(tokenizer, prompt, ids, chunks)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == full
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("a🦀")
    # The crab is unseen in training, so its 4 bytes span several tokens.
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(tokenizer, [])
    outs = [detok.push([t]) for t in ids]
    assert outs[0] == "a"
    assert all(o == "" for o in outs[1:-1])
    assert outs[-1] == "🦀"


def test_random_token_streams_match(tokenizer):
    rng = random.Random(0)
    base = tokenizer.encode(" ".join(TEXTS))
    for _ in range(20):
        ids = [rng.choice(base) for _ in range(40)]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        detok, _ = _stream(tokenizer, [], ids, [rng.randint(1, 4)])
        detok.flush()  # random bytes may leave a dangling partial character
        assert detok.text == full


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello") + [eos] + tokenizer.encode(" world")
    skip, _ = _stream(tokenizer, [], ids, [1])
    assert skip.text == tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    keep, _ = _stream(tokenizer, [], ids, [1], skip_special_tokens=False)
    assert keep.text == tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|endoftext|>" in keep.text


def test_prompt_ending_mid_character(tokenizer):
    ids = tokenizer.encode("x🦀y")
    # Split inside the crab: the prompt ends with a partial character.
    prompt, output = ids[:2], ids[2:]
    detok, _ = _stream(tokenizer, prompt, output, [1])
    detok.flush()
    assert detok.text == tokenizer.decode(output)


def test_token_window_stays_small(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    for t in ids:
        detok.push([t])
        assert len(detok._tokens) <= 12  # context + a partial character
    assert detok.text == tokenizer.decode(ids)


def test_find_stop_string_basic():
    assert find_stop_string("hello world", 5, ["wor"], False) == ("wor", 6)
    assert find_stop_string("hello world", 5, ["wor"], True) == ("wor", 9)
    assert find_stop_string("hello world", 5, ["xyz"], False) is None
    # Match entirely in old text is not reported (would have been caught earlier).
    assert find_stop_string("stop and more", 4, ["stop"], False) is None
    # Several stops completed at once: the first in list order wins (vLLM), at its first match.
    assert find_stop_string("abcde", 5, ["d", "bc"], False) == ("d", 3)
    assert find_stop_string("xab", 3, ["b", "ab"], False) == ("b", 2)
    assert find_stop_string("", 0, ["a"], False) is None


def test_stop_string_spanning_two_pushes(tokenizer):
    output = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(tokenizer, [])
    stops = ["brown fox", "🦀"]
    hit = None
    for t in output:
        delta = detok.push([t])
        hit = find_stop_string(detok.text, len(delta), stops, include_stop=False)
        if hit:
            break
    assert hit is not None
    stop, cut = hit
    assert stop == "brown fox"
    # The stop string was not complete before the final push.
    assert "brown fox" not in detok.text[: len(detok.text) - len(delta)]
    detok.truncate(cut)
    assert detok.text == "The quick "


def test_stop_string_two_explicit_chunks():
    text = "Hello wor"
    assert find_stop_string(text, len(text), ["world"], False) is None
    text += "ld! Bye"
    assert find_stop_string(text, 7, ["world"], False) == ("world", 6)
    assert find_stop_string(text, 7, ["world"], True) == ("world", 11)
    assert text[:11] == "Hello world"


def test_include_stop_str_in_output_with_multibyte(tokenizer):
    ids = tokenizer.encode("答案是42。然后更多文字")
    detok = IncrementalDetokenizer(tokenizer, [])
    result = None
    for t in ids:
        delta = detok.push([t])
        result = find_stop_string(detok.text, len(delta), ["。"], include_stop=True)
        if result:
            break
    assert result is not None
    detok.truncate(result[1])
    assert detok.text == "答案是42。"


class _SlowTokenizer:
    """The test tokenizer seen only through `decode` (no backend): the detokenizer's other path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def test_backend_decode_gives_the_tokenizers_text(tokenizer):
    """Streams through the fast tokenizer's backend (the engine's path) and through
    `tokenizer.decode` give the same deltas, with and without special tokens."""
    assert IncrementalDetokenizer(tokenizer, [])._backend is tokenizer.backend_tokenizer
    slow_tokenizer = _SlowTokenizer(tokenizer)
    assert IncrementalDetokenizer(slow_tokenizer, [])._backend is None
    rng = random.Random(1)
    base = tokenizer.encode(" ".join(TEXTS)) + [tokenizer.eos_token_id]
    for skip in (True, False):
        for _ in range(10):
            ids = [rng.choice(base) for _ in range(30)]
            prompt = [rng.choice(base) for _ in range(3)]
            chunks = [rng.randint(1, 3)]
            fast, fast_deltas = _stream(tokenizer, prompt, ids, chunks, skip_special_tokens=skip)
            slow, slow_deltas = _stream(slow_tokenizer, prompt, ids, chunks, skip_special_tokens=skip)
            assert fast_deltas == slow_deltas
            assert fast.flush() + "".join(fast_deltas) == slow.flush() + "".join(slow_deltas)
            assert fast.text == slow.text


def test_tokenizer_that_cleans_up_spaces_decodes_through_itself(tokenizer):
    """`clean_up_tokenization_spaces` changes decode's text after the backend's: keep decode."""
    cleaning = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>", clean_up_tokenization_spaces=True
    )
    assert IncrementalDetokenizer(cleaning, [])._backend is None


def test_tokenizer_with_its_own_decode_decodes_through_itself(tokenizer):
    """A subclass that overrides `_decode` (as some of transformers' fast tokenizers do) may
    change the text: keep calling it."""

    class Overriding(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    overriding = Overriding(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>",
                            clean_up_tokenization_spaces=False)
    detok = IncrementalDetokenizer(overriding, [])
    assert detok._backend is None
    ids = tokenizer.encode("Hello world")
    assert detok.push(ids) == "HELLO WORLD"
