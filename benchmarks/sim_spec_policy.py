"""The MTP auto policy (lamina.engine.spec_policy) against fixed K, in simulation: step costs
measured on one H200 (docs/PERFORMANCE.md), each step's time drawn within +-15 % of them, and
every draft position accepted with probability `acc` (the next only when the previous was).

    python benchmarks/sim_spec_policy.py --out benchmarks/results/spec_policy_sim.json

Reports the auto policy's tokens per second as a fraction of the best fixed K's expected rate,
and the first 90 decisions (k per step).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina.engine.spec_decode import SpeculativeConfig  # noqa: E402
from lamina.engine.spec_policy import SpecDecodePolicy  # noqa: E402

# Median step seconds at k = 0..3 (bf16, mtp_cost_h200_40layers_bf16.json and mtp_cost_h200_8layers_bf16.json).
COSTS = {
    "40 layers, batch 1": (1, {0: 0.108, 1: 0.149, 2: 0.166, 3: 0.157}),
    "40 layers, batch 64": (64, {0: 0.114, 1: 0.240, 2: 0.174, 3: 0.219}),
    "8 layers, batch 64": (64, {0: 0.025, 1: 0.037, 2: 0.043, 3: 0.049}),
}


def simulate(cost: dict, acc: float, batch: int, steps: int, noise: float, rng: random.Random) -> tuple[str, float]:
    config = SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3, "policy": "auto"})
    policy = SpecDecodePolicy(config, num_hidden_layers=40, num_mtp_layers=1, device_type="cuda")
    previous, decisions, seconds, tokens = 0, [], 0.0, 0
    for _ in range(steps):
        k = policy.decide(batch)
        if previous:  # this step verifies the previous step's drafts
            verifications = []
            for _ in range(batch):
                accepted = 0
                while accepted < previous and rng.random() < acc:
                    accepted += 1
                verifications.append((previous, accepted))
                tokens += accepted
            policy.observe(verifications)
        tokens += batch
        t = cost[k] * rng.uniform(1 - noise, 1 + noise)
        if previous == k:
            policy.observe_step_time(batch, k, t)
        seconds += t
        decisions.append(k)
        previous = k
    return "".join(map(str, decisions)), tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    for acc in (0.0, 0.3, 0.5, 0.8, 0.9):
        for name, (batch, cost) in COSTS.items():
            decisions, rate = simulate(cost, acc, batch, args.steps, 0.15, rng)
            fixed = [batch * sum(acc**j for j in range(k + 1)) / cost[k] for k in range(4)]
            row = {"costs": name, "acceptance": acc, "auto_vs_best_fixed": rate / max(fixed),
                   "fixed_k0_vs_best_fixed": fixed[0] / max(fixed), "best_fixed_k": fixed.index(max(fixed)),
                   "first_decisions": decisions[:90]}
            print(json.dumps(row))
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
