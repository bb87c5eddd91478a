"""Diagnostic: first-token logprobs of single GPU (twice), TP2 and PP2 on the same random checkpoint."""
import json, random, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_checkpoint import write_checkpoint
from lamina import LLM, SamplingParams

path = write_checkpoint(Path(tempfile.mkdtemp()) / "c", 4)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(0, 240000) for _ in range(64 + 7 * i)]} for i in range(4)]
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
res = {}
for name, kw in (("single", {}), ("single2", {}), ("tp2", dict(tensor_parallel_size=2)), ("pp2", dict(pipeline_parallel_size=2)), ("single_fp32", dict(dtype="float32"))):
    kw = {"dtype": "bfloat16", **kw}
    with LLM(str(path), device="cuda", max_model_len=1024, max_num_seqs=4, show_progress=False, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        res[name] = [(o.outputs[0].token_ids, [sorted(d.items(), key=lambda kv: -kv[1])[:3] for d in o.outputs[0].logprobs[:2]]) for o in outs]
    print(name, json.dumps(res[name][0]), flush=True)
for name in res:
    print(name, [r[0] for r in res[name]])
