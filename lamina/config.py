"""Engine arguments (vLLM names) and their resolution against the machine and the model config."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}

# vLLM's choices for --mamba-ssm-cache-dtype and --mamba-cache-dtype
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's choices for --kv-cache-dtype: "auto" keeps the attention layers' paged cache in the model's
# dtype; "fp8" (= "fp8_e4m3", range +-448) and "fp8_e5m2" (+-57344) halve it from 16-bit, with a
# scale of 1.0 (no calibrated scales): keys and values are clamped to the format's range and rounded
# where they are stored, and every attention read, a step's own keys included, sees the stored values.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = ("bf16", "fp16", "half", "float", "fp32")  # of the dtypes above, also taken
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# vLLM's logprobs_mode: what a sampled token's logprobs (its own, its rank, the top N) report.
# raw: the model's logits (log_softmax of them, or the logits); processed: the values the token was
# chosen from, after bans, the per-request adjustments, and on random rows temperature, min-p and
# top-k / top-p (tokens those remove: -inf); greedy rows have no temperature or filters.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class EngineArgs:
    model: str | None = None  # None: the built-in demo model (lamina/demo_model); a folder or a Hub id
    revision: str | None = None  # vLLM's: the Hub revision (branch, tag, commit) of a MODEL given as a Hub id
    tokenizer: str | None = None
    # vLLM's name: load no tokenizer. Prompts must be token ids; outputs carry token ids and empty
    # text; stop strings, bad_words and structured output (which need one) are refused.
    skip_tokenizer_init: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"
    # vLLM's spellings: a positive int, a human-readable count ("32k" = 32,000, "32K" = 32,768), or
    # "auto" / -1: the model's whole length if the GPU holds it, else the longest that fits
    # (parse_max_model_len; lamina.engine.memory_plan). None: the model's max_position_embeddings.
    max_model_len: int | str | None = None
    max_num_seqs: int | None = None
    # a caller's own default for max_num_seqs (lamina eval's concurrency): used when max_num_seqs is
    # None, and lowered like the engine's default when the GPU cannot hold it (lamina.engine.memory_plan)
    default_max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    seed: int | None = 0  # None: 0, as vLLM's V1 engine
    num_gpu_blocks_override: int | None = None  # vLLM's name: fixes the number of KV blocks
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # KV budget; default on CPU: 4 GiB
    ple_table_device: str = "auto"  # Qwen4-Exp N-gram PLE table: auto | gpu | cpu
    # vLLM's name: the dtype of the delta-net layers' recurrent state pool. "auto": the checkpoint's
    # `mamba_ssm_dtype` (Qwen3.5 ships float32), else mamba_cache_dtype, else float32, what
    # transformers keeps; bfloat16 / float16 halve the pool (more requests fit on a GPU) and round
    # the state at every step (ssm_state_dtype_choice).
    mamba_ssm_cache_dtype: str = "auto"
    # vLLM's name: the dtype of the whole Mamba-style cache. lamina takes it for the recurrent pool
    # when neither mamba_ssm_cache_dtype nor the checkpoint names one; the conv state always stays in
    # the model's dtype (it holds the layer's inputs, which that dtype represents exactly).
    mamba_cache_dtype: str = "auto"
    # vLLM's name: the attention layers' paged KV cache dtype (KV_CACHE_DTYPES; resolve_kv_cache_dtype)
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"  # auto | safetensors | dummy (seeded random weights, config only)
    # vLLM's name: values laid over config.json before anything reads it, nested dicts merged key
    # by key (e.g. {"text_config": {"rope_parameters": {"rope_type": "yarn", ...}}}, the Qwen cards'
    # way past the native context); every rank reads the same overridden config
    hf_overrides: dict | None = None
    # vLLM's name: None follows the checkpoint's quantization_config (a block FP8 checkpoint is
    # dequantized into `dtype` as it loads); "fp8" asks for such a checkpoint; "none" for an
    # unquantized one (lamina.quantization.check_quantization_option)
    quantization: str | None = None
    show_progress: bool = True
    enforce_eager: bool = False  # vLLM's name: no CUDA graphs (decode steps run eagerly)
    # CUDA graphs of short prefill and mixed steps too (lamina.worker.mixed_graphs; LAMINA_MIXED_GRAPHS sets
    # their size); vLLM's compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"} turns them off
    prefill_graphs: bool = True
    # vLLM's compilation_config keys (the same names): the step sizes, in tokens, that replay a CUDA graph.
    # A decode step of B requests of Q tokens (Q = 1, or K + 1 under MTP) replays the graph of the
    # smallest size S with S // Q >= B (a size past max_num_seqs requests serves max_num_seqs); larger
    # steps run eagerly. None: 1, 2, 4, 8, 16, 24, ... up to
    # max_num_seqs requests (lamina.worker.cuda_graphs.graph_sizes), or up to max_cudagraph_capture_size
    # tokens when only that is given, which also caps the prefill / mixed graphs' tokens.
    cudagraph_capture_sizes: tuple[int, ...] | list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    # vLLM's name: plan and launch step N+1 while step N runs (lamina.engine.async_scheduling).
    # None: on for a single-rank CUDA engine, with or without speculative decoding (MTP).
    async_scheduling: bool | None = None
    # parallelism (vLLM names)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    sequence_parallel_moe: str = "auto"
    pp_layer_partition: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    debug_layouts: bool = False  # activations carry their layout; modules check it (tests)
    fail_at_step: int | None = None  # tests only: rank `fail_rank` fails at this step ...
    fail_rank: int | None = None
    fail_mode: str = "exit"  # ... by exiting ("exit"), by raising ("raise") or by stalling past the timeout ("stall")
    # MTP speculative decoding (vLLM's name): {"method": "mtp", "num_speculative_tokens": K,
    # "policy": "fixed" | "auto"}; see lamina.engine.spec_decode
    speculative_config: dict | None = None
    # vLLM's name: where default sampling parameters come from: "auto" (the model's
    # generation_config.json), "vllm" (none) or a folder (lamina.engine.generation_defaults)
    generation_config: str = "auto"
    # vLLM's name: sampling defaults laid over (generation_config "auto" / a folder) or instead of ("vllm")
    # the generation config's, e.g. {"temperature": 0.5, "max_new_tokens": 256}
    override_generation_config: dict | None = None
    # vLLM's name and default: the most logprobs / prompt_logprobs a request may ask (-1: the
    # whole vocabulary, which a request asks with logprobs=-1)
    max_logprobs: int = 20
    # vLLM's name and default: what a sampled token's logprobs report: raw_logprobs, raw_logits,
    # processed_logprobs or processed_logits (LOGPROBS_MODES above; lamina.worker.sampler applies
    # them); prompt_logprobs are always raw logprobs
    logprobs_mode: str = "raw_logprobs"
    # vLLM's names, taken so that vLLM scripts run: trust_remote_code has no effect (lamina runs its
    # own model code; configs are read by transformers); enable_chunked_prefill False is refused (long prompts are always split into chunks);
    # disable_log_stats has no effect offline; tokenizer_mode "auto" / "hf" only (transformers'
    # AutoTokenizer); download_dir: where a MODEL given as a Hub id is fetched (default: the HF cache)
    trust_remote_code: bool = False
    # vLLM's name: keep prompt prefixes for later prompts (lamina/engine/prefix_cache.py); None = off
    # (vLLM's default is on). prefix_cache_min_tokens (lamina's): the shortest prefix kept (keeping a
    # prompt's prefix costs it a one-token step before its first token). prefix_cache_junctions
    # (lamina's; vLLM's shared-prefix checkpoints of hybrid models): a prompt whose first blocks an
    # earlier prompt had too ends a chunk where they part, once, and keeps that prefix
    enable_prefix_caching: bool | None = None
    prefix_cache_min_tokens: int = 256
    prefix_cache_junctions: bool = True
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = False
    tokenizer_mode: str = "auto"
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = 0

    def parallel_config(self):
        from lamina.parallel.config import ParallelConfig

        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size, enable_expert_parallel=self.enable_expert_parallel,
            sequence_parallel_moe=self.sequence_parallel_moe, pp_layer_partition=self.pp_layer_partition,
            nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
        )

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.ple_table_device not in ("auto", "gpu", "cpu"):
            raise ValueError(f"ple_table_device must be one of auto, gpu, cpu; got {self.ple_table_device!r}")
        for name in ("mamba_ssm_cache_dtype", "mamba_cache_dtype"):
            if getattr(self, name) not in MAMBA_SSM_CACHE_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}; "
                                 f"got {getattr(self, name)!r}")
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # raises on an unknown name
        parse_max_model_len(self.max_model_len)  # raises on a bad spelling
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict of generation-config fields (e.g. "
                             f"{{'temperature': 0.5}}), got {type(self.override_generation_config).__name__}: "
                             f"{self.override_generation_config!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json keys (nested dicts are merged), got "
                             f"{type(self.hf_overrides).__name__}: {self.hf_overrides!r}")
        for name in ("max_num_seqs", "default_max_num_seqs", "max_num_batched_tokens",
                     "num_gpu_blocks_override", "max_cudagraph_capture_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.cudagraph_capture_sizes = check_capture_sizes(self.cudagraph_capture_sizes, self.max_cudagraph_capture_size)
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= 0, or -1 (no limit below the vocabulary), "
                             f"got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode = {self.logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
        if not isinstance(self.prefix_cache_min_tokens, int) or self.prefix_cache_min_tokens < 1:
            raise ValueError(f"prefix_cache_min_tokens must be a positive integer, got {self.prefix_cache_min_tokens!r}")
        check_vllm_modes(self.enable_prefix_caching, self.enable_chunked_prefill, self.tokenizer_mode)
        from lamina.engine.spec_decode import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)  # raises on a malformed config


def check_capture_sizes(sizes, max_size) -> tuple[int, ...] | None:
    """vLLM's cudagraph_capture_sizes as a sorted tuple of distinct positive ints (None stays None);
    ValueError for anything else, or for a max_cudagraph_capture_size other than the largest size
    when both are given (vLLM's rule)."""
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"cudagraph_capture_sizes must be a list of positive token counts, got {sizes!r}")
    sizes = list(sizes)
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    if bad or not sizes:
        raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of positive token counts, got {sizes!r}"
                         + (f" ({bad[0]!r} is not one)" if bad else ""))
    sizes = tuple(sorted(set(sizes)))
    if max_size is not None and max_size != sizes[-1]:
        raise ValueError(f"max_cudagraph_capture_size = {max_size!r} differs from the largest of cudagraph_capture_sizes "
                         f"({sizes[-1]}): give one of them, or make them agree")
    return sizes


def _keyword(name: str, value) -> str:
    return name if value is None else f"{name}={value!r}"


def check_vllm_modes(enable_prefix_caching: bool | None, enable_chunked_prefill: bool | None, tokenizer_mode: str,
                     spell=_keyword) -> None:
    """vLLM options lamina takes but cannot honour in every setting, refused with what to do instead.
    `spell(name, value)`: how the caller's user wrote the option (a keyword argument, or a CLI flag)."""
    if enable_prefix_caching not in (None, True, False):
        raise ValueError(f"{spell('enable_prefix_caching', enable_prefix_caching)}: expected True or False")
    if enable_chunked_prefill is False:
        raise ValueError(f"{spell('enable_chunked_prefill', False)}: lamina always splits a prompt longer than "
                         f"{spell('max_num_batched_tokens', None)} into chunks; to prefill prompts whole, leave it out "
                         f"and set {spell('max_num_batched_tokens', None)} to at least {spell('max_model_len', None)}")
    if tokenizer_mode not in ("auto", "hf"):
        raise ValueError(f"{spell('tokenizer_mode', tokenizer_mode)}: lamina loads the checkpoint's tokenizer with "
                         "transformers' AutoTokenizer. Supported: auto (or hf)")


_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
AUTO = "auto"


def parse_max_model_len(value) -> int | str | None:
    """max_model_len as vLLM spells it: None (the model's own), a positive int, "auto" or -1 (AUTO:
    the longest the memory holds, up to the model's own), or a human-readable count with a decimal
    (k, m, g) or binary (K, M, G) multiplier: "32k" = 32,000, "32K" = 32,768, "25.6k" = 25,600
    (decimals only with k, m, g, and only where the count comes out whole)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"max_model_len must be a positive integer, 'auto' or -1, got {value!r}")
    if isinstance(value, int):
        if value == -1:
            return AUTO
        if value > 0:
            return value
        raise ValueError(f"max_model_len must be a positive integer, 'auto' or -1, got {value}")
    if not isinstance(value, str):
        raise ValueError(f"max_model_len must be a positive integer, 'auto' or -1, got {value!r}")
    text = value.strip()
    if text.lower() == AUTO or text == "-1":
        return AUTO
    suffix = text[-1:] if text[-1:] in _COUNT_SUFFIXES else ""
    number = text[: len(text) - len(suffix)]
    # digits with at most one decimal point, and that only before a decimal multiplier (as vLLM parses)
    plain = number.replace(".", "", 1).isdigit() and ("." not in number or suffix in ("k", "m", "g"))
    count = Decimal(number) * _COUNT_SUFFIXES.get(suffix, 1) if plain else Decimal(0)
    if count <= 0 or count != count.to_integral_value():
        raise ValueError(f"max_model_len {value!r} is not a positive token count; use an integer, a count such as "
                         "32k (32,000) or 32K (32,768), or auto (the longest the memory holds)")
    return int(count)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not valid; use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if isinstance(config_dtype, torch.dtype) and config_dtype in (torch.bfloat16, torch.float16):
            return config_dtype
        if isinstance(config_dtype, str) and config_dtype in ("bfloat16", "float16"):
            return _DTYPES[config_dtype]
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(option: str, model_dtype: torch.dtype) -> torch.dtype:
    """The paged KV cache's dtype: the model's for "auto", else the one `option` names (KV_CACHE_DTYPES)."""
    if option not in KV_CACHE_DTYPES + KV_CACHE_DTYPE_ALIASES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {option!r}")
    if option == "auto":
        return model_dtype
    return _KV_CACHE_DTYPES.get(option) or _DTYPES[option]


def resolve_ssm_state_dtype(option: str, hf_config, cache_option: str = "auto") -> torch.dtype:
    """The recurrent state pool's dtype (`ssm_state_dtype_choice`)."""
    return ssm_state_dtype_choice(option, hf_config, cache_option)[0]


def ssm_state_dtype_choice(option: str, hf_config, cache_option: str = "auto") -> tuple[torch.dtype, str]:
    """The recurrent state pool's dtype and where it came from, first that applies: an explicit
    `mamba_ssm_cache_dtype` (`option`); the checkpoint's `mamba_ssm_dtype` (top level or
    text_config; Qwen3.5 ships float32), which vLLM's "auto" also reads; an explicit
    `mamba_cache_dtype` (`cache_option`); float32, what transformers keeps."""
    for name, value in (("mamba_ssm_cache_dtype", option), ("mamba_cache_dtype", cache_option)):
        if value not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"{name} must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}; got {value!r}")
    if option != "auto":
        return _DTYPES[option], f"mamba_ssm_cache_dtype = {option}"
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        declared = getattr(config, "mamba_ssm_dtype", None) if config is not None else None
        if declared is None:
            continue
        if isinstance(declared, torch.dtype):
            declared = str(declared).removeprefix("torch.")
        if declared not in _DTYPES:
            raise ValueError(f"config.json's mamba_ssm_dtype {declared!r} is not a dtype lamina keeps states in; "
                             f"pass mamba_ssm_cache_dtype (one of {', '.join(MAMBA_SSM_CACHE_DTYPES[1:])})")
        return _DTYPES[declared], f"the checkpoint's mamba_ssm_dtype = {declared}"
    if cache_option != "auto":
        return _DTYPES[cache_option], f"mamba_cache_dtype = {cache_option}"
    return torch.float32, "float32, the default"
