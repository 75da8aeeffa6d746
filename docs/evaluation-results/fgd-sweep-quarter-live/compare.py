"""Live (this directory) against the copy (../fgd-sweep-quarter-oversub) and FGD, per cell at 130 %: the table of
docs/evaluation.md "Beyond one fleet, live". python compare.py"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
COPY = HERE.parent / "fgd-sweep-quarter-oversub"


def seeds(path):
    return {s["seed"]: s["allocation_pct_at_130"] for s in json.loads(path.read_text())["per_seed"]}


print("| fleet | workload | live @130 | copy @130 | FGD @130 | live − FGD (seeds won) | live − copy |")
print("|---|---|---:|---:|---:|---:|---:|")
for live_path in sorted(HERE.glob("*__gpupool.json")):
    fleet, workload, _ = live_path.stem.split("__")
    live, copy = seeds(live_path), seeds(COPY / live_path.name)
    fgd = seeds(HERE / f"{fleet}__{workload}__fgd.json")
    mean = lambda d: sum(d.values()) / len(d)
    won = sum(1 for s in live if live[s] > fgd[s])
    print(f"| {fleet} | {workload} | {mean(live):.2f} | {mean(copy):.2f} | {mean(fgd):.2f} | "
          f"{mean(live) - mean(fgd):+.2f} ({won}/10) | {mean(live) - mean(copy):+.2f} |")
