"""The demo model's task corpus: small problems with one exact answer each, generated from a seed.

Every item is a user prompt and the assistant's answer. The tasks need different things from the
model: carries (add), comparisons (sort, max), position bookkeeping (reverse, count), a stack
(brackets) and retrieval over a long context (lookup, up to 24 key-value pairs, longer than the
attention layers' QSA budget). A few greetings teach the model to say what it can do.

`make_eval_set` draws the held-out set from its own seed; `TrainStream` never yields one of its
prompts, so the evaluation measures generalisation, not recall.
"""

from __future__ import annotations

import random
import string

TASKS = ("add", "sort", "reverse", "max", "count", "brackets", "lookup")
# Training draws the harder tasks more often (the held-out set has every task equally often).
TRAIN_WEIGHTS = (4.0, 1.0, 1.0, 1.0, 1.0, 1.5, 3.0)

GREETING_PROMPTS = (
    "Hello, lamina", "Hello", "Hi", "Hi!", "hello", "Hey", "Who are you?", "What can you do?", "Help", "help",
)
GREETING_ANSWER = (
    "Hello! I am lamina's demo model. Ask me to add two numbers, sort, reverse or find the largest "
    "of a list, count a letter, check brackets, or look up a key."
)

_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def _numbers(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(0, 99) for _ in range(rng.randint(low, high))]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = (rng.randint(0, 999 if rng.random() < 0.5 else 99) for _ in range(2))
    form = rng.randrange(3)
    prompt = (f"What is {a} + {b}?", f"{a} + {b} =", f"Add {a} and {b}.")[form]
    return prompt, str(a + b)


def _sort(rng: random.Random) -> tuple[str, str]:
    xs = _numbers(rng, 3, 7)
    return f"Sort ascending: {' '.join(map(str, xs))}", " ".join(map(str, sorted(xs)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    xs = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8))]
    return f"Reverse: {' '.join(xs)}", " ".join(reversed(xs))


def _max(rng: random.Random) -> tuple[str, str]:
    xs = _numbers(rng, 3, 8)
    return f"Largest of: {' '.join(map(str, xs))}", str(max(xs))


def _count(rng: random.Random) -> tuple[str, str]:
    letters = [rng.choice("abcd") for _ in range(rng.randint(4, 12))]
    target = rng.choice("abcd")
    return f"Count the letter {target} in: {' '.join(letters)}", str(letters.count(target))


def _balanced(rng: random.Random, pairs: int) -> str:
    if pairs == 0:
        return ""
    inside = rng.randint(0, pairs - 1)
    opener = rng.choice(tuple(_BRACKETS))
    return opener + _balanced(rng, inside) + _BRACKETS[opener] + _balanced(rng, pairs - 1 - inside)


def _is_balanced(text: str) -> bool:
    stack: list[str] = []
    for ch in text:
        if ch in _BRACKETS:
            stack.append(_BRACKETS[ch])
        elif not stack or stack.pop() != ch:
            return False
    return not stack


def _brackets(rng: random.Random) -> tuple[str, str]:
    text = _balanced(rng, rng.randint(1, 6))
    if rng.random() < 0.5:  # corrupt it: swap a closer, drop a character or swap two neighbours
        chars = list(text)
        i = rng.randrange(len(chars))
        kind = rng.randrange(3)
        if kind == 0:
            chars[i] = rng.choice("([{)]}")
        elif kind == 1:
            del chars[i]
        elif len(chars) > 1:
            j = min(i + 1, len(chars) - 1) if i + 1 < len(chars) else i - 1
            chars[i], chars[j] = chars[j], chars[i]
        text = "".join(chars) or "("
    return f"Are these brackets balanced? {text}", "yes" if _is_balanced(text) else "no"


def _lookup(rng: random.Random) -> tuple[str, str]:
    count = rng.randint(4, 24)
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < count:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 3)))
        if key not in seen:
            seen.add(key)
            keys.append(key)
    values = [rng.randint(0, 99) for _ in keys]
    i = rng.randrange(count)
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, values))
    return f"{pairs}. What is {keys[i]}?", str(values[i])


_MAKERS = {"add": _add, "sort": _sort, "reverse": _reverse, "max": _max, "count": _count,
           "brackets": _brackets, "lookup": _lookup}


def make_item(rng: random.Random, task: str) -> tuple[str, str]:
    return _MAKERS[task](rng)


def make_eval_set(num_items: int, seed: int) -> list[dict]:
    """`num_items` distinct prompts, tasks in turn; each item records its own answer length budget."""
    rng = random.Random(seed)
    items: list[dict] = []
    prompts: set[str] = set()
    while len(items) < num_items:
        task = TASKS[len(items) % len(TASKS)]
        prompt, answer = make_item(rng, task)
        if prompt in prompts:
            continue
        prompts.add(prompt)
        items.append({"id": len(items), "task": task, "prompt": prompt, "answer": answer, "max_tokens": 32})
    return items


class TrainStream:
    """An endless seeded stream of (prompt, answer) pairs, never one of `held_out`'s prompts."""

    def __init__(self, seed: int, held_out: set[str], greeting_rate: float = 0.01):
        self.rng = random.Random(seed)
        self.held_out = held_out
        self.greeting_rate = greeting_rate

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, str]:
        rng = self.rng
        if rng.random() < self.greeting_rate:
            return rng.choice(GREETING_PROMPTS), GREETING_ANSWER
        while True:
            prompt, answer = make_item(rng, rng.choices(TASKS, weights=TRAIN_WEIGHTS)[0])
            if prompt not in self.held_out:
                return prompt, answer
