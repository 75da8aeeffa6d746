"""Audit-replay throughput: the pure scheduler over its input log, and ledger rows into the embedded ClickHouse.

    .venv/bin/python -m bench.audit_replay [--events 1000000] [--nodes 500] [--rows 1000000] [--batch 50000]
                                           [--profile FILE] [--skip-insert]

1. Generates, in memory, a synthetic but valid `gpupool.scheduler-input` log: one `node.inventory` per node (8 cards,
   A100-80GB / H100-80GB alternating), tenant quotas (`quota.set`), then job requests arriving at a steady rate,
   `job.started` / `job.completed` for every placement (acting as the node agents: the command ids come from the
   scheduler's own `cmd.place` outputs, so a scheduler drives the generation) and a `scheduler.tick` every second
   of simulated time. Every record is built with the schemas' models and stored as `schemas.envelope.encode` bytes.
   Arrival rate is sized to keep the fleet about 70% busy, so most requests place at once and usage accrues.
2. (a) Pure part, what `audit replay` does per record: `decode` + `Scheduler.step` on a fresh Scheduler over all
   records; events/s and the output count (checked equal to the generator's, i.e. deterministic).
3. (b) Ledger rows: the job events and scheduler outputs of the run (job-requests, job-events, commands, ledger;
   re-identified copies when the run is shorter than --rows) are mapped with `streams.folds.rows.rows_for` exactly as the
   sink does, then inserted into chdb at a temp path in batches of --batch rows per table, with the sink's column
   lists and an insert_deduplication_token per batch. rows/s = rows inserted / insert wall time (rows_for time is
   reported separately).
4. Prints a table and one final JSON line (prefix `RESULT `).

The scheduler's per-cycle cost grows with the number of jobs it has ever seen (see the profile), so --events is
the knob: pass a smaller N when 1,000,000 takes too long on a small machine.
"""
from __future__ import annotations

import argparse
import cProfile
import heapq
import json
import pstats
import random
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

from agents.node.fleet import make_node
from agents.scheduler.core import Scheduler, replay as core_replay
from schemas.envelope import Envelope, decode, encode, envelope
from schemas.events import JobCompleted, JobRequested, JobStarted, QuotaSet, SchedulerTick, Tier
from schemas.routing import route
from streams.folds.rows import COLUMNS, TABLES, rows_for

MODELS = ("A100-80GB", "H100-80GB")
GPUS_PER_NODE = 8
TENANTS = tuple(f"tenant-{i}" for i in range(8))
PROJECTS = ("train", "eval", "serve")
# (compute_milli, gpu_memory_mib, weight): fractions of a card, whole cards, gangs
SHAPES = ((250, 8 * 1024, 3), (500, 16 * 1024, 3), (1000, 40 * 1024, 3), (2000, 80 * 1024, 2), (4000, 160 * 1024, 1))
T0 = 1_760_000_000_000  # an arbitrary fixed epoch ms: the log is the same on every run


def _tiers():
    return [t for t in Tier]


class Gen:
    """Acts as users, node agents and the ticker around a live Scheduler; records every input as encoded bytes."""

    def __init__(self, nodes: int, seed: int = 7):
        self.rng = random.Random(seed)
        self.sched = Scheduler()
        self.seqs: dict[str, int] = {}
        self.inputs: list[bytes] = []
        self.outputs = 0
        self.nodes = nodes
        self.now = T0
        self.running: list[tuple[int, int, str, str, str]] = []  # (end_ms, n, job, node, command_id)
        self.n = 0
        self.kept: list[Envelope] = []  # job events and outputs, for the row benchmark
        self.keep_limit = 0
        self.placed = 0
        self.completed = 0
        self.usage = 0

    def feed(self, payload, source: str) -> None:
        seq = self.seqs[source] = self.seqs.get(source, 0) + 1
        env = envelope(payload, source=source, seq=seq, time_ms=self.now)
        self.inputs.append(encode(env))
        if len(self.kept) < self.keep_limit and payload.kind.startswith("job."):
            self.kept.append(env)
        for out in self.sched.step(env):
            self.outputs += 1
            if len(self.kept) < self.keep_limit:
                self.kept.append(out)
            if out.kind == "cmd.place":
                p = out.payload
                self.placed += 1
                # the node agent starts it within 50 ms and it runs for duration_s
                start = self.now + self.rng.randint(5, 50)
                self.n += 1
                heapq.heappush(self.running, (start, self.n, "start", p.job_id, p.node, p.command_id,
                                              start + (p.duration_s or 1) * 1000))
            elif out.kind == "usage.accrued":
                self.usage += 1

    def run(self, target: int, keep: int) -> None:
        self.keep_limit = keep
        for i in range(self.nodes):
            name = f"node-{i:04d}"
            inv = make_node(name, MODELS[i % 2], GPUS_PER_NODE, rack=f"rack-{i // 20}", datacenter=f"dc-{i % 3}")
            self.feed(inv, f"{name}/inventory")
        capacity = self.nodes * GPUS_PER_NODE * 1000
        for t in TENANTS:  # quotas: a quarter of the fleet each (so some borrowing happens), 150% overcommit
            self.feed(QuotaSet(tenant=t, gpu_milli=capacity // 4, overcommit_pct=150), "cli/quota")
        shapes = [s for s in SHAPES for _ in range(s[2])]
        tiers = _tiers()
        mean_milli = sum(s[0] for s in shapes) / len(shapes)
        mean_dur_s = 60
        rate_per_s = 0.7 * capacity / (mean_milli * mean_dur_s)  # ~70% busy in steady state
        next_tick = self.now + 1000
        job_no = 0
        while len(self.inputs) < target:
            next_arrival = self.now + int(self.rng.expovariate(rate_per_s) * 1000) + 1
            # everything due before the next arrival: starts, completions, ticks, in time order
            while True:
                due = self.running[0][0] if self.running else None
                if due is not None and due <= next_arrival and due <= next_tick:
                    _, _, what, job, node, cmd, end = heapq.heappop(self.running)
                    self.now = max(self.now, due)
                    src = f"{node}/job/{job}"
                    if what == "start":
                        self.feed(JobStarted(job_id=job, node=node, command_id=cmd), src)
                        self.n += 1
                        heapq.heappush(self.running, (end, self.n, "end", job, node, cmd, end))
                    else:
                        self.feed(JobCompleted(job_id=job, node=node, command_id=cmd), src)
                        self.completed += 1
                elif next_tick <= next_arrival:
                    self.now = max(self.now, next_tick)
                    self.feed(SchedulerTick(now_ms=next_tick), "ticker")
                    next_tick += 1000
                else:
                    break
                if len(self.inputs) >= target:
                    return
            self.now = next_arrival
            job_no += 1
            compute, mem, _ = self.rng.choice(shapes)
            tier = tiers[0] if self.rng.random() < 0.6 else self.rng.choice(tiers)
            self.feed(JobRequested(job_id=f"j{job_no:07d}", tenant=self.rng.choice(TENANTS),
                                   project=self.rng.choice(PROJECTS), tier=tier, compute_milli=compute,
                                   gpu_memory_mib=mem, duration_s=self.rng.randint(10, 110)), "cli/requests")


def replay(inputs: list[bytes]) -> tuple[float, int]:
    """`core.replay` (the agent's rebuild and the audit run it) over the encoded inputs, configured as the generator's
    scheduler was."""
    outs = [0]
    t = time.perf_counter()
    core_replay(inputs, on_outputs=lambda _i, got: outs.__setitem__(0, outs[0] + len(got)))
    return time.perf_counter() - t, outs[0]


def ledger_stream(kept: list[Envelope], want: int) -> list[tuple[Envelope, str, int, int]]:
    """(envelope, topic, partition, offset) like the sink sees them; re-identified copies when `kept` is short."""
    out = []
    offsets: dict[tuple[str, int], int] = {}
    rnd = 0
    while len(out) < want and kept:
        for env in kept:
            if len(out) >= want:
                break
            if rnd:
                env = env.model_copy(update={"event_id": f"{env.event_id}#r{rnd}"})
            spec, key = route(env)
            part = zlib.crc32(key) % spec.partitions
            off = offsets.get((spec.name, part), 0)
            offsets[(spec.name, part)] = off + 1
            out.append((env, spec.name, part, off))
        rnd += 1
    return out


def insert_rows(stream, batch: int, path: Path) -> dict:
    from infra.clickhouse import connect

    client = connect(f"chdb://{path}")
    t = time.perf_counter()
    tables: dict[str, list] = {tb: [] for tb in COLUMNS}
    for env, topic, part, off in stream:
        for tb, rows in rows_for(env, topic, part, off).items():
            tables[tb].extend(rows)
    t_rows = time.perf_counter() - t
    total = sum(len(v) for v in tables.values())
    t = time.perf_counter()
    inserts = 0
    for tb, rows in tables.items():
        cols = list(COLUMNS[tb])
        for i in range(0, len(rows), batch):
            client.insert(TABLES[tb], rows[i:i + batch], column_names=cols,
                          settings={"insert_deduplication_token": f"{tb}/bench/0/{i}-{i + batch - 1}"})
            inserts += 1
    t_ins = time.perf_counter() - t
    counts = {tb: client.query(f"SELECT count() FROM {TABLES[tb]}").result_rows[0][0] for tb in COLUMNS}
    client.close()
    return {"events": len(stream), "rows": total, "per_table": {tb: len(v) for tb, v in tables.items()},
            "counted": counts, "inserts": inserts, "rows_for_s": t_rows, "insert_s": t_ins}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--rows", type=int, default=1_000_000, help="ledger/job events mapped and inserted")
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--profile", help="write a cProfile of the replay (a) here and print the top functions")
    ap.add_argument("--skip-insert", action="store_true")
    args = ap.parse_args(argv)

    t = time.perf_counter()
    gen = Gen(args.nodes)
    gen.run(args.events, keep=args.rows)
    t_gen = time.perf_counter() - t
    n = len(gen.inputs)
    print(f"generated {n} inputs in {t_gen:.1f} s (scheduler in the loop): {gen.placed} placed, "
          f"{gen.completed} completed, {gen.usage} usage.accrued, {gen.outputs} outputs, "
          f"{gen.sched.arrivals} jobs, sim time {(gen.now - T0) / 1000:.0f} s", file=sys.stderr)

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    t_replay, outs = replay(gen.inputs)
    if args.profile:
        prof.disable()
        prof.dump_stats(args.profile)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    assert outs == gen.outputs, f"replay produced {outs} outputs, the generator's scheduler {gen.outputs}"

    # decode alone, to split the pure part's cost
    t = time.perf_counter()
    for raw in gen.inputs:
        decode(raw)
    t_decode = time.perf_counter() - t

    ins = None
    if not args.skip_insert:
        stream = ledger_stream(gen.kept, args.rows)
        tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-ch-"))
        try:
            ins = insert_rows(stream, args.batch, tmp / "clickhouse")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    eps = n / t_replay
    table = [("inputs (scheduler-input records)", f"{n:,}"),
             ("nodes / jobs", f"{args.nodes} / {gen.sched.arrivals:,}"),
             ("outputs (replay == generator)", f"{outs:,}"),
             ("(a) decode + Scheduler.step", f"{t_replay:.2f} s  ->  {eps:,.0f} events/s"),
             ("    of which decode alone", f"{t_decode:.2f} s  ->  {n / t_decode:,.0f} events/s")]
    if ins:
        table += [("(b) ledger/job events -> rows_for", f"{ins['events']:,} -> {ins['rows']:,} rows in "
                                                         f"{ins['rows_for_s']:.2f} s"),
                  ("    insert into chdb", f"{ins['insert_s']:.2f} s ({ins['inserts']} inserts of <= {args.batch:,})"
                                           f"  ->  {ins['rows'] / ins['insert_s']:,.0f} rows/s"),
                  ("    rows_for + insert", f"{ins['rows'] / (ins['insert_s'] + ins['rows_for_s']):,.0f} rows/s"),
                  ("    rows per table", json.dumps(ins["per_table"]))]
    w = max(len(a) for a, _ in table)
    for a, b in table:
        print(f"{a:<{w}}  {b}")
    result = {"inputs": n, "nodes": args.nodes, "jobs": gen.sched.arrivals, "outputs": outs,
              "replay_s": round(t_replay, 3), "events_per_s": round(eps), "decode_only_per_s": round(n / t_decode),
              "generate_s": round(t_gen, 1)}
    if ins:
        result.update({"ledger_events": ins["events"], "rows": ins["rows"], "rows_for_s": round(ins["rows_for_s"], 3),
                       "insert_s": round(ins["insert_s"], 3), "rows_per_s": round(ins["rows"] / ins["insert_s"]),
                       "batch": args.batch, "per_table": ins["per_table"], "counted": ins["counted"]})
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
