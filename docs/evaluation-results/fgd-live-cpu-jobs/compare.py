"""The paired table of docs/evaluation.md ("The live scheduler with CPU-only jobs"): python compare.py (from the repo)."""
import json
import math
from pathlib import Path

R = Path(__file__).resolve().parent.parent
ROWS = {"default": {"fgd": R / "fgd-live-vs-copy/old-copy/openb__default__fgd.json"},
        "gpushare40": {"fgd": R / "fgd-live-vs-copy/old-copy/openb__gpushare40__fgd.json"},
        "multigpu20": {"fgd": R / "fgd-live-cpu-jobs/openb__multigpu20__fgd.json"}}


def per_seed(path):
    d = json.loads(Path(path).read_text())
    return {s["seed"]: (s["allocation_pct_at_100"], s["allocation_pct_at_130"]) for s in d["per_seed"]}


print("| workload | live (this round) @100 / @130 | live before @100 / @130 | FGD @100 / @130 "
      "| live − FGD @100 / @130 (SE @130; seeds won @130) |")
print("|---|---|---|---|---|")
for w, paths in ROWS.items():
    new = per_seed(R / f"fgd-live-cpu-jobs/openb__{w}__gpupool.json")
    old = per_seed(R / f"fgd-live-vs-copy/new-live/openb__{w}__gpupool.json")
    fgd = per_seed(paths["fgd"])
    seeds = sorted(new)
    assert seeds == sorted(fgd), (w, seeds, sorted(fgd))
    mean = lambda d, i: sum(d[s][i] for s in seeds) / len(seeds)
    diffs = [new[s][1] - fgd[s][1] for s in seeds]
    m = sum(diffs) / len(diffs)
    se = math.sqrt(sum((x - m) ** 2 for x in diffs) / (len(diffs) - 1) / len(diffs))
    won = sum(1 for x in diffs if x > 0)
    print(f"| {w} | {mean(new, 0):.2f} / {mean(new, 1):.2f} | {mean(old, 0):.2f} / {mean(old, 1):.2f} "
          f"| {mean(fgd, 0):.2f} / {mean(fgd, 1):.2f} | {mean(new, 0) - mean(fgd, 0):+.2f} / {m:+.2f} "
          f"(SE {se:.2f}; {won}/{len(seeds)}) |")
