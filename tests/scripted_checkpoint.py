"""A tiny checkpoint whose greedy output is a chosen text, so server tests of tool calls and reasoning do
not depend on a trained model (nor on logit_bias or structured output, which lamina does not have yet).

How it works: start from a tiny random Qwen3-Next checkpoint (transformers' save_pretrained) and edit it
into a *bigram* model, whose next token depends only on the current one:
- every layer's output projection (attention `o_proj`, linear attention `out_proj`, every expert's and the
  shared expert's `down_proj`) is zeroed, so each layer adds nothing to the residual stream and the final
  hidden state is the token's own embedding;
- the final norm's weight is zeroed (Qwen3-Next's norm scales by 1 + weight, so this is the identity);
- the script's pieces are added to the tokenizer as tokens (`add_tokens`, not special, so they survive
  `skip_special_tokens`), each piece one token;
- token k of the chain [start, piece 1, ..., piece n] gets the embedding e_k (a basis vector; every other
  token gets e_63), and the LM head row of the next chain token (for the last piece: EOS) is 30 * e_k,
  so after RMSNorm its logit is 240 and every other logit is 0.
Greedy decoding after a prompt that ends with `start` therefore writes the pieces and stops with EOS;
after a prompt that ends with piece i it writes pieces i+1..n. Each piece may appear once in the chain.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
_OTHER = 63  # the embedding direction of every token outside the chain
_LOGIT_SCALE = 30.0


def make_scripted_checkpoint(src: Path, dst: Path, pieces: list[str], *, start: str = "\n",
                             chat_template: str | None = None) -> Path:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(dst)
    if chat_template is not None:
        (dst / "chat_template.jinja").write_text(chat_template)
    tok = AutoTokenizer.from_pretrained(dst)

    def one_token(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, f"{text!r} is not one token: {ids}"
        return ids[0]

    chain = [one_token(start)] + [one_token(p) for p in pieces]
    assert len(set(chain)) == len(chain), "every chain token must be distinct (a bigram model has one successor)"
    assert len(chain) < _OTHER
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(_OUTPUT_PROJECTIONS) and ".layers." in name:
            tensor.zero_()
    tensors["model.norm.weight"].zero_()
    embed = tensors["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    assert max(chain) < vocab and eos < vocab
    embed.zero_()
    embed[:, _OTHER] = 1.0
    head = torch.zeros(vocab, hidden)
    head[eos, _OTHER] = _LOGIT_SCALE
    for k, token in enumerate(chain):
        embed[token] = 0.0
        embed[token, k] = 1.0
        successor = chain[k + 1] if k + 1 < len(chain) else eos
        head[successor, k] = _LOGIT_SCALE
    tensors["lm_head.weight"] = head
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
