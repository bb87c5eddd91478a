"""What an engine is built from, decided from config files alone, before any weight is read.

`resolve_setup` turns `EngineArgs` into device, dtype, model config, parallel plan, tokenizer,
EOS ids and speculative config; every config error is raised here. The engine on node 0 and the
headless ranks of other nodes (lamina.engine.mp_executor.run_headless_node) call the same
function, so every node derives the same plan and rank spec from the same arguments.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lamina.config import (AUTO, EngineArgs, parse_max_model_len, resolve_device, resolve_dtype, resolve_kv_cache_dtype,
                           ssm_state_dtype_choice)
from lamina.engine import generation_defaults
from lamina.engine.spec_decode import SpeculativeConfig, check_speculative
from lamina.layers.moe import fp8_block_fits, fp8_experts_for
from lamina.quantization import BlockFp8, online_blocks, read_quantization, resolve_quantization, unquantized_experts
from lamina.models.hub import resolve_model_path
from lamina.models.registry import resolve_model_class
from lamina.parallel.config import ParallelConfig
from lamina.parallel.plan import ParallelPlan, build_plan
from lamina.worker.model_loader import read_model_config

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass
class EngineSetup:
    args: EngineArgs
    model_path: Path
    hf_config: Any  # transformers' PretrainedConfig, spellings normalised (read_model_config)
    model_cls: type
    model_config: Any  # the family's parsed config (HybridTextConfig or Qwen4-Exp's)
    device: torch.device
    dtype: torch.dtype
    ssm_state_dtype: torch.dtype  # the recurrent state pool's (mamba_ssm_cache_dtype, resolved)
    kv_cache_dtype: torch.dtype  # the attention layers' paged cache's (kv_cache_dtype, resolved)
    quantization: BlockFp8 | None  # the weights' block FP8 format (the checkpoint's, or dummy FP8)
    fp8_experts: bool  # every expert tensor of the checkpoint is FP8 (else all are dequantized)
    parallel_config: ParallelConfig
    plan: ParallelPlan
    max_model_len: int
    tokenizer: Any  # None: no tokenizer files, or skip_tokenizer_init (token-id prompts only)
    eos_token_ids: tuple[int, ...]
    spec_config: SpeculativeConfig | None
    mtp_prefix: str | None  # where the checkpoint keeps its MTP tensors (speculative decoding)
    default_sampling: dict  # SamplingParams defaults from the generation config (generation_defaults)

    def model_options(self) -> dict:
        """Options every rank's model is built with."""
        return {
            "ple_table_device": self.args.ple_table_device,
            "speculative_config": self.spec_config,
            "mtp_prefix": self.mtp_prefix,
            "quantization": self.quantization,
            "fp8_experts": self.fp8_experts,
        }

    def node_ranks(self) -> list[int]:
        """The ranks that run on this node (`args.node_rank`)."""
        return [r.rank for r in self.plan.ranks if r.node == self.parallel_config.node_rank]


def resolve_setup(args: EngineArgs) -> EngineSetup:
    """Validate `args` (filling in the default model) and resolve everything the engine and its
    ranks are built from."""
    args.validate()
    if args.model is None:
        from lamina.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    # a Hub id: fetched into (or found in) the Hugging Face cache; every node resolves it itself
    args.model = resolve_model_path(args.model, revision=args.revision, load_format=args.load_format,
                                    download_dir=args.download_dir)
    model_path = Path(args.model)
    hf_config = read_model_config(model_path, args.hf_overrides)
    if args.hf_overrides:
        logger.info("config.json overridden by hf_overrides: %s", args.hf_overrides)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, getattr(hf_config, "dtype", None))
    architecture, model_cls = resolve_model_class(hf_config)
    cfg = model_cls.parse_config(hf_config, architecture)
    quantization = resolve_quantization(args.quantization, read_quantization(hf_config), args.load_format)
    parallel_config = args.parallel_config()
    num_devices = torch.cuda.device_count() if device.type == "cuda" else None
    plan = build_plan(cfg, parallel_config, num_devices=num_devices, device_type=device.type)
    quantization = online_blocks(quantization, expert_intermediate_per_rank(cfg, plan))  # quantized at load: blocks
    fp8_experts = True  # every expert tensor of the checkpoint is FP8 (dummy weights, or quantized at load: all)
    if quantization is not None:
        unquantized = [] if quantization.online else unquantized_experts(model_path, args.load_format)
        fp8_experts = not unquantized
        _log_fp8_experts(quantization, cfg, plan, device, dtype, unquantized)
    max_model_len = resolve_max_model_len(args, cfg)
    # The model's own config (spellings normalised by read_model_config) so that transformers
    # does not re-read a config.json its version may refuse.
    if args.skip_tokenizer_init:
        tokenizer = None
    else:
        tokenizer = load_tokenizer(args.tokenizer or args.model, None if args.tokenizer else hf_config)
    eos_token_ids = _eos_token_ids(cfg, model_path, tokenizer)
    spec_config = SpeculativeConfig.parse(args.speculative_config)
    mtp_prefix = None
    if spec_config is not None:
        mtp_prefix = check_speculative(spec_config, hf_config, model_cls, model_path, args.load_format)
    default_sampling = generation_defaults.default_sampling(args.generation_config, model_path,
                                                            args.override_generation_config)
    ssm_state_dtype, source = ssm_state_dtype_choice(args.mamba_ssm_cache_dtype, hf_config, args.mamba_cache_dtype)
    if args.mamba_cache_dtype != "auto" and not source.startswith("mamba_cache_dtype"):
        logger.warning("mamba_cache_dtype = %s is not used: %s names the recurrent pool's dtype (the conv state "
                       "stays in the model's dtype); pass mamba_ssm_cache_dtype to choose", args.mamba_cache_dtype,
                       source)
    if ssm_state_dtype.itemsize < 4:
        logger.warning("recurrent state pool in %s (%s): states are rounded where they are stored (every decode "
                       "step, prefill chunk and accepted draft), so a result follows how its prompt was chunked, "
                       "i.e. the batch, within that rounding; float32 keeps batch invariance",
                       str(ssm_state_dtype).removeprefix("torch."), source)
    else:
        logger.info("recurrent state pool in %s (%s)", str(ssm_state_dtype).removeprefix("torch."), source)
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    if kv_cache_dtype.itemsize == 1 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype = {args.kv_cache_dtype}: an FP8 KV cache needs a GPU of compute capability "
                         f"8.9 or later (Ada, Hopper, Blackwell), this one is "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; use kv_cache_dtype auto")
    if kv_cache_dtype != dtype:
        logger.info("paged KV cache in %s (kv_cache_dtype = %s; the model computes in %s)",
                    str(kv_cache_dtype).removeprefix("torch."), args.kv_cache_dtype, str(dtype).removeprefix("torch."))
    return EngineSetup(
        args=args, model_path=model_path, hf_config=hf_config, model_cls=model_cls, model_config=cfg,
        device=device, dtype=dtype, ssm_state_dtype=ssm_state_dtype, kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        fp8_experts=fp8_experts,
        parallel_config=parallel_config, plan=plan, max_model_len=max_model_len,
        tokenizer=tokenizer, eos_token_ids=eos_token_ids, spec_config=spec_config, mtp_prefix=mtp_prefix,
        default_sampling=default_sampling,
    )


def expert_intermediate_per_rank(cfg, plan: ParallelPlan) -> int:
    """A rank's slice of each routed expert's intermediate rows (whole under expert parallelism)."""
    inter = getattr(cfg, "moe_intermediate_size", 0) or 0
    return inter if plan.ep_enabled else inter // max(plan.tp, 1)


def _log_fp8_experts(quantization: BlockFp8, cfg, plan: ParallelPlan, device: torch.device, dtype: torch.dtype,
                     unquantized: list[str]) -> None:
    """Say where block FP8 weights stay FP8, and why not when a GPU engine's experts cannot."""
    dtype_name = str(dtype).removeprefix("torch.")
    inter = getattr(cfg, "moe_intermediate_size", 0)
    inter_per_rank = expert_intermediate_per_rank(cfg, plan)
    rest = ("every other weight keeps the checkpoint's dtype" if quantization.online
            else f"everything else is dequantized into {dtype_name} as it loads")
    if not fp8_experts_for({"quantization": quantization}, device) or not inter:
        what = "the experts are quantized, then dequantized into" if quantization.online else "each is dequantized into"
        logger.info("weights are %s: %s %s as it loads", quantization.describe(), what, dtype_name)
    elif unquantized:
        logger.warning("weights are %s, but %d expert tensors are not FP8 (e.g. %s): every expert is dequantized into "
                       "%s as it loads, twice the memory of FP8 experts", quantization.describe(), len(unquantized),
                       unquantized[0], dtype_name)
    elif fp8_block_fits(quantization, inter_per_rank):
        logger.info("weights are %s: the MoE experts stay FP8, %s", quantization.describe(), rest)
    else:  # the remedy only where a whole expert's rows would fit the blocks
        remedy = ("; fewer tensor-parallel ranks or --enable-expert-parallel keep them FP8"
                  if fp8_block_fits(quantization, inter) else "")
        logger.warning("weights are %s, but a rank's %d intermediate rows of each expert are not a multiple of the "
                       "%dx%d blocks (powers of two, columns >= 16): the experts are dequantized into %s, twice the "
                       "memory%s", quantization.describe(), inter_per_rank, quantization.block_rows,
                       quantization.block_cols, dtype_name, remedy)


def load_tokenizer(path: str, config=None):
    from transformers import AutoTokenizer

    # transformers 5 builds an empty placeholder tokenizer for a directory without tokenizer
    # files; treat that as "no tokenizer" rather than decode with a one-token vocabulary.
    if Path(path).is_dir() and not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: only token-id prompts will work", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path, **({"config": config} if config is not None else {}))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer loaded from %s (%s): only token-id prompts will work", path, e)
        return None


def resolve_max_model_len(args: EngineArgs, cfg) -> int:
    """max_model_len: the asked one, which must not exceed the model's max_position_embeddings, else
    that (also for "auto", which the engine's memory plan may then shorten: `max_model_len_is_auto`)."""
    limit = cfg.max_position_embeddings
    requested = parse_max_model_len(args.max_model_len)
    if requested is None or requested == AUTO:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len = {requested} exceeds the model's context of {limit} tokens (max_position_embeddings, "
            "or what its rope_parameters scale it to)"
        )
    return requested


def max_model_len_is_auto(args: EngineArgs) -> bool:
    """Whether max_model_len is to be fitted to the memory ("auto" or -1, vLLM's spellings)."""
    return parse_max_model_len(args.max_model_len) == AUTO


def _eos_token_ids(cfg, model_path: Path, tokenizer) -> tuple[int, ...]:
    ids = list(cfg.eos_token_ids)
    gen_path = model_path / "generation_config.json"
    if gen_path.exists():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))
