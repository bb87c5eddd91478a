"""The offline API: `LLM(...).generate(...)` / `.chat(...)`, as vLLM users know it."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

from tqdm.auto import tqdm

from lamina.config import EngineArgs
from lamina.engine.gc_heap import frozen_heap
from lamina.engine.llm_engine import LLMEngine
from lamina.inputs import PromptType
from lamina.entrypoints.chat_messages import normalize_messages
from lamina.outputs import RequestOutput
from lamina.sampling_params import RequestOutputKind, SamplingParams
from lamina.vllm_compat import COMPAT_OPTIONS, check_compat_options, cudagraph_overrides


class LLM:
    """Load a checkpoint and generate from it.

    `model=None` uses the built-in demo model (lamina/demo_model); a Hugging Face Hub id is fetched
    into the local cache (`revision`, `download_dir`). Keyword arguments are the fields of
    `lamina.config.EngineArgs`, with vLLM's names: `device`, `dtype`, `max_model_len`,
    `max_num_seqs`, `max_num_batched_tokens`, `block_size`, `seed`, `num_gpu_blocks_override`,
    `gpu_memory_utilization`, `kv_cache_memory_bytes`, `tokenizer`, `skip_tokenizer_init` (no
    tokenizer: token-id prompts only, outputs with token ids and empty text), `load_format`,
    `ple_table_device`, `mamba_ssm_cache_dtype` (the recurrent state pool's dtype: "auto", "float32",
    "bfloat16", "float16"), `mamba_cache_dtype` (vLLM's; the pool's dtype when neither that option
    nor the checkpoint names one), `kv_cache_dtype` (the attention layers' paged cache: "auto", the
    model's dtype, or "fp8" / "fp8_e4m3" / "fp8_e5m2", half of a 16-bit cache), `tensor_parallel_size`, `pipeline_parallel_size`, `data_parallel_size`,
    `enable_expert_parallel`, `sequence_parallel_moe`, `pp_layer_partition`, `nnodes`,
    `node_rank`, `master_addr`, `master_port`, `speculative_config` (MTP speculative decoding:
    `{"method": "mtp", "num_speculative_tokens": K}`, optionally `"policy": "auto"`),
    `generation_config`, `max_logprobs` (the most logprobs a request may ask a token, 20; -1: the
    vocabulary, which `SamplingParams(logprobs=-1)` asks); vLLM's `trust_remote_code`,
    `disable_log_stats` (no effect), `enable_chunked_prefill` (False refused) and `tokenizer_mode`
    ("auto" / "hf") are taken so vLLM scripts run; `enable_prefix_caching` keeps prompt prefixes for
    later prompts (off unless asked: lamina.engine.prefix_cache; a dict prompt's `cache_salt` keeps
    requests with different salts apart); also taken are
    vLLM's options for what lamina does not have (`swap_space`, `compilation_config`, `enable_lora`,
    ...: lamina.vllm_compat), where they ask for nothing lamina lacks; of `compilation_config` its
    `cudagraph_mode` is honoured (NONE: `enforce_eager`; FULL_DECODE_ONLY: `prefill_graphs=False`), and
    its `cudagraph_capture_sizes` / `max_cudagraph_capture_size` (EngineArgs fields of the same names);
    `optimization_level=0` runs eagerly too (vLLM's cudagraph_mode NONE there).
    """

    def __init__(self, model: str | None = None, **kwargs):
        fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
        unknown = sorted(set(kwargs) - fields - set(COMPAT_OPTIONS))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; valid: {', '.join(sorted(fields))}, and "
                            f"vLLM's {', '.join(sorted(COMPAT_OPTIONS))} (lamina.vllm_compat)")
        compat = {name: kwargs.pop(name) for name in list(kwargs) if name in COMPAT_OPTIONS}
        check_compat_options(compat)
        # vLLM's cudagraph_mode, capture sizes and optimization_level 0
        kwargs.update(cudagraph_overrides(compat.get("compilation_config"), compat.get("optimization_level")))
        args = EngineArgs(model=None if model is None else str(model), **kwargs)
        self.llm_engine: LLMEngine | None = LLMEngine(args)

    @property
    def engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self.llm_engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def beam_search(self, prompts, params, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None):
        """vLLM's beam search (lamina.beam_search): `prompts` a list of TokensPrompt / TextPrompt dicts (or
        strings), `params` a BeamSearchParams; returns a BeamSearchOutput per prompt, its beams best
        first. Every step runs each live beam's whole sequence again, from a kept prefix where
        `enable_prefix_caching` is on (else in full: for short outputs). `lora_request` is refused (no LoRA adapters); all beams of a step run as one batch
        (`concurrency_limit`, vLLM's bound on prompts per batch, has no effect)."""
        from lamina.beam_search import BeamSearchParams, beam_search

        _refuse_unsupported(lora_request=lora_request)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return beam_search(self, list(prompts), params)

    def reset_prefix_cache(self, device=None) -> bool:
        """vLLM's: drop the kept prompt prefixes (RL loops call it after a weight update); True when
        none is left (always without prefix caching)."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list:
        """vLLM's: the engine-wide `vllm:*` metrics now, as `lamina.engine.metrics_reader`'s Counter,
        Gauge, Vector and Histogram (vLLM's `vllm.v1.metrics.reader` types: `name`, `labels`, and
        `value`, `values` or `count` / `sum` / `buckets`): request and token counters, cache usage,
        preemptions, prefix-cache queries and hits, tokens a step, speculative decoding's drafts and
        acceptances. vLLM asks for `disable_log_stats=False`; lamina always counts. The per-request
        latency histograms are the server's (`/metrics`)."""
        from lamina.engine.metrics_reader import engine_metrics

        engine = self.engine
        name = engine.args.model or str(engine.model_path)  # vLLM's label: the model as given
        return engine_metrics(engine, name, num_running=engine.num_running,
                              num_waiting=engine.num_waiting, cache_usage=engine.cache_usage())

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's: call `method` on every rank and return their results in rank order. `method` is
        the name of a method of the rank's ModelRunner (lamina's per-rank object, vLLM's worker), or
        a callable given the runner first, `method(runner, *args, **kwargs)` (under tensor, pipeline
        or data parallelism the ranks are processes: it must pickle, a module-level function). A
        rank's failure raises here; the engine keeps serving. `timeout` (vLLM's) is taken and not
        enforced."""
        return self.engine.collective_rpc(method, args, kwargs)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (free the GPU's weights / KV cache between uses): lamina has none."""
        raise NotImplementedError("lamina has no sleep mode (vLLM's enable_sleep_mode): shut the LLM down "
                                  "(llm.shutdown()) to free its memory, and build a new one")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's sleep mode: lamina has none (see `sleep`)."""
        raise NotImplementedError("lamina has no sleep mode (vLLM's enable_sleep_mode); nothing to wake up")

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request=None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, `{"prompt_token_ids": [...]}` / `{"prompt": ...}`, or a
        list of token ids); outputs keep prompt order. `lora_request` and a nonzero `priority` (vLLM's)
        are refused: lamina has no LoRA adapters and schedules first come, first served."""
        _refuse_unsupported(lora_request=lora_request, priority=priority)
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, numbers.Integral) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:  # the generation config's defaults, as vLLM
            params_list = [self.get_default_sampling_params() for _ in prompts]
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts: give one, or one per prompt"
                )
        return self._run(prompts, params_list, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters a request without any gets: the model's generation config's
        temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens), unless
        the engine was built with generation_config="vllm" (vLLM's method of the same name)."""
        return self.engine.default_sampling_params()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate,
        as vLLM's LLM.chat: OpenAI-format messages (text content parts, tool calls with JSON-string
        arguments; lamina.entrypoints.chat_messages), `tools` (OpenAI's function definitions) passed
        to the template, `continue_final_message` to continue a final assistant message instead of
        starting a new one (then `add_generation_prompt` must be False). Each output's `prompt` is
        the rendered prompt text. The parameters come in vLLM's order; `chat_template_content_format`
        "auto" / "string" (lamina hands the template text content as strings), and `lora_request` /
        `mm_processor_kwargs` are refused (no LoRA adapters, no multimodal encoder)."""
        _refuse_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format = {chat_template_content_format!r}: lamina gives the "
                             "template each message's text content as a string; valid: 'auto', 'string'")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = dict(add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                       chat_template_kwargs=chat_template_kwargs, tools=tools,
                       continue_final_message=continue_final_message)
        # rendered once; the engine tokenizes the text as apply_chat_template(tokenize=True) would
        # (no special tokens added)
        prompts = [{"prompt": self.chat_prompt(c, **options)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, conversation: list[dict], **options) -> str:
        """The prompt text `chat` renders for one conversation (same options as `chat_token_ids`)."""
        return self._render(conversation, tokenize=False, **options)

    def chat_token_ids(
        self,
        conversation: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The prompt token ids `chat` sends for one conversation (the tokenizer's chat template applied)."""
        ids = self._render(conversation, tokenize=True, add_generation_prompt=add_generation_prompt,
                           chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, tools=tools,
                           continue_final_message=continue_final_message)
        if hasattr(ids, "keys") and "input_ids" in ids:  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _render(self, conversation: list[dict], *, tokenize: bool, add_generation_prompt: bool,
                chat_template: str | None, chat_template_kwargs: dict | None, tools: list[dict] | None,
                continue_final_message: bool):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has no tokenizer")
        if not conversation:
            raise ValueError("a conversation must have at least one message")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False (it continues the "
                             "final message instead of starting a new one)")
        messages = normalize_messages(conversation)
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError(f"continue_final_message needs a final assistant message; the last one's role is "
                             f"{messages[-1].get('role')!r}")
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )

    def _run(self, prompts: list, params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        # Only finished outputs are returned: the engine builds no output for earlier steps
        # (vLLM's LLM does the same). The caller's objects are not changed.
        final: dict[int, SamplingParams] = {}
        for params in params_list:
            if isinstance(params, SamplingParams) and id(params) not in final:
                final[id(params)] = params.clone()
                final[id(params)].output_kind = RequestOutputKind.FINAL_ONLY
        params_list = [final.get(id(params), params) for params in params_list]
        # Validate every prompt before queueing any, so a bad one leaves nothing half-submitted.
        prepared = []
        for prompt, params in zip(prompts, params_list):
            text, token_ids = engine.prepare_request_prompt(prompt, params.truncate_prompt_tokens)
            engine.validate_request(token_ids, params)
            salt = engine.prompt_cache_salt(prompt)
            prepared.append(({"prompt": text, "prompt_token_ids": token_ids, **({"cache_salt": salt} if salt else {})},
                             params))
        ids = [engine.add_request(p, params) for p, params in prepared]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        remaining = len(ids)
        try:
            with frozen_heap():  # collections skip the loaded engine's objects (lamina.engine.gc_heap)
                while remaining and engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished and output.request_id in order:
                            remaining -= results[order[output.request_id]] is None
                            results[order[output.request_id]] = output
                            bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        if remaining:  # the engine ran out of work without these outputs: something else stepped it
            missing = [rid for rid, out in zip(ids, results) if out is None]
            raise RuntimeError(
                f"{remaining} of {len(ids)} requests finished without their output reaching LLM.generate "
                f"(e.g. {missing[:3]}): another caller stepped the same engine (a server or a thread on "
                "LLM.llm_engine); an engine serves one caller at a time"
            )
        return results  # type: ignore[return-value]

    # ---- lifetime ------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self.llm_engine is not None:
            self.llm_engine.shutdown()
            self.llm_engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _refuse_unsupported(*, lora_request=None, priority=None, mm_processor_kwargs=None) -> None:
    """vLLM's generate / chat arguments that lamina cannot honour, refused when they ask for something."""
    if lora_request is not None:
        raise ValueError("lora_request: lamina does not serve LoRA adapters; merge the adapter into the checkpoint")
    if priority is not None and any(priority):
        raise ValueError("priority: lamina schedules requests first come, first served (vLLM's default 'fcfs' "
                         "policy), so every priority must be 0")
    if mm_processor_kwargs is not None:
        raise ValueError("mm_processor_kwargs: lamina serves the text model of a checkpoint (no multimodal processor)")
