"""Quick eval of a demo checkpoint on a GPU: accuracy, MTP K=2 acceptance, plain vs MTP texts.

    python3 benchmarks/device_eval_demo.py lamina/demo_model OUT.json

What produced benchmarks/results/demo_model_eval_h200_bf16.json right after training, before
`lamina eval demo` existed on the device; `lamina eval demo --json` reports the same figures now.
"""
import json, sys, time
from lamina import LLM, SamplingParams
path, out = sys.argv[1], sys.argv[2]
items = [json.loads(l) for l in open(f"{path}/eval.jsonl")]
res = {}
for name, spec in (("plain", None), ("mtp2", {"method": "mtp", "num_speculative_tokens": 2})):
    llm = LLM(path, dtype="bfloat16", max_num_seqs=64, speculative_config=spec)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": it["prompt"]}] for it in items],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    dt = time.perf_counter() - t0
    texts = [o.outputs[0].text for o in outs]
    ok = [t.strip() == it["answer"] for t, it in zip(texts, items)]
    per = {}
    for it, k in zip(items, ok): per.setdefault(it["task"], []).append(k)
    m = getattr(llm.llm_engine, "spec_decode_metrics", None) if hasattr(llm, "llm_engine") else None
    res[name] = dict(accuracy=sum(ok)/len(ok), per_task={k: sum(v)/len(v) for k, v in per.items()}, seconds=dt,
                     out_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                     spec=(m.as_dict() if m is not None and hasattr(m, "as_dict") else str(m)),
                     wrong=[(it["prompt"][:80], it["answer"], t) for it, t, k in zip(items, texts, ok) if not k][:15])
    res[name + "_texts"] = texts
    print(name, json.dumps({k: v for k, v in res[name].items() if k != "wrong"}), flush=True)
    llm.shutdown()
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res["plain"]["wrong"], indent=0))
print("identical plain vs mtp2:", res["plain_texts"] == res["mtp2_texts"])
