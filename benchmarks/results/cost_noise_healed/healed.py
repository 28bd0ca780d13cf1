"""One-off (2026-11-29): what the next process gains once a run has cached the verification cost
as its steps corrected it (``cost_cache.keep_healed``). From the repository root:

    PYTHONPATH=. flock /tmp/rest-bench.lock .venv/bin/python benchmarks/results/cost_noise_healed/healed.py 10

The busy and quiet tables of cost_noise run 8 (results/cost_noise_zen3_8.json, as loaded) are
rebuilt for this model. First run: the busy table's drafter on HumanEval prompts 0..N-1; its
``healed()`` table is what its close would cache. Next process: on prompts N..2N-1 (never seen by
the first run), plain first, then drafters from the quiet table, the busy table again, and the
healed one, their order rotated prompt by prompt. Writes healed.json beside itself (the committed
one was written when the tables were described by sizes, tree_ms, transposed and unconfirmed only:
cost_noise's ``describe`` adds chain_ms and shape_problems).
"""

import json
import statistics
import sys
from pathlib import Path

from benchmarks.cost_noise import describe
from benchmarks.harness.report import REPO
from benchmarks.harness.sets import humaneval_inputs
from rest_spec.common.tokenizer import load_tokenizer
from rest_spec.common.types import DraftConfig
from rest_spec.drafter.core.adaptive import AdaptiveDrafter
from rest_spec.drafter.core.cost import VerifyCost
from rest_spec.drafter.core.local import LocalDrafter
from rest_spec.drafter.hf.generate import generate
from rest_spec.drafter.hf.measure import DEFAULT_CONTEXT_LENGTH, cost_key
from rest_spec.drafter.hf.model import load_model

HERE = Path(__file__).parent
count = int(sys.argv[1]) if len(sys.argv) > 1 else 10
model, tokenizer = load_model(None), load_tokenizer(None)
run8 = json.loads((HERE.parent / "cost_noise_zen3_8.json").read_text())["tables"]


def rebuilt(name: str) -> VerifyCost:
    t = run8[name]["loaded"]["table"]
    return VerifyCost(
        cost_key(model), DEFAULT_CONTEXT_LENGTH, tuple(t["sizes"]), tuple(ms / 1e3 for ms in t["tree_ms"]),
        tuple(ms / 1e3 for ms in t["chain_ms"]), tuple(t["transposed"]), tuple(t["unconfirmed"]),
    )  # fmt: skip


config, index = DraftConfig(), REPO / "indexes" / "python-stdlib"
prompts = humaneval_inputs(tokenizer, 2 * count)
tables = {"quiet": rebuilt("quiet"), "busy": rebuilt("busy")}
with LocalDrafter.open(index) as base:
    first = AdaptiveDrafter(base, cost=tables["busy"], config=config)
    generate(model, prompts[0][:32], first, max_new_tokens=8)  # compiled kernels, allocator
    for ids in prompts[:count]:
        generate(model, ids, first, max_new_tokens=128, config=config)
    tables["busy_healed"] = first.cost.healed() or tables["busy"]
names = tuple(tables)
rows = {name: [] for name in names}
with LocalDrafter.open(index) as a, LocalDrafter.open(index) as b, LocalDrafter.open(index) as c:
    drafters = {name: AdaptiveDrafter(src, cost=tables[name], config=config) for name, src in zip(names, (a, b, c))}
    for i, ids in enumerate(prompts[count:]):
        plain = generate(model, ids, None, max_new_tokens=128)
        for place, name in enumerate(names[i % 3 :] + names[: i % 3]):
            r = generate(model, ids, drafters[name], max_new_tokens=128, config=config)
            drafters[name].add_output(r.output_ids)
            rows[name].append({"prompt": count + i, "place": place, "tokens_per_second": r.tokens_per_second,
                               "seconds": r.seconds, "new_tokens": len(r.output_ids), "steps": r.steps,
                               "same_as_plain": r.output_ids == plain.output_ids})  # fmt: skip
        print(i, {name: round(rows[name][-1]["tokens_per_second"], 1) for name in names}, flush=True)


def overall(name):
    return sum(r["new_tokens"] for r in rows[name]) / sum(r["seconds"] for r in rows[name])


report = {"prompts": [count, 2 * count], "tables": {name: describe(t) for name, t in tables.items()}, "rows": rows}
for name in names:
    ratios = [r["tokens_per_second"] / q["tokens_per_second"] for r, q in zip(rows[name], rows["quiet"])]
    report[name] = {
        "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows[name]),
        "vs_quiet_per_prompt_median": statistics.median(ratios),
        "vs_quiet_overall": overall(name) / overall("quiet"),
        "steps": sum(r["steps"] for r in rows[name]),
        "check_steps": drafters[name].cost.check_steps,
        "same_as_plain": sum(r["same_as_plain"] for r in rows[name]),
    }
    print(name, report[name])
(HERE / "healed.json").write_text(json.dumps(report, indent=1))
