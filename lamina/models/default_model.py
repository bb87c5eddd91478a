"""Built-in default model for lamina.

Until a trained checkpoint ships, ``lamina generate`` without ``--model`` runs on a
tiny, randomly initialised Qwen3-Next (hybrid linear/full attention + MoE)
checkpoint together with a small byte-level BPE tokenizer.  Both are produced
offline and deterministically the first time they are needed and are cached on
disk.  The checkpoint is clearly labelled as untrained by a marker file: its
output is meaningless text, it only exists so that every code path of the
engine can be exercised without network access.

Public API
----------
``DEFAULT_MODEL_NAME``      directory name of the cached checkpoint
``default_model_dir()``     where the checkpoint lives (honours env vars)
``ensure_default_model()``  build the checkpoint if needed and return its path
``is_untrained_default()``  whether a directory holds the untrained default
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import tempfile
import threading
import uuid

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "UNTRAINED_MARKER",
    "default_model_dir",
    "ensure_default_model",
    "is_untrained_default",
]

DEFAULT_MODEL_NAME = "lamina-default-untrained"
UNTRAINED_MARKER = "LAMINA_UNTRAINED"

# Bump when the recipe below changes in a way that alters the produced files.
_RECIPE_VERSION = 1

_MARKER_TEXT = (
    f"{DEFAULT_MODEL_NAME} (recipe v{_RECIPE_VERSION}): randomly initialised, untrained "
    "Qwen3-Next checkpoint built by lamina for offline smoke runs; its output is "
    "meaningless, pass --model to use a real model.\n"
)

_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    UNTRAINED_MARKER,
)

# Special tokens (ChatML, Qwen style).  They are appended after the learned
# vocabulary so that ordinary tokens occupy the low ids, like Qwen tokenizers.
_ENDOFTEXT = "<|endoftext|>"
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_SPECIAL_TOKENS = (_ENDOFTEXT, _IM_START, _IM_END)

_TARGET_VOCAB_SIZE = 1000  # learned tokens (bytes + merges) + special tokens
_MAX_POSITIONS = 4096
_FLOAT32_LIMIT_BYTES = 20 * 1024 * 1024

# Model construction draws from torch's global RNG; serialise it so that
# concurrent in-process builds (threads) still produce identical weights.
_RNG_LOCK = threading.Lock()

_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] -%}"
    "{%- else -%}"
    "{%- set text = namespace(v='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set text.v = text.v + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set text = text.v -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# A small English corpus written for lamina.  It only has to give the BPE
# trainer enough common words and sub-words to learn ~750 merges; the model is
# untrained, so the text's content does not matter beyond being ordinary prose.
_CORPUS = """\
The morning was quiet, and the small town by the river had not yet woken up.
A baker opened the shutters of his shop and set out the first loaves of bread.
The smell of warm crust drifted down the street, past the closed doors of the
library, the post office and the old stone church with its crooked bell tower.

Every day the baker rose before the sun.  He said that the best part of the
day was the hour when nobody else was awake, when the ovens were hot and the
only sound was the river running under the bridge.  His daughter thought he
was a little strange, but she liked the bread, and she liked the stories he
told while the dough was resting.

One of those stories was about a traveller who came to the town in winter.
The traveller carried a heavy bag and a map that nobody could read.  She asked
for a room, a meal and a place to dry her boots.  In return she offered to
teach the children how to count the stars, how to find north without a
compass, and how to write their names in an alphabet from a country far away.

People in the town still argue about where she went when the snow melted.
Some say she walked over the mountains to the sea.  Others believe she never
left at all, and that the woman who keeps the library is the same traveller,
only older and more patient than before.

Questions and answers

What is a language model?  A language model is a program that reads a
sequence of tokens and predicts which token is likely to come next.  When it
is trained on a large amount of text, it learns grammar, facts and style.
When it is not trained, as in this case, its predictions are random and the
text it produces has no meaning at all.

What is a token?  A token is a small piece of text.  It can be a whole word,
part of a word, a single character or even a single byte.  The tokenizer
splits the input into tokens and turns each token into a number.  The model
only ever sees these numbers, never the letters themselves.

Why are there special tokens?  Special tokens mark the structure of a
conversation.  One token starts a message, another one ends it, and a third
marks the end of a document.  Because they never appear in normal text, the
model can use them to know who is speaking and when a reply is finished.

How does generation work?  The model reads the prompt, computes a score for
every token in its vocabulary, and then one token is chosen, either the one
with the highest score or a random one drawn according to the scores.  The
chosen token is added to the sequence and the process repeats until a stop
token appears or the length limit is reached.

Notes on the weather

It rained for three days in a row.  The fields turned to mud, the roads were
flooded near the mill, and the farmers waited for the water to go down before
they could bring the animals back from the hills.  On the fourth day the wind
changed, the clouds broke apart, and a bright, cold light came over the
valley.  By the evening the sky was clear and the first stars were visible
above the forest.

In summer the weather is usually warm and dry.  Children swim in the river,
families eat dinner outside, and the market stays open late into the night.
In autumn the leaves turn yellow and red, the days get shorter, and the smell
of smoke from the chimneys fills the air.  Winter brings snow, long evenings
and hot soup.  Spring brings mud, flowers and the return of the birds.

A short list of useful things

1. Write things down, because memory is not as reliable as paper.
2. Check your work twice before you share it with other people.
3. Keep your tools clean and put them back where you found them.
4. Ask questions when you do not understand something.
5. Take a break when you are tired; a rested mind makes fewer mistakes.
6. Read the instructions, even when you think you already know the answer.
7. Be kind to the people who help you, and help them when they need it.

On computers

A computer follows instructions exactly as they are written.  It does not
guess what you meant, and it does not forgive small mistakes.  If a program
has an error, the computer will repeat that error a million times without
complaint.  This is why programmers test their code, measure its speed and
read the messages that the machine prints when something goes wrong.

Memory is one of the most important resources of a computer.  Data that is
used often should be kept close to the processor, while data that is used
rarely can live further away.  A good program moves data as little as
possible, reuses what it has already computed, and does the expensive work
only once.  The same ideas apply to people who organise a kitchen, a
workshop or a library.

Numbers and time

There are sixty seconds in a minute, sixty minutes in an hour and twenty four
hours in a day.  A week has seven days, a year has twelve months, and most
years have three hundred and sixty five days.  Zero, one, two, three, four,
five, six, seven, eight, nine and ten are the first numbers that children
learn to count.  Later they learn to add, subtract, multiply and divide, and
some of them grow up to study the strange and beautiful patterns hidden in
the numbers.

A conversation

"Good morning," said the teacher.  "Did you finish the reading for today?"
"Yes," answered the student, "but I did not understand the last chapter."
"That is fine.  Tell me which part was difficult, and we will read it again
together.  It is normal to find hard things hard; that is how learning feels."
"Thank you.  Could you also explain why the story ends so suddenly?"
"Perhaps the writer wanted the reader to imagine the ending.  What do you think
happens next?"  The student thought for a while and then began to write.
"""


def _cache_root() -> pathlib.Path:
    explicit = os.environ.get("LAMINA_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "lamina"
    return pathlib.Path.home() / ".cache" / "lamina"


def default_model_dir() -> pathlib.Path:
    """Location of the cached default checkpoint.

    ``$LAMINA_CACHE_DIR/<name>`` if set, otherwise ``$XDG_CACHE_HOME/lamina/<name>``,
    otherwise ``~/.cache/lamina/<name>``.
    """
    return _cache_root() / DEFAULT_MODEL_NAME


def is_untrained_default(path: str | os.PathLike) -> bool:
    """True if ``path`` is a checkpoint directory carrying the untrained marker."""
    return (pathlib.Path(path) / UNTRAINED_MARKER).is_file()


def _is_complete(path: pathlib.Path) -> bool:
    try:
        return path.is_dir() and all(
            (path / name).is_file() and (path / name).stat().st_size > 0 for name in _REQUIRED_FILES
        )
    except OSError:
        return False


def ensure_default_model(path: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a directory holding the untrained default checkpoint, building it if needed.

    The checkpoint is built in a temporary sibling directory and renamed into
    place, so readers never observe a half-written checkpoint and concurrent
    callers cannot corrupt each other: the first rename wins and the others
    discard their copy and use the winner's.
    """
    target = pathlib.Path(path).expanduser() if path is not None else default_model_dir()
    if _is_complete(target):
        return target

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        logger.info("building untrained default model in %s", target)
        _build_checkpoint(tmp)
        _make_shareable(tmp)
        for _ in range(5):
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                # Typically ENOTEMPTY/EEXIST: someone else got there first.
                if _is_complete(target):
                    return target
                if not target.exists():
                    continue  # vanished in between; just retry the rename
                # A stale, incomplete directory (e.g. an interrupted manual
                # copy) occupies the slot.  Completed checkpoints only ever
                # appear through an atomic rename, so moving it aside is safe.
                trash = parent / f".{target.name}.stale-{uuid.uuid4().hex}"
                try:
                    os.rename(target, trash)
                except FileNotFoundError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
        if _is_complete(target):
            return target
        raise RuntimeError(f"could not install the default model at {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _make_shareable(directory: pathlib.Path) -> None:
    # mkdtemp creates the directory 0700; give the finished checkpoint the
    # permissions an ordinary mkdir/open would have (subject to the umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for entry in directory.iterdir():
        if entry.is_file():
            os.chmod(entry, 0o666 & ~umask)


# ---------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------


def _build_checkpoint(out_dir: pathlib.Path) -> None:
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    _build_model(tokenizer, out_dir)
    (out_dir / UNTRAINED_MARKER).write_text(_MARKER_TEXT, encoding="utf-8")


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 byte symbols
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB_SIZE - len(_SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=sorted(alphabet),
        special_tokens=[],
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    backend.add_special_tokens(list(_SPECIAL_TOKENS))

    vocab = backend.get_vocab()
    missing = [s for s in alphabet if s not in vocab]
    if missing:  # cannot happen with initial_alphabet, but be explicit
        raise RuntimeError(f"byte symbols missing from the default vocabulary: {missing!r}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=_IM_END,
        pad_token=_ENDOFTEXT,
        model_max_length=_MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _build_model(tokenizer, out_dir: pathlib.Path) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    vocab_size = len(tokenizer)
    padded_vocab = -(-vocab_size // 64) * 64
    eos_id = tokenizer.convert_tokens_to_ids(_IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(_ENDOFTEXT)

    config = Qwen3NextConfig(
        vocab_size=padded_vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
        max_position_embeddings=_MAX_POSITIONS,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=pad_id,  # Qwen convention: <|endoftext|> doubles as BOS id
        tie_word_embeddings=False,
        architectures=["Qwen3NextForCausalLM"],
    )

    with _RNG_LOCK:
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(0)
            model = Qwen3NextForCausalLM(config)
        finally:
            torch.random.set_rng_state(state)
    model = model.to(torch.float32).eval()
    _perturb_norms(model)

    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    if n_bytes > _FLOAT32_LIMIT_BYTES:
        model = model.to(torch.bfloat16)
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _perturb_norms(model) -> None:
    """Give the norm weights small deterministic random values.

    transformers initialises the zero-centred RMSNorms (output = x * (1 + w))
    to w = 0 and the gated norm to 1, which would leave the weight inputs of
    those kernels untested.  Perturb them with a private generator so the
    result does not depend on (or disturb) the global RNG.
    """
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
            if isinstance(module, mq.Qwen3NextRMSNormGated):
                noise = torch.randn(module.weight.shape, generator=gen, dtype=torch.float32)
                module.weight.copy_(1.0 + 0.1 * noise)
            elif isinstance(module, mq.Qwen3NextRMSNorm):
                noise = torch.randn(module.weight.shape, generator=gen, dtype=torch.float32)
                module.weight.copy_(0.1 * noise)
