"""The tokenizer of the tiny test checkpoints: a byte-level BPE of 1000 tokens (997 learned, then
<|endoftext|>, <|im_start|>, <|im_end|> at 997-999, which the tiny configs use as pad and eos) with
a ChatML template, trained on a short English text. Built once per process, deterministically.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

_ENDOFTEXT = "<|endoftext|>"
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_SPECIAL_TOKENS = (_ENDOFTEXT, _IM_START, _IM_END)
_TARGET_VOCAB_SIZE = 1000
_MAX_POSITIONS = 4096

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
# trainer enough common words and sub-words to learn ~750 merges; the tiny test
# models are random, so the text's content does not matter beyond being ordinary prose.
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


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_dir() -> Path:
    """A directory holding the tokenizer files (tokenizer.json, tokenizer_config.json, ...)."""
    path = Path(tempfile.mkdtemp(prefix="lamina-tiny-tokenizer-"))
    tokenizer = _build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(list(_SPECIAL_TOKENS))
    if len(tokenizer) != _TARGET_VOCAB_SIZE or ids != [997, 998, 999]:  # tiny_checkpoints' pad / eos ids
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens and special ids {ids}, expected 1000 and 997-999")
    tokenizer.save_pretrained(path)
    return path
