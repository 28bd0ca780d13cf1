"""One-off (2026-11-29): do three drafters from the SAME quiet table run alike in cost_noise's old
fixed order (plain, then A, B, C on every prompt)? From the repository root:

    PYTHONPATH=. flock /tmp/rest-bench.lock .venv/bin/python benchmarks/results/cost_noise_position/position.py 12

(add ``rotate`` to rotate A, B, C from prompt to prompt). Writes position_fixed.json beside itself.
"""

import contextlib
import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness.report import REPO
from benchmarks.harness.sets import humaneval_inputs
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.hf.measure import load_or_measure
from rest_spec.drafter.hf.model import load_model

count = int(sys.argv[1]) if len(sys.argv) > 1 else 10
rotate = len(sys.argv) > 2 and sys.argv[2] == "rotate"
model, tokenizer = load_model(None), load_tokenizer(None)
table = load_or_measure(model)
config = DraftConfig()
names = ("A", "B", "C")
prompts = humaneval_inputs(tokenizer, count)
rows = {name: [] for name in names}
with contextlib.ExitStack() as stack:
    drafters = {
        name: AdaptiveDrafter(
            stack.enter_context(LocalDrafter.open(REPO / "indexes/python-stdlib")), cost=table, config=config
        )
        for name in names
    }
    warm = prompts[0][:32]
    generate(model, warm, AdaptiveDrafter(drafters["A"].source, cost=table, config=config), max_new_tokens=8)
    generate(model, warm, None, max_new_tokens=8)
    for i, ids in enumerate(prompts):
        plain = generate(model, ids, None, max_new_tokens=128)
        order = names[i % 3 :] + names[: i % 3] if rotate else names
        for place, name in enumerate(order):
            result = generate(model, ids, drafters[name], max_new_tokens=128, config=config)
            drafters[name].add_output(result.output_ids)
            rows[name].append(
                {
                    "place": place,
                    "tps": result.tokens_per_second,
                    "tok": len(result.output_ids),
                    "s": result.seconds,
                    "steps": result.steps,
                    "same": result.output_ids == plain.output_ids,
                }
            )
        print(
            i, " ".join(f"{name} {rows[name][-1]['tps']:.1f}" for name in names), f"plain {plain.tokens_per_second:.1f}"
        )


def ms_per_step(rows: list[dict]) -> float:
    return 1e3 * sum(row["s"] for row in rows) / sum(row["steps"] for row in rows)


for name in names:
    own = rows[name]
    print(
        f"{name} median tps {statistics.median(row['tps'] for row in own):.2f}",
        f"overall {sum(row['tok'] for row in own) / sum(row['s'] for row in own):.2f}",
        f"steps {sum(row['steps'] for row in own)} ms/step {ms_per_step(own):.1f} same {sum(row['same'] for row in own)}",
    )
if rotate:
    for place in range(3):
        print(
            "place",
            place,
            f"ms/step {ms_per_step([row for name in names for row in rows[name] if row['place'] == place]):.1f}",
        )
json.dump(rows, open(Path(__file__).with_name(f"position_{'rot' if rotate else 'fixed'}.json"), "w"))
