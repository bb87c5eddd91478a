"""Train lamina's built-in demo model: a small Qwen4-Exp with an MTP head, on generated tasks.

    python tools/train_demo_model.py --out lamina/demo_model [--steps 1686] [--device cuda]

Seeded: the tokenizer, the held-out set, the data stream and the initial weights all come from
--seed, so a rerun with the same --steps trains the same recipe; GPU kernels with atomics (the
backward of embeddings and index ops) make the weights equal only to rounding, not bit for bit.
The shipped model: --steps 1686, 466 s on one H200.

The model has every Qwen4-Exp feature lamina serves: gated delta net layers, QSA indexed
attention (budget 64 tokens in blocks of 8, below the longest prompts), two hyper-connection
streams, two N-gram PLE layers (1-based ids 4 and 5, on the second half of the stack), MoE with 8
experts (top 2) and a shared expert on every layer, and a one-layer MTP head. Training runs
transformers' own modules (tools/demo_model_arch.py swaps in a vectorised QSA attention with the
same selection), so `save_pretrained` writes the exact file layout transformers and lamina read;
the MTP tensors are added under `mtp.*`, and config.json declares `mtp_num_hidden_layers: 1`.

Written to --out: config.json, generation_config.json, model.safetensors (bfloat16),
tokenizer.json, tokenizer_config.json, chat_template.jinja, eval.jsonl (the held-out set,
--eval-items items) and training.json (the recipe, the loss curve and the wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_model_arch as arch  # noqa: E402
from demo_tasks import GREETING_ANSWER, TrainStream, make_eval_set  # noqa: E402

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
VOCAB_SIZE = 512  # learned byte-level BPE tokens + 3 special tokens
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention"] * 2


def text_config_kwargs(eos_id: int, pad_id: int) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=192, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, norm_topk_prob=True,
        hc_count=2, hc_lowrank=16, ple_layer_ids=[4, 5], ple_embed_dim=64, ple_conv_kernel_size=3, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=4096, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4,
        seed=1234, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=64,
        indexer_compress_ratio=8, max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=False,
    )


# ---- tokenizer -----------------------------------------------------------------------------------
def chat_text(prompt: str, answer: str | None = None) -> str:
    text = f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"
    return text if answer is None else text + f"{answer}{IM_END}\n"


def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    # Digits one by one (arithmetic wants them), then GPT-2 style byte-level words.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 3, min_frequency=2, show_progress=False, initial_alphabet=sorted(alphabet),
        special_tokens=[],
    )
    stream = TrainStream(seed + 1, held_out=set(), greeting_rate=0.05)
    corpus = [chat_text(*next(stream)).replace(IM_START, "").replace(IM_END, "") for _ in range(20000)]
    backend.train_from_iterator(corpus, trainer=trainer)
    backend.add_special_tokens([ENDOFTEXT, IM_START, IM_END])
    if backend.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {backend.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT, model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---- data ----------------------------------------------------------------------------------------
class PackedBatches:
    """Rows of `seq_len` tokens, examples packed back to back; the loss covers answers (and their
    closing <|im_end|>) only. Rows always start with an example, so position 0 is seen too."""

    def __init__(self, tokenizer, stream: TrainStream, batch_size: int, seq_len: int, pad_id: int):
        self.tok, self.stream = tokenizer, stream
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.pending: tuple[list[int], list[int]] | None = None

    def _examples(self, count: int):
        pairs = [next(self.stream) for _ in range(count)]
        prompts = self.tok([chat_text(p) for p, _ in pairs], add_special_tokens=False)["input_ids"]
        answers = self.tok([f"{a}{IM_END}\n" for _, a in pairs], add_special_tokens=False)["input_ids"]
        for p, a in zip(prompts, answers):
            # the trailing "\n" after <|im_end|> is context, not a target
            yield p + a, [0] * len(p) + [1] * (len(a) - 1) + [0]

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((self.batch_size, self.seq_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((self.batch_size, self.seq_len), dtype=torch.bool)
        examples = self._examples(self.batch_size * 24)
        for row in range(self.batch_size):
            used = 0
            while True:
                if self.pending is None:
                    try:
                        self.pending = next(examples)
                    except StopIteration:
                        examples = self._examples(self.batch_size * 8)
                        continue
                tokens, targets = self.pending
                if len(tokens) > self.seq_len:
                    self.pending = None
                    continue
                if used + len(tokens) > self.seq_len:
                    break
                ids[row, used:used + len(tokens)] = torch.tensor(tokens)
                mask[row, used:used + len(tokens)] = torch.tensor(targets, dtype=torch.bool)
                used += len(tokens)
                self.pending = None
        return ids, mask


# ---- training ------------------------------------------------------------------------------------
def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    total = 0.0
    for logits in router_logits:
        probs = logits.float().softmax(-1)  # [N, E]
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).float()  # [N, E]
        total = total + num_experts * (chosen.mean(0) * probs.mean(0)).sum() / top_k
    return total / max(len(router_logits), 1)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args) -> None:
    import transformers

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(args.seed)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eval_items = make_eval_set(args.eval_items, seed=args.seed + 7)
    held_out = {item["prompt"] for item in eval_items}

    arch.install_training_modules()
    kwargs = text_config_kwargs(eos_id, pad_id)
    config = transformers.Qwen4ExpTextConfig(**kwargs)
    config._attn_implementation = "sdpa"
    model = transformers.Qwen4ExpForCausalLM(config)
    mtp = arch.MTPHead(kwargs)
    if args.check:
        ids = torch.randint(0, VOCAB_SIZE - 3, (2, 150))
        print(f"training attention vs transformers (per attention layer): {arch.check_against_transformers(model.float(), ids)}")
    model.to(device).train()
    mtp.to(device).train()
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    router_logits: list[torch.Tensor] = []
    for module in list(model.modules()) + list(mtp.modules()):
        if isinstance(module, arch.hf.Qwen4ExpTextTopKRouter):
            module.register_forward_hook(lambda m, i, o: router_logits.append(o[0]))
    streams_box: list[torch.Tensor] = []
    model.model.hyper_connection_mixer.register_forward_pre_hook(lambda m, a: streams_box.append(a[0]))

    batches = PackedBatches(tokenizer, TrainStream(args.seed + 3, held_out), args.batch_size, args.seq_len, pad_id)
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M (model + MTP), device {device}, steps {args.steps}", flush=True)
    log: list[dict] = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    start = time.perf_counter()
    for step in range(args.steps):
        ids, mask = next(batches)
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        router_logits.clear()
        streams_box.clear()
        arch.AUX_LOSSES.clear()
        arch.COLLECT_AUX[0] = True
        with autocast:
            hidden = model.model(input_ids=ids).last_hidden_state  # [B, T, H]
            targets = mask[:, 1:]
            logits = model.lm_head(hidden[:, :-1][targets])  # [N, V]
            lm_loss = F.cross_entropy(logits.float(), ids[:, 1:][targets])
            # MTP: streams at p and token p+1 predict token p+2 (target weights frozen for this loss)
            streams = streams_box[0][:, :-1].detach()  # [B, T-1, hc*H]
            cos_sin = arch.rotary(model, ids.shape[0], ids.shape[1] - 1, device, streams)
            mtp_hidden = mtp(streams, ids[:, 1:], model.model.embed_tokens.weight.detach(), cos_sin)
            mtp_targets = mask[:, 2:]
            mtp_logits = F.linear(mtp_hidden[:, :-1][mtp_targets], model.lm_head.weight.detach())
            mtp_loss = F.cross_entropy(mtp_logits.float(), ids[:, 2:][mtp_targets])
            aux = torch.stack(arch.AUX_LOSSES).mean() if arch.AUX_LOSSES else torch.zeros((), device=device)
            balance = load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok)
            loss = lm_loss + args.mtp_weight * mtp_loss + args.indexer_weight * aux + args.balance_weight * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            with torch.no_grad():
                acc = (logits.argmax(-1) == ids[:, 1:][targets]).float().mean().item()
                mtp_acc = (mtp_logits.argmax(-1) == ids[:, 2:][mtp_targets]).float().mean().item()
            entry = dict(step=step, seconds=round(time.perf_counter() - start, 1), loss=round(lm_loss.item(), 4),
                         token_acc=round(acc, 4), mtp_loss=round(mtp_loss.item(), 4), mtp_token_acc=round(mtp_acc, 4),
                         indexer_kl=round(aux.item(), 4), balance=round(float(balance), 4))
            log.append(entry)
            print(json.dumps(entry), flush=True)
    wall = time.perf_counter() - start
    arch.COLLECT_AUX[0] = False
    save(model, mtp, tokenizer, config, eval_items, out, args, log, wall, n_params)


def save(model, mtp, tokenizer, config, eval_items, out: Path, args, log, wall: float, n_params: int) -> None:
    from safetensors.torch import load_file, save_file

    model = model.to("cpu", torch.bfloat16).eval()
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, tensor in mtp.to("cpu", torch.bfloat16).state_dict().items():
        tensors[f"mtp.{name}"] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    # every transformers version reads this spelling of the (indexed) attention layers
    cfg["layer_types"] = ["full_attention" if t != "linear_attention" else t for t in cfg["layer_types"]]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    with (out / "eval.jsonl").open("w") as f:
        for item in eval_items:
            f.write(json.dumps(item) + "\n")
    record = dict(
        recipe="tools/train_demo_model.py", argv=sys.argv[1:], seed=args.seed, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, wall_seconds=round(wall, 1),
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        torch=torch.__version__, parameters=n_params, greeting=GREETING_ANSWER, log=log,
    )
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB weights) in {wall:.0f} s of training")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1686)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--indexer-weight", type=float, default=0.1)
    p.add_argument("--balance-weight", type=float, default=0.01)
    p.add_argument("--eval-items", type=int, default=700)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--check", action="store_true", help="first compare the training attention with transformers'")
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
