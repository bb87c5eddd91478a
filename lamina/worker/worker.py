"""A rank's process: set up torch.distributed, build this rank's model stage, then serve steps.

Rank 0 receives commands from the engine over a pipe and broadcasts them on the control group,
so every rank of every replica gets the same step plans (ranks on other nodes included). Each
rank derives its inputs from its replica's plan; only activations cross pipeline boundaries.
Sampled tokens come back from each replica's last-stage TP-rank-0 through a gather to rank 0.
While the engine sends nothing (an idle server), rank 0 broadcasts a no-op command every sixth of
the control group's timeout (`WorkerSpec.dist_timeout_s`, 120 s by default): the other ranks wait
for commands inside a control-group broadcast, which fails after that timeout (every multi-rank
engine went down after two idle minutes before).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

import torch

from lamina.parallel import distributed as pdist
from lamina.parallel.plan import ParallelPlan
from lamina.step_plan import StepPlan
from lamina.worker.cuda_graphs import replay_size
from lamina.worker.rpc import call_reporting
from lamina.worker.sampling_rng import seed_unseeded_stream

IDLE = ("idle",)  # rank 0's no-op command while the engine is idle


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its part (picklable)."""

    model_path: str
    hf_overrides: dict | None  # laid over config.json (EngineArgs.hf_overrides)
    dtype: torch.dtype
    ssm_state_dtype: torch.dtype  # the recurrent state pool's (EngineSetup.ssm_state_dtype)
    kv_cache_dtype: torch.dtype  # the paged KV cache's (EngineSetup.kv_cache_dtype)
    device_type: str  # cpu | cuda
    plan: ParallelPlan
    master_addr: str
    master_port: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    load_format: str = "auto"
    seed: int = 0
    model_options: dict | None = None
    debug_layouts: bool = False
    gpu_memory_utilization: float = 0.9
    fail_at_step: int | None = None  # tests: rank `fail_rank` fails at this step
    fail_rank: int | None = None
    fail_mode: str = "exit"  # "exit": the process dies; "raise": the step raises; "stall": twice the timeout
    logprobs_mode: str = "raw_logprobs"  # EngineArgs.logprobs_mode
    dist_timeout_s: float = pdist.DEFAULT_TIMEOUT_S  # rendezvous and control group (lamina.parallel.distributed.timeout_from_env)


def _stage_step(spec: WorkerSpec, rank: int, runner, plans: list[StepPlan]):
    me = spec.plan.ranks[rank]
    plan = plans[me.dp]
    runner.forget_finished(plan)
    runner.commit_spec_states(plan)  # speculative decoding: roll back to the accepted tokens
    runner.apply_cache_copies(plan)  # prompt sharing: forked requests start from their source's state
    if plan.is_empty and (not spec.plan.ep_enabled or all(p.is_empty for p in plans)):
        # Without EP replicas need not step together; with EP an all-empty step (a bookkeeping
        # flush after aborts) has no MoE collective to join either.
        return None
    if runner.spec is None:
        # EP gathers every replica's MoE rows: replicas replay one size in lockstep, or none does
        lockstep = spec.plan.ep_enabled and spec.plan.dp > 1
        size = replay_size(runner.decode_graphs, plans, me.dp, lockstep)
        if size is not None:
            return _replay_step(spec, me, runner, plan, size)
    elif runner.verify_graphs is not None and (queries := runner.verify_graphs.queries_for(plan.chunks)) is not None:
        # MTP in one stage, without EP: the target's step from this rank's verification
        # graph, then verification and drafting as eagerly (every TP rank; rank 0 reports)
        sampled = runner.replay_verify(plan, queries)
        return (me.dp, sampled) if me.tp == 0 else None
    model = runner.model
    rows = plan.num_tokens
    if spec.plan.sp:
        rows = -(-rows // spec.plan.tp)
    hidden = None
    if me.pp > 0 and rows > 0:
        src = spec.plan.rank_of(me.dp, me.pp - 1, me.tp)
        hidden = pdist.recv_tensor((rows, model.stream_width()), model.dtype, runner.device, src)
    elif me.pp > 0:
        hidden = torch.zeros((0, model.stream_width()), dtype=model.dtype, device=runner.device)
    out, inputs = runner.forward_stage(plan, hidden)
    if not me.has_lm_head:
        if rows > 0:
            pdist.send_tensor(out, spec.plan.rank_of(me.dp, me.pp + 1, me.tp))
        return None
    if runner.spec is not None:
        sampled = runner.verify_and_propose(plan, out, inputs)  # also drafts; rank 0 of the TP group reports
    else:
        sampled = runner.logits_and_sample(plan, out, inputs.logits_rows, sample=me.tp == 0)
    return (me.dp, sampled) if me.tp == 0 else None


def _replay_step(spec: WorkerSpec, me, runner, plan: StepPlan, size: int):
    """A plain decode step from this rank's captured graph of `size` rows (TP / PP / DP / EP):
    every rank replays its graph, whose collectives meet the other ranks' as the eager forward's
    would; a stage after the first takes the previous stage's stream rows first, a stage before
    the last sends its own on; TP rank 0 of the last stage samples. Under EP a replica with no
    requests replays padding rows only, to join the MoE's collectives."""
    model = runner.model
    num_reqs = len(plan.chunks)
    stream_in = None
    if me.pp > 0 and num_reqs:
        src = spec.plan.rank_of(me.dp, me.pp - 1, me.tp)
        stream_in = pdist.recv_tensor((num_reqs, model.stream_width()), model.dtype, runner.device, src)
    out = runner.replay_decode(plan, stream_in, size)  # [B, vocab] logits, or [B, W] stream before the last stage
    if not me.has_lm_head:
        if num_reqs:
            pdist.send_tensor(out, spec.plan.rank_of(me.dp, me.pp + 1, me.tp))
        return None
    if me.tp != 0:
        return None
    return (me.dp, runner.sample(out, plan.chunks) if num_reqs else {})


def _seed_replica_stream(spec: WorkerSpec, replica: int, device: torch.device) -> None:
    """The noise of unseeded requests (lamina.worker.sampling_rng): one stream per data-parallel
    replica (the same seed on every replica gave the same "random" text to the same prompt on each of
    them); replica 0 keeps the engine's seed, so one replica draws what a single-rank engine does."""
    seed = spec.seed if replica == 0 else (spec.seed * 1_000_003 + replica) & 0x7FFF_FFFF_FFFF_FFFF
    seed_unseeded_stream(seed, device)


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """Entry point of a rank's process. `conn`: a pipe to the local launcher/engine."""
    try:
        from lamina.worker.model_loader import build_model, read_model_config
        from lamina.worker.model_runner import ModelRunner

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, spec.plan.world_size)))
        me = spec.plan.ranks[rank]
        if spec.device_type == "cuda":
            torch.cuda.set_device(me.local_rank)
            device = torch.device("cuda", me.local_rank)
        else:
            device = torch.device("cpu")
        groups = pdist.init_rank(
            spec.plan, rank, master_addr=spec.master_addr, master_port=spec.master_port, device=device,
            debug_layouts=spec.debug_layouts, timeout_s=spec.dist_timeout_s,
        )
        torch.manual_seed(spec.seed)
        hf_config = read_model_config(spec.model_path, spec.hf_overrides)
        model, _, _ = build_model(
            spec.model_path, hf_config, groups.ctx, dtype=spec.dtype, device=device, progress=False,
            layer_range=me.layer_range, model_options=spec.model_options, load_format=spec.load_format, seed=spec.seed,
        )
        _seed_replica_stream(spec, groups.ctx.dp.rank, device)
        runner = ModelRunner(model, device=device, eos_token_ids=spec.eos_token_ids, vocab_size=spec.vocab_size,
                             ssm_state_dtype=spec.ssm_state_dtype, kv_cache_dtype=spec.kv_cache_dtype,
                             logprobs_mode=spec.logprobs_mode)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        info = pdist.gather_objects({"rank": rank, "free_bytes": free}, groups)
        if rank == 0:
            conn.send(("ready", info))
        step = 0
        idle_ping_s = spec.dist_timeout_s / 6
        while True:
            command = (conn.recv() if conn.poll(idle_ping_s) else IDLE) if rank == 0 else None
            command = pdist.broadcast_object(command, groups)
            kind = command[0]
            if kind == "idle":
                continue
            if kind == "shutdown":
                break
            if kind == "bytes_per_block":
                per_rank = pdist.gather_objects(runner.paged_cache_bytes_per_block(command[1]), groups)
                if rank == 0:
                    conn.send(("bytes_per_block", max(per_rank)))
            elif kind == "state_bytes_per_slot":
                per_rank = pdist.gather_objects(runner.state_bytes_per_slot(), groups)
                if rank == 0:
                    conn.send(("state_bytes_per_slot", max(per_rank)))
            elif kind == "allocate":
                _, num_blocks, block_size, num_slots = command
                runner.allocate_caches(num_blocks, block_size, num_slots)
                pdist.gather_objects(None, groups)
                if rank == 0:
                    conn.send(("allocated", None))
            elif kind == "reseed":  # after the engine's warm-up (its sampler draws), as a single-rank engine does
                _seed_replica_stream(spec, groups.ctx.dp.rank, device)
                pdist.gather_objects(None, groups)
                if rank == 0:
                    conn.send(("reseeded", None))
            elif kind == "capture":  # decode graphs on every rank, in step with the others (lamina.worker.cuda_graphs)
                _, max_batch, max_model_len, num_speculative_tokens, static_off_cuda, sizes, max_size = command
                # every rank or none: one that skipped while the others captured would leave their
                # collectives waiting (e.g. Qwen4-Exp's PLE table on the host of one rank only, `auto`)
                own = runner.why_no_graphs(static_off_cuda)
                reasons = pdist.gather_objects(own, groups)
                blockers = pdist.broadcast_object(
                    "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why) if rank == 0 else None, groups)
                if not blockers:
                    captured = runner.capture_decode_graphs(
                        max_batch, max_model_len, num_speculative_tokens=num_speculative_tokens,
                        static_off_cuda=static_off_cuda, capture_sizes=sizes, max_capture_size=max_size)
                else:
                    runner.decode_graphs = runner.verify_graphs = None
                    captured, runner.no_graphs_reason = False, own or f"not captured, as another rank cannot ({blockers})"
                per_rank = pdist.gather_objects((captured, runner.no_graphs_reason), groups)  # on rank 0
                every_rank = pdist.broadcast_object(all(ok for ok, _ in per_rank) if rank == 0 else None, groups)
                if not every_rank:
                    runner.decode_graphs = runner.verify_graphs = None  # all ranks replay, or none
                if rank == 0:
                    conn.send(("captured", per_rank))
            elif kind == "rpc":  # vLLM's collective_rpc: every rank, results (or failures) gathered on rank 0
                _, method, args, kwargs = command
                per_rank = pdist.gather_objects(call_reporting(runner, rank, method, args, kwargs), groups)
                if rank == 0:
                    conn.send(("rpc", per_rank))
            elif kind == "graph_replays":
                per_rank = pdist.gather_objects(runner.graph_replays, groups)
                if rank == 0:
                    conn.send(("graph_replays", per_rank))
            elif kind == "step":
                step += 1
                if spec.fail_at_step is not None and step == spec.fail_at_step and rank == spec.fail_rank:
                    if spec.fail_mode == "stall":  # its peers time out waiting for it
                        time.sleep(2 * spec.dist_timeout_s)
                    elif spec.fail_mode == "raise":
                        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                    else:
                        os._exit(17)  # tests: a rank dies mid-generation
                result = _stage_step(spec, rank, runner, command[1])
                results = pdist.gather_objects(result, groups)
                if rank == 0:
                    merged = [dict() for _ in range(spec.plan.dp)]
                    for r in results:
                        if r is not None:
                            merged[r[0]].update(r[1])
                    conn.send(("result", merged))
        # graphs with captured NCCL kernels go before the communicators they launch on
        runner.decode_graphs = runner.verify_graphs = runner.mixed_graphs = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        pdist.shutdown()
        conn.send(("bye", rank))
    except BaseException as e:  # report, then die: the engine names this rank
        try:
            conn.send(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
