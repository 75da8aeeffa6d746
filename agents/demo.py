"""`gpupool demo`: the product's story on the embedded defaults, each step checked (issue #18).

A fresh local SASL broker and embedded ClickHouse under $GPUPOOL_HOME/demo, a simulated fleet of mixed models with
a MIG-carved card, and five principals: an operator, two tenants' members, finance and an auditor. Each step prints
one numbered line with what to notice, then the check that holds it; a failed check ends the demo naming the step
(exit 1). Nothing is left running unless `--stay`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import orjson

from agents.stack import Stack
from schemas.events import JobCancelled, JobRequested, QuotaSet, ServiceDeclared, ServiceRemoved, Tier
from schemas.program import Serve

FLEET = """\
# the demo's fleet: three 4-card A100 nodes (two share a rack), an A100 carved into MIG instances, an A10 node for
# inference, two T4 nodes and two L4 nodes (step 6's: the example program's job and what moves it)
nodes:
  - {name: a100-1, model: A100-80GB, gpus: 4, rack: rack-1, nvlink: true}
  - {name: a100-2, model: A100-80GB, gpus: 4, rack: rack-1, nvlink: true}
  - {name: a100-3, model: A100-80GB, gpus: 4, rack: rack-2, nvlink: true}
  - {name: mig-1, model: A100-80GB, gpus: 1, rack: rack-2, mig: [3g.40gb, 2g.20gb, 1g.10gb]}
  - {name: a10-1, model: A10, gpus: 2, rack: rack-2}
  - {name: t4-1, model: T4, gpus: 2, rack: rack-3}
  - {name: t4-2, model: T4, gpus: 2, rack: rack-3}
  - {name: l4-1, model: L4, gpus: 2, rack: rack-3}
  - {name: l4-2, model: L4, gpus: 2, rack: rack-3}
"""
GIB = 1024
PRINCIPALS = (("ops", "operator", None), ("alice", "tenant", "acme"), ("bob", "tenant", "globex"),
              ("fin", "finance", None), ("aud", "auditor", None))
# milli-CU (an A100 is 1,000): acme may borrow up to 150 % of its quota, globex up to the default 120 %
QUOTAS = (QuotaSet(tenant="acme", gpu_milli=8_000, overcommit_pct=150),
          QuotaSet(tenant="acme", project="llm-train", gpu_milli=6_000, overcommit_pct=150),
          QuotaSet(tenant="acme", project="research", gpu_milli=2_000, overcommit_pct=300),
          QuotaSet(tenant="globex", gpu_milli=10_000),
          QuotaSet(tenant="globex", project="chat-serving", gpu_milli=4_000),
          QuotaSet(tenant="globex", project="batch", gpu_milli=6_000))


class StepFailed(Exception):
    pass


class Load:
    """The chat service's traffic: real HTTP requests through the router's nginx (agents/router.py) to the replicas,
    the shipped model server (infra/programs/model_server.py). Open loop: requests leave at `qps` whatever the
    answers take, as users' do; each one's latency and the replica that answered are kept. Nothing reports the load
    by hand: the nodes scrape the replicas and the autoscaler folds that into the service's `inference.load`."""

    def __init__(self, url: str, qps: float = 6):
        self.url, self.qps = url, qps
        # (due: when it was to leave, wall s; latency ms from then; status; replica; when it left, wall s)
        self.results: list[tuple[float, float, int, str, float]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = None

    def _one(self, sent: float) -> None:
        import json
        import urllib.error
        import urllib.request

        left = time.time()
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, data=b"{}", method="POST"), timeout=60) as r:
                status, replica = r.status, json.loads(r.read()).get("replica", "")
        except urllib.error.HTTPError as exc:
            status, replica = exc.code, ""
        except (OSError, ValueError):
            status, replica = 0, ""
        with self.lock:
            self.results.append((sent, (time.time() - sent) * 1000, status, replica, left))

    def run(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=256)
        nxt = time.monotonic()
        while not self.stop.is_set():
            nxt += 1 / self.qps
            delay = nxt - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            else:
                nxt = time.monotonic()  # behind: no burst to catch up
            self.pool.submit(self._one, time.time())
        self.pool.shutdown(wait=True)

    def p99(self, a: float, b: float) -> float | None:
        """The p99 (ms) of the requests sent in [a, b) (wall seconds) that were answered."""
        with self.lock:
            lats = sorted(r[1] for r in self.results if a <= r[0] < b and r[2] == 200)
        return round(lats[min(len(lats) - 1, int(0.99 * len(lats)))]) if lats else None

    def first_answer(self, replica: str) -> float | None:
        """When the first request the replica answered left the client (wall s)."""
        with self.lock:
            return min((r[4] for r in self.results if r[3] == replica and r[2] == 200), default=None)

    def last_sent_to(self, replica: str) -> float | None:
        with self.lock:
            return max((r[4] for r in self.results if r[3] == replica and r[2] == 200), default=None)


class Demo:
    def __init__(self, stack: Stack, t0: float):
        self.stack, self.t0 = stack, t0
        self.marks: list[tuple[float, str]] = []

    # ---------------------------------------------------------------- helpers

    def say(self, n: int | str, text: str) -> None:
        print(f"[{n}] {text}", flush=True)

    def note(self, text: str) -> None:
        print(f"      {text}", flush=True)

    def mark(self, label: str) -> None:
        self.marks.append((time.monotonic(), label))

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = predicate()
            except Exception:  # the API restarting or busy: ask again
                got = None
            if got:
                return got
            time.sleep(1.0)
        raise StepFailed(f"timed out after {timeout:.0f} s waiting for {what}")

    def events(self, kinds: tuple[str, ...], job: str | None = None, like: str | None = None) -> list[dict]:
        where, params = "kind IN {k:Array(String)}", {"k": list(kinds)}
        if job is not None:
            where += " AND job_id = {j:String}"
            params["j"] = job
        if like is not None:
            where += " AND job_id LIKE {l:String}"
            params["l"] = like
        return self.stack.query(f"SELECT kind, job_id, node, command_id, event_time_ms, payload FROM gpupool.events "
                                f"FINAL WHERE {where} ORDER BY event_time_ms, topic, partition, offset", params)

    def placements(self, job: str) -> list[dict]:
        return [orjson.loads(r["payload"]) | {"_t": int(r["event_time_ms"])} for r in self.events(("cmd.place",), job)]

    def running(self, *jobs: str) -> bool:
        states = self.states()
        return all(states.get(j) == "running" for j in jobs)

    def states(self) -> dict[str, str]:
        cols, rows = self.stack.client().rows("/api/jobs")
        return {r[0]: r[cols.index("state")] for r in rows}

    def cli(self, user: str, *argv: str, ok: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", "agents.cli", "--as", user, *argv],
                           env={**os.environ, **self.stack.env}, capture_output=True, text=True, timeout=240)
        if ok and p.returncode != 0:
            raise StepFailed(f"`gpupool --as {user} {' '.join(argv)}` exited {p.returncode}: "
                             f"{(p.stderr or p.stdout).strip()[-800:]}")
        return p

    # the chat replicas: 2 requests at a time, 30 ms of work at a whole card (60 ms at a replica's share), 3 s warm-up
    SERVER_ARGS = ("--slots", "2", "--base-ms", "30", "--warmup-s", "3")

    def program(self, name: str) -> Path:
        """A shipped program (infra/programs/NAME) where the job user can read it."""
        jobs_root = Path(self.stack.env.get("GPUPOOL_JOBS_ROOT") or self.stack.home / "jobs")
        programs = jobs_root.parent / "programs"
        programs.mkdir(parents=True, exist_ok=True)
        os.chmod(programs, 0o755)
        script = programs / name
        from infra import programs as shipped

        shutil.copy(Path(shipped.__file__).parent / name, script)
        os.chmod(script, 0o644)
        return script

    def at(self) -> str:
        return f"t={time.monotonic() - self.t0:5.1f}s"

    def inject(self, fault: str) -> None:
        with (self.stack.home / "faults").open("a") as f:
            f.write(fault + "\n")

    # ---------------------------------------------------------------- the steps

    def step1(self) -> None:
        ops, alice, bob = (self.stack.client(u) for u in ("ops", "alice", "bob"))
        from agents.client import price_rows

        ops.send(list(QUOTAS))
        ops.send(price_rows(resources.files("infra").joinpath("prices.yaml").read_text()))
        self.say(1, "operator `ops` sets two-level quotas (acme 8 CU: llm-train 6, research 2; globex 10 CU: "
                    "chat-serving 4, batch 6) and loads the price book")
        alice.send([
            JobRequested(job_id="train-6", tenant="acme", project="llm-train", tier=Tier.ONLINE_TRAINING,
                         compute_milli=6000, gpu_memory_mib=6 * 80 * GIB, cpu_milli=8000, memory_mib=64 * GIB,
                         constraints={"max_spread": "rack"}, duration_s=3600, checkpoint_interval_s=5),
            JobRequested(job_id="tune-a10", tenant="acme", project="research", tier=Tier.OFFLINE,
                         compute_milli=400, gpu_memory_mib=20 * GIB, constraints={"models": ["A10"]},
                         duration_s=3600, checkpoint_interval_s=3)])
        server = self.program("model_server.py")
        bob.send([
            ServiceDeclared(service_id="chat", tenant="globex", project="chat-serving", replica_compute_milli=200,
                            replica_memory_mib=8 * GIB, boost_compute_milli=150, replica_qps=15, min_replicas=1,
                            max_replicas=3, latency_target_ms=200, constraints={"models": ["A10"]},
                            scale_in_stable_s=15, scale_in_cooldown_s=15,
                            command=("python3", str(server), *self.SERVER_ARGS), serve=Serve(metrics="vllm")),
            JobRequested(job_id="embed-mig", tenant="globex", project="chat-serving", tier=Tier.INFERENCE,
                         compute_milli=140, gpu_memory_mib=9 * GIB, duration_s=3600, isolation="mig"),
            JobRequested(job_id="embed-t4", tenant="globex", project="batch", tier=Tier.OFFLINE,
                         compute_milli=208, gpu_memory_mib=10 * GIB, constraints={"models": ["T4"]},
                         duration_s=3600, checkpoint_interval_s=2)])
        self.note("alice (acme) submits a 6-GPU training gang and a fine-tune on an A10; bob (globex) declares the "
                  "`chat` service (0.2 CU replicas on A10s, each the shipped model server behind a port), a 0.14 CU MIG inference job and a T4 batch job")
        self.wait(lambda: self.running("acme/train-6", "acme/tune-a10", "globex/embed-mig", "globex/embed-t4",
                                       "globex/chat/r1"), 120, "the first jobs running")
        self.mark("jobs placed")
        parts = self.placements("acme/train-6")
        topo = [r for p in parts for r in p["reasons"] if r["code"] == "Topology"]
        if len(parts) < 2 or not topo:
            raise StepFailed(f"the 6-GPU gang should span two nodes with a Topology reason: {parts}")
        mig_place = self.placements("globex/embed-mig")[-1]
        if not all(a.get("mig_uuid") for a in mig_place["assignments"]):
            raise StepFailed(f"embed-mig was not given a MIG instance: {mig_place['assignments']}")
        out = self.cli("alice", "explain", "acme/train-6").stdout
        self.note(f"{self.at()}  `gpupool --as alice explain acme/train-6` says:")
        for line in out.splitlines():
            if any(w in line for w in ("Topology", "slower", "part", "placed", "Placed")):
                self.note("    " + line.strip()[:150])
        self.note(f"CHECK OK: the gang runs on {', '.join(p['node'] for p in parts)} (one rack), "
                  f"topology and slowdown explained; embed-mig holds MIG instance "
                  f"{mig_place['assignments'][0]['mig_uuid'][-12:]} on {mig_place['node']}")

    def step2(self) -> None:
        alice, bob = self.stack.client("alice"), self.stack.client("bob")
        alice.send([JobRequested(job_id="sweep", tenant="acme", project="research", tier=Tier.OFFLINE,
                                 compute_milli=4000, gpu_memory_mib=4 * 80 * GIB, constraints={"max_spread": "node"},
                                 duration_s=3600, checkpoint_interval_s=2)])
        self.say(2, "alice submits a 4-GPU sweep beyond acme's quota: it borrows idle A100s")
        self.wait(lambda: self.running("acme/sweep"), 90, "the sweep running")
        first = self.placements("acme/sweep")[-1]
        if not first["borrowed"]:
            raise StepFailed(f"the sweep should run on borrowed capacity: {first}")
        self.note(f"{self.at()}  sweep runs on {first['node']}, borrowed (billed on its own line)")
        time.sleep(4)  # a checkpoint or two
        bob.send([JobRequested(job_id="batch-4", tenant="globex", project="batch", tier=Tier.OFFLINE,
                               compute_milli=4000, gpu_memory_mib=4 * 80 * GIB, constraints={"max_spread": "node"},
                               duration_s=20)])
        self.note("bob's demand returns: a 4-GPU batch job within globex's quota, and no 4 free A100s on one node")
        preempt = self.wait(lambda: self.events(("cmd.preempt",), "acme/sweep"), 60, "the sweep reclaimed")[0]
        self.mark("borrowed work reclaimed")
        why = orjson.loads(preempt["payload"])["reasons"]
        self.wait(lambda: self.running("globex/batch-4"), 60, "batch-4 running")
        self.note(f"{self.at()}  reclaimed: sweep checkpoints and stops ({why[0]['code']}: "
                  f"{why[0]['message'][:90]}); batch-4 runs on {self.placements('globex/batch-4')[-1]['node']}")
        self.wait(lambda: len(self.placements("acme/sweep")) >= 2, 90, "the sweep resumed")
        self.mark("sweep resumed")
        again = self.placements("acme/sweep")[-1]
        release = self.events(("cmd.release",), "globex/batch-4")
        between = [r for r in self.events(("cmd.place",))
                   if release and int(release[0]["event_time_ms"]) <= int(r["event_time_ms"]) < again["_t"]]
        if not again["resume_from"] or between:
            raise StepFailed(f"the sweep should resume from its checkpoint before other work: {again}, {between}")
        self.note(f"CHECK OK: reclaimed with a checkpoint and resumed first from {again['resume_from']} on "
                  f"{again['node']} (attempt {again['attempt']}) as soon as batch-4 finished")

    def step3(self) -> None:
        from agents.node.serving import free_port

        listen = free_port()
        self.stack.spawn("router", "router", "--service", "globex/chat", "--listen", str(listen), "--prefix",
                         str(self.stack.home / "router"))
        load = Load(f"http://127.0.0.1:{listen}/globex/chat/v1/completions", qps=6)
        self.wait(lambda: load._one(time.time()) or load.results[-1][2] == 200, 60, "chat answering through nginx")
        load.results.clear()
        thread = threading.Thread(target=load.run, daemon=True)
        thread.start()
        self.say(3, f"the chat service's traffic, real HTTP through the router's nginx (127.0.0.1:{listen}), rises "
                    "past its SLO; the nodes scrape the replicas' vLLM metrics into the autoscaler's load")
        try:
            time.sleep(8)
            load.qps = 30
            t_peak = time.time()
            self.mark("peak")
            up = self.wait(lambda: self.scaled("vertical_up"), 90, "a vertical boost")[0]
            self.wait(lambda: self.scaled("traffic_shift"), 90, "new replicas taking traffic")
            yielded = self.events(("cmd.preempt",), "acme/tune-a10")
            time.sleep(6)
            load.qps = 5
            t_calm = time.time()
            self.mark("peak over")
            self.wait(lambda: [a for a in self.scaled("scale_in") if a["_t"] / 1000 >= t_calm], 120,
                      "the scale-in after the peak")
            self.wait(lambda: len(self.placements("acme/tune-a10")) >= 2 and self.running("acme/tune-a10"), 60,
                      "the fine-tune back")
            time.sleep(2)
        finally:
            load.stop.set()
            thread.join(60)
            self.stack.stop_process("router")
        tp = int(t_peak * 1000)
        shifted_to: dict[str, float] = {}
        for a in self.scaled():
            if a["_t"] < tp:
                continue  # the warm pool filled at the declaration
            t, took = a["_t"] / 1000, a["took_ms"] / 1000
            if a["action"] == "traffic_shift":
                for j in a["jobs"]:
                    shifted_to.setdefault(j, t)
            self.note(f"+{t - t_peak:5.1f}s after the peak began: {a['action']:<15} serving {a['replicas']}  p99 "
                      f"{load.p99(t - 5, t)} ms before, {load.p99(t + took, t + took + 5)} ms after (measured through "
                      f"nginx)" + (f" (ready in {a['took_ms']} ms)" if a["took_ms"] else ""))
        scraped = [e for e in self.events(("inference.load",)) if orjson.loads(e["payload"]).get("service_id")
                   == "globex/chat"]
        if not scraped:
            raise StepFailed("no inference.load was folded from the replicas' scrapes")
        early = {j: load.first_answer(j) for j in shifted_to}
        early = {j: t for j, t in early.items() if t is not None and t < shifted_to[j]}
        if early:
            raise StepFailed(f"replicas answered before traffic was shifted to them: {early}")
        if not yielded:
            raise StepFailed("the fine-tune on the A10 did not yield to the new replicas")
        if up["_t"] / 1000 - t_peak > 20:
            raise StepFailed("the vertical boost came more than 20 s after the peak began")
        scaled_in = [j for a in self.scaled("scale_in") if a["_t"] / 1000 >= t_calm for j in a["jobs"]]
        after_in = min(a["_t"] for a in self.scaled("scale_in") if a["_t"] / 1000 >= t_calm) / 1000
        late = {j: load.last_sent_to(j) for j in scaled_in}
        late = {j: round(t - after_in, 1) for j, t in late.items() if t is not None and t > after_in + 5}
        if late:
            raise StepFailed(f"scaled-in replicas still took traffic more than 5 s after the scale-in: {late}")
        back = self.placements("acme/tune-a10")[-1]
        first = min(a["_t"] for a in self.scaled() if a["_t"] >= tp) / 1000
        self.note(f"peak p99 {load.p99(t_peak, t_calm)} ms over {sum(1 for r in load.results if r[0] >= t_peak)} "
                  f"requests; before it {load.p99(0, t_peak)} ms; no request reached a replica before its "
                  f"traffic_shift, none a scaled-in one after the router took it out")
        self.note(f"CHECK OK: the first action {first - t_peak:.0f} s into the peak (warm replicas take traffic at "
                  f"once), the vertical boost in {up['_t'] / 1000 - t_peak:.0f} s; the fine-tune yielded its A10 with "
                  f"a checkpoint and resumed from {back['resume_from']} once the peak was over")

    def scaled(self, action: str | None = None) -> list[dict]:
        rows = self.stack.query("SELECT event_time_ms, payload FROM gpupool.events FINAL WHERE kind = "
                                "'service.scaled' ORDER BY event_time_ms")
        out = [orjson.loads(r["payload"]) | {"_t": int(r["event_time_ms"])} for r in rows]
        return [a for a in out if action is None or a["action"] == action]

    def mono_to_log(self, t: float) -> int:
        return int((time.time() - (time.monotonic() - t)) * 1000)

    def log_to_mono(self, ms: int) -> float:
        return time.monotonic() - (time.time() - ms / 1000)

    def step4(self) -> None:
        node = self.placements("globex/embed-t4")[-1]["node"]
        self.say(4, f"node {node} is lost (no heartbeats, no reports) while globex's embed-t4 runs on it")
        self.inject(f"lose:{node}")
        lost = self.wait(lambda: self.events(("job.interrupted",), "globex/embed-t4"), 90, "the interruption")[0]
        self.mark(f"{node} lost")
        self.wait(lambda: len(self.placements("globex/embed-t4")) >= 2 and self.running("globex/embed-t4"), 60,
                  "embed-t4 elsewhere")
        again = self.placements("globex/embed-t4")[-1]
        if again["node"] == node or not again["resume_from"]:
            raise StepFailed(f"embed-t4 should resume elsewhere from its checkpoint: {again}")
        self.note(f"{self.at()}  {orjson.loads(lost['payload'])['code']}: requeued; resumed on {again['node']} "
                  f"from {again['resume_from']} (attempt {again['attempt']})")
        self.inject(f"recover:{node}")
        self.note("CHECK OK: the lost node's job resumed elsewhere from its checkpoint (billing checked in step 7)")

    def step5(self) -> None:
        alice, bob = self.stack.client("alice"), self.stack.client("bob")
        alice.send([JobCancelled(job_id="sweep", reason="the sweep found its answer")])
        self.wait(lambda: not self.running("acme/sweep") and self.states().get("acme/sweep") != "placed", 60,
                  "the sweep ended")
        evals = [JobRequested(job_id=f"eval-{i}", tenant="acme", project="research", tier=Tier.OFFLINE,
                              compute_milli=1000, gpu_memory_mib=80 * GIB, checkpoint_interval_s=2,
                              duration_s=12 if i < 2 else 3600) for i in range(4)]
        alice.send(evals)
        self.say(5, "alice runs four 1-GPU evaluations; two finish and leave the free A100s spread over two nodes")
        self.wait(lambda: all(self.states().get(f"acme/eval-{i}") == "completed" for i in range(2)), 180,
                  "two evaluations done")  # 12 s each; a loaded machine has been seen to need more than 90 s
        nodes = self.stack.client().api("/api/nodes")["nodes"]
        free = {n["node"]: sum(1 for g in n["cards"] if g["healthy"] and g["free_milli"] == 1000)
                for n in nodes if n["node"].startswith("a100-")}
        self.note(f"{self.at()}  free A100s: " + ", ".join(f"{k} {v}" for k, v in sorted(free.items())) +
                  f" ({sum(free.values())} in all, at most {max(free.values())} on one node); bob asks for a "
                  f"4-GPU inference gang on one node")
        bob.send([JobRequested(job_id="serve-4", tenant="globex", project="chat-serving", tier=Tier.INFERENCE,
                               compute_milli=4000, gpu_memory_mib=4 * 80 * GIB, isolation="exclusive",
                               constraints={"max_spread": "node", "models": ["A100-80GB"]}, duration_s=3600)])
        moves = self.wait(lambda: self.events(("cmd.migrate",)), 90, "a migration plan")
        self.mark("defragmentation")
        self.wait(lambda: self.running("globex/serve-4"), 90, "the gang placed")
        place = self.placements("globex/serve-4")
        for m in moves:
            p = orjson.loads(m["payload"])
            why = p["reasons"][0] if p["reasons"] else {"message": ""}
            self.note(f"cmd.migrate {p['job_id']}: {p['from_node']} -> {p['to_node']}  {why['message'][:110]}")
        moved = {orjson.loads(m["payload"])["job_id"] for m in moves}
        preempted = [r["job_id"] for r in self.events(("cmd.preempt",)) if int(r["event_time_ms"]) >=
                     int(moves[0]["event_time_ms"])]
        if len({p["node"] for p in place}) != 1 or not all(self.running(j) for j in moved) or preempted:
            raise StepFailed(f"the gang should run on one node, the moved work go on, nothing preempted: {place}, "
                             f"{moved}, preempted {preempted}")
        self.note(f"CHECK OK: {len(moved)} job(s) moved with their checkpoints, none stopped for good; serve-4 runs "
                  f"on {place[0]['node']}")

    # the example program (infra/programs/digest_train.py) through a drain, a reclaim and a lost node, on the L4s
    DIGEST_ARGS = ("--steps", "600", "--every", "5", "--step-ms", "100")  # 60 s of work, a checkpoint every 0.5 s
    DIGEST_STEPS = 600
    L4 = {"models": ["L4"]}

    def _digest_run(self, attempt: int) -> dict | None:
        """The digest job's latest placement once its `attempt` runs and has checkpointed past where it began."""
        job = "acme/digest"
        if self.states().get(job) == "completed":
            raise StepFailed("the program ended before its interruptions were through (a very slow machine?)")
        places = self.placements(job)
        if not places or places[-1]["attempt"] != attempt or not self.running(job):
            return None
        cmds = {p["command_id"] for p in places if p["attempt"] == attempt}
        ckpts = [r for r in self.events(("job.checkpointed",), job) if r["command_id"] in cmds
                 and orjson.loads(r["payload"])["progress_ms"] > 0]
        return places[-1] if ckpts else None

    def step6(self) -> None:
        from infra.programs import digest_train

        alice, bob = self.stack.client("alice"), self.stack.client("bob")
        jobs_root = Path(self.stack.env.get("GPUPOOL_JOBS_ROOT") or self.stack.home / "jobs")
        programs = jobs_root.parent / "programs"
        programs.mkdir(parents=True, exist_ok=True)
        os.chmod(programs, 0o755)
        script = programs / "digest_train.py"
        shutil.copy(digest_train.__file__, script)
        os.chmod(script, 0o644)
        alone = programs / "uninterrupted"
        shutil.rmtree(alone, ignore_errors=True)
        # the uninterrupted run: the same program and arguments as a plain subprocess, beside the job
        reference = subprocess.Popen([sys.executable, str(script), *self.DIGEST_ARGS, "--dir", str(alone)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            self._digest_story(alice, bob, script)
            out, _ = reference.communicate(timeout=300)
        finally:
            if reference.poll() is None:
                reference.kill()
                reference.wait()
        alone_digest = re.findall(r"^digest ([0-9a-f]{64})$", out, re.M)
        logs = self.cli("alice", "logs", "digest", "--format", "json").stdout
        runs: dict[int, str] = {}
        for line in logs.splitlines():
            piece = orjson.loads(line)
            runs[piece["attempt"]] = runs.get(piece["attempt"], "") + piece["text"]
        final = re.findall(r"^digest ([0-9a-f]{64})$", runs.get(max(runs, default=0), ""), re.M)
        resumed = [re.match(r"resumed from step (\d+) \(", runs.get(a, "")) for a in (2, 3, 4)]
        if sorted(runs) != [1, 2, 3, 4] or not all(m and int(m[1]) > 0 for m in resumed):
            raise StepFailed(f"the job's four runs should each say where they resumed: "
                             f"{ {a: t[:80] for a, t in runs.items()} }")
        if not alone_digest or final != alone_digest or alone_digest[0] != digest_train.expected(self.DIGEST_STEPS):
            raise StepFailed(f"the final digest {final} should be the uninterrupted run's {alone_digest}")
        usage = [orjson.loads(r["payload"]) for r in self.events(("usage.accrued",), "acme/digest")]
        ends = self._digest_ends()
        billed = {a: sum(u["end_ms"] - u["start_ms"] for u in usage if u["attempt"] == a) for a in (1, 2, 3, 4)}
        ran = {a: e - s for a, (s, e) in ends.items()}
        if billed != ran:
            raise StepFailed(f"each run should be billed once, start to end: billed {billed}, ran {ran}")
        self.note(f"{self.at()}  `gpupool --as alice logs digest`: " + "; ".join(
            f"attempt {a} " + ("started at step 0" if a == 1 else f"resumed from step {resumed[a - 2][1]}")
            for a in (1, 2, 3, 4)))
        self.note(f"CHECK OK: digest {final[0][:16]}... after a drain, a reclaim and a lost node equals the "
                  f"uninterrupted run's; each of the 4 runs billed once ({', '.join(f'{v / 1000:.1f}' for v in ran.values())}"
                  f" s), nothing between them")

    def _digest_ends(self) -> dict[int, tuple[int, int]]:
        """attempt -> (started, ended) of the digest job's runs: started to stopped (a drain, a reclaim), to the last
        heartbeat billed (the lost node), to completed."""
        job = "acme/digest"
        cmd_attempt = {p["command_id"]: p["attempt"] for p in self.placements(job)}
        out: dict[int, list[int]] = {}
        for r in self.events(("job.started", "job.stopped", "job.interrupted", "job.completed"), job):
            p = orjson.loads(r["payload"])
            if r["kind"] == "job.started":
                out[cmd_attempt[r["command_id"]]] = [int(r["event_time_ms"]), 0]
            elif r["kind"] == "job.interrupted":
                out[p["attempt"]][1] = p["billed_to_ms"]
            else:
                a = max(out)  # a stop names the command that asked for it: it ends the latest run
                out[a][1] = int(r["event_time_ms"])
        return {a: (s, e) for a, (s, e) in out.items()}

    def _digest_story(self, alice, bob, script: Path) -> None:
        gib = GIB
        alice.send([JobRequested(job_id="digest", tenant="acme", project="research", compute_milli=388,
                                 gpu_memory_mib=20 * gib, constraints=self.L4, checkpoint_interval_s=1,
                                 command=("python3", str(script), *self.DIGEST_ARGS))])
        self.say(6, f"alice runs the example program, `python3 digest_train.py {' '.join(self.DIGEST_ARGS)}`, on an "
                    f"L4 (borrowed); its node is drained, it is reclaimed, its node is lost")
        first = self.wait(lambda: self._digest_run(1), 90, "the program running with a checkpoint")
        if not first["borrowed"]:
            raise StepFailed(f"the program should run on borrowed capacity: {first}")
        # a move: the operator drains its node (defragmentation would move it too, but step 5 spent acme's budget of
        # moves for the hour, `migrations_per_hour`): SIGTERM, a checkpoint, and the run goes on on the other L4
        self.cli("ops", "node", "drain", first["node"])
        second = self.wait(lambda: self._digest_run(2), 90, "the program moved off the drained node")
        self.cli("ops", "node", "uncordon", first["node"])
        self.note(f"{self.at()}  `gpupool --as ops node drain {first['node']}`: moved to {second['node']}, resumed "
                  f"from its checkpoint")
        # a reclaim: globex, within its quota, asks for all four L4 cards
        fill = [f"l4-fill-{i}" for i in range(4)]
        bob.send([JobRequested(job_id=j, tenant="globex", project="batch", compute_milli=388, gpu_memory_mib=20 * gib,
                               constraints=self.L4, duration_s=3600) for j in fill])
        stop = self.wait(lambda: self.events(("cmd.preempt",), "acme/digest")[1:], 60, "the reclaim")[0]
        why = orjson.loads(stop["payload"])["reasons"][0]
        if why.get("data", {}).get("rule") != "reclaim":
            raise StepFailed(f"the second stop should be a reclaim: {why}")
        self.wait(lambda: all(self.running(f"globex/{j}") for j in fill), 60, "globex's four L4 jobs running")
        where = {j: self.placements(f"globex/{j}")[-1]["node"] for j in fill}
        away = [j for j in fill if where[j] == first["node"]]
        bob.send([JobCancelled(job_id=j, reason="done") for j in away])
        third = self.wait(lambda: self._digest_run(3), 90, "the program back after the reclaim")
        self.note(f"{self.at()}  reclaimed ({why['code']}: {why['message'][:60]}); resumed on {third['node']}")
        # a lost node: globex's work on the other L4 node ends first, so that the program has room there
        rest = [j for j in fill if j not in away]
        bob.send([JobCancelled(job_id=j, reason="done") for j in rest])
        self.wait(lambda: all(self.states().get(f"globex/{j}") == "cancelled" for j in rest), 60,
                  "the other L4 node free")
        self.inject(f"lose:{third['node']}")
        self.wait(lambda: self.events(("job.interrupted",), "acme/digest"), 60, "the node declared lost")
        fourth = self.wait(lambda: self._digest_run(4), 90, "the program back after the lost node")
        self.inject(f"recover:{third['node']}")
        self.note(f"{self.at()}  {third['node']} lost: resumed on {fourth['node']} from {fourth['resume_from']}; "
                  f"waiting for the program's end")
        self.wait(lambda: self.states().get("acme/digest") == "completed", 180, "the program's end")

    def stop_all(self) -> None:
        """The tenants cancel what still runs, so the bill is final."""
        states = self.states()
        for user, tenant in (("alice", "acme"), ("bob", "globex")):
            mine = [j for j, s in states.items() if j.startswith(tenant + "/") and "/chat/" not in j
                    and s in ("running", "pending", "placed")]
            self.stack.client(user).send([JobCancelled(job_id=j.split("/", 1)[1], reason="demo over") for j in mine])
        self.stack.client("bob").send([ServiceRemoved(service_id="chat")])
        self.wait(lambda: not [j for j, s in self.states().items() if s in ("running", "placed")], 60,
                  "every job stopped")
        time.sleep(3)  # the last usage records reach ClickHouse on the sink's next batch

    def step7(self) -> None:
        self.stop_all()
        self.say(7, "the bill: `gpupool --as fin billing --by project --cost` (borrowed time priced apart)")
        out = self.cli("fin", "billing", "--by", "project", "--cost", "--format", "json").stdout
        rows = orjson.loads(out)
        rows = rows["rows"] if isinstance(rows, dict) else rows
        print(self.cli("fin", "billing", "--by", "project", "--cost").stdout.rstrip("\n"))
        tenants = {r["tenant"] for r in rows}
        if tenants != {"acme", "globex"}:
            raise StepFailed(f"the bill should cover both tenants: {rows}")
        if not any(r["tenant"] == "acme" and r["borrowed_micro"] > 0 for r in rows):
            raise StepFailed(f"acme's borrowed sweep should be priced on its own line: {rows}")
        mine = orjson.loads(self.cli("alice", "billing", "--by", "project", "--cost", "--format", "json").stdout)
        mine = mine["rows"] if isinstance(mine, dict) else mine
        other = self.cli("alice", "billing", "--tenant", "globex", ok=False)
        if {r["tenant"] for r in mine} != {"acme"} or (other.returncode == 0 and "globex" in other.stdout):
            raise StepFailed(f"alice should see acme's bill only: {mine}; {other.stdout}{other.stderr}")
        spans = self.stack.query("SELECT job_id, node, attempt, start_ms, end_ms FROM gpupool.usage FINAL "
                                 "ORDER BY job_id, node, start_ms")
        for a, b in zip(spans, spans[1:]):
            if a["job_id"] == b["job_id"] and a["node"] == b["node"] and int(a["end_ms"]) > int(b["start_ms"]):
                raise StepFailed(f"{a['job_id']} billed twice on {a['node']}: {a} overlaps {b}")
        self.note(f"alice (tenant acme) sees acme only; asking for globex's: "
                  f"{(other.stderr or other.stdout).strip().splitlines()[-1][:100] if other.returncode else 'empty'}")
        self.note(f"CHECK OK: both tenants billed, borrowed apart; {len(spans)} usage intervals, none overlapping "
                  f"another of the same job (the lost node's run ends at its last heartbeat)")

    def step8(self, out: Path) -> None:
        self.say(8, "the auditor re-derives every decision and the bill from the log: `audit replay --verify`")
        res = self.cli("aud", "audit", "replay", "--verify")
        for line in res.stdout.strip().splitlines()[-4:]:
            self.note(line[:150])
        ends = re.search(r"scheduler state: (\d+) of (\d+) segment end\(s\) checked.*?, (\d+) different", res.stdout)
        if not ends or int(ends[1]) < 1 or int(ends[1]) != int(ends[2]) or int(ends[3]):
            raise StepFailed(f"the audit should check the state at each segment's end against its snapshot: "
                             f"{ends[0] if ends else res.stdout[-300:]}")
        pack = out / "evidence-acme"
        shutil.rmtree(pack, ignore_errors=True)
        self.cli("aud", "audit", "export", "--tenant", "acme", "--out", str(pack))
        ver = self.cli("aud", "audit", "verify-export", str(pack))
        leaked = [p.name for p in pack.rglob("*") if p.is_file() and "globex" in p.read_text(errors="ignore")]
        if leaked:
            raise StepFailed(f"acme's evidence names globex in {leaked}")
        self.note(f"evidence for acme written to {pack} and verified: {ver.stdout.strip().splitlines()[-1][:110]}")
        self.note(f"CHECK OK: replay matches the recorded decisions and the bill, and the state at each of {ends[1]} "
                  f"segment ends equals the snapshot there; signed export verified, no other tenant in it")

    def step9(self, out: Path) -> Path:
        self.say(9, "the demo's timeline as a picture")
        path = timeline_png(self, out / "demo-timeline.png")
        self.note(f"{path}: allocation by tier, the queue and the chat service's load over the demo")
        self.note(f"dashboard: http://127.0.0.1:{self.stack.web_port}/ui/ (sign in as alice, bob, ops or fin with "
                  f"the token in {self.stack.home}/credentials/NAME.json; `gpupool demo --stay` keeps it up)")
        return path


def timeline_png(demo: Demo, path: Path) -> Path:
    """Allocation (held milli-GPU by tier), pending jobs and the service's qps/p99 over the demo, from the log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = demo.stack.query("SELECT kind, job_id, event_time_ms, payload FROM gpupool.events FINAL WHERE kind IN "
                            "('job.requested', 'cmd.place', 'cmd.release', 'cmd.resize', 'inference.load', "
                            "'service.scaled', 'job.completed', 'job.cancelled', 'job.rejected', 'job.failed', "
                            "'cmd.preempt', 'job.interrupted') "
                            "ORDER BY event_time_ms, kind != 'job.requested', topic, partition, offset")
    if not rows:
        raise StepFailed("no events to draw")
    t0 = int(rows[0]["event_time_ms"])
    tiers: dict[str, str] = {}
    held: dict[str, int] = {}
    waiting: set[str] = set()
    alloc: dict[str, list[tuple[float, int]]] = {"inference": [], "online-training": [], "offline": []}
    queue, qps, p99, actions = [], [], [], []
    for r in rows:
        p = orjson.loads(r["payload"])
        t = (int(r["event_time_ms"]) - t0) / 1000
        job, kind = r["job_id"], r["kind"]
        if kind == "job.requested":
            tiers[job] = p.get("tier", "offline")
            waiting.add(job)
        elif kind in ("cmd.place", "cmd.resize"):
            milli = sum(a["milli"] for a in p["assignments"])
            held[f"{job}@{p['node']}"] = milli
            waiting.discard(job)
        elif kind == "cmd.release":
            held.pop(f"{job}@{p['node']}", None)
        elif kind in ("cmd.preempt", "job.interrupted"):
            waiting.add(job)  # requeued (a cancel's stop is followed by its job.cancelled)
        elif kind in ("job.completed", "job.cancelled", "job.rejected", "job.failed"):
            waiting.discard(job)
        elif kind == "inference.load" and not p.get("replica"):
            qps.append((t, p["qps"]))
            p99.append((t, p["p99_ms"]))
        elif kind == "service.scaled":
            actions.append((t, p["action"]))
        for tier in alloc:
            alloc[tier].append((t, sum(m for k, m in held.items() if tiers.get(k.split("@")[0], "inference") == tier)))
        queue.append((t, len(waiting)))
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(9, 7), sharex=True, dpi=110)
    xs = [x for x, _ in alloc["offline"]]
    a1.stackplot(xs, *[[v / 1000 for _, v in alloc[k]] for k in alloc], labels=list(alloc), step="post")
    a1.set_ylabel("GPUs held")
    a1.legend(loc="upper left", fontsize=8)
    a1.set_title("gpupool demo: allocation by tier, queue, and the chat service's load", fontsize=10)
    a2.step([x for x, _ in queue], [v for _, v in queue], where="post", color="#c62828")
    a2.set_ylabel("jobs waiting")
    if qps:
        a3.plot([x for x, _ in qps], [v for _, v in qps], color="#1f77b4", label="qps")
        b = a3.twinx()
        b.plot([x for x, _ in p99], [v for _, v in p99], color="#ff7f0e", label="p99 ms")
        b.set_ylabel("p99 ms")
    a3.set_ylabel("qps")
    for ax in (a1, a2, a3):
        ax.grid(alpha=0.3)
        for t, label in actions:
            ax.axvline(t, color="#888", lw=0.7, ls="--")
    for t, label in actions:
        a3.annotate(label, (t, 0), fontsize=7, rotation=90, va="bottom")
    for t, label in demo.marks:
        x = (demo.mono_to_log(t) - t0) / 1000
        a1.annotate(label, (x, 0), fontsize=7, rotation=90, va="bottom", color="#333")
    a3.set_xlabel("seconds since the first event")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


STEPS = 9


def run_demo(cfg, args) -> int:
    t0 = time.monotonic()
    home = cfg.home / "demo"
    shutil.rmtree(home, ignore_errors=True)
    # the scheduler snapshots every 75 input records and the audit keeps each (the defaults, every 2,000 records or
    # 2 min and one per 50,000 records, would leave a two-minute demo one segment): step 7 verifies in segments
    stack = Stack(home=home, libs_home=cfg.home, bootstrap=cfg.kafka,
                  extra_env={"GPUPOOL_SNAPSHOT_EVERY": "75", "GPUPOOL_SNAPSHOT_AUDIT_EVERY": "1"})
    # step 6's program runs as the job user (65534 when the demo runs as root): its directories where that user
    # reaches them (a home under /root, or made under a umask of 077, is not)
    from agents.node.runner import passable_roots

    roots = passable_roots(home)
    stack.extra_env.update(roots)
    if roots:
        for d in roots.values():  # a fresh demo: the last one's runs and checkpoints are gone
            shutil.rmtree(d, ignore_errors=True)
        passable_roots(home)
    demo = Demo(stack, t0)
    failed: list[tuple[int, str]] = []
    try:
        print("gpupool demo: a pool of mixed GPUs shared by two tenants, every step checked", flush=True)
        stack.start_broker()
        stack.start_worker()
        (home / "fleet.yaml").write_text(FLEET)
        (home / "faults").touch()
        stack.start_agent(str(home / "fleet.yaml"), "--control", str(home / "faults"))
        for name, role, tenant in PRINCIPALS:
            stack.add_user(name, role, tenant)
        demo.note(f"{demo.at()}  local SASL broker {stack.bootstrap}, worker, 9 simulated nodes (A100, MIG A100, "
                  f"A10, T4, L4); principals ops, alice (acme), bob (globex), fin, aud")
        demo.wait(lambda: stack.client().api("/cluster/")["nodes"] == 9, 90, "the fleet")
        out = Path(args.out) if getattr(args, "out", None) else home
        for n, fn in enumerate([demo.step1, demo.step2, demo.step3, demo.step4, demo.step5, demo.step6,
                                demo.step7, lambda: demo.step8(out), lambda: demo.step9(out)], 1):
            try:
                fn()
            except (StepFailed, SystemExit) as exc:  # SystemExit: the client's WorkerDown, ApiFailure
                if isinstance(exc, SystemExit) and stack.procs.get("worker") and stack.procs["worker"].poll() is not None:
                    exc = StepFailed(f"the worker died: {stack.log('worker')[-1500:]}")
                failed.append((n, str(exc)))
                print(f"[{n}] FAILED: {exc}", flush=True)
                if n >= 7:
                    break  # the steps before the bill still tell their story; after it, nothing is left to tell
        if getattr(args, "stay", False) and not failed:
            print(f"the stack stays up: http://127.0.0.1:{stack.web_port}/ui/ (Ctrl-C to stop)", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(home / "kafka-data", ignore_errors=True)
            if roots:
                shutil.rmtree(Path(roots["GPUPOOL_JOBS_ROOT"]).parent, ignore_errors=True)
    took = time.monotonic() - t0
    if failed:
        print(f"\ndemo FAILED after {took:.0f} s at step " + "; step ".join(f"{n} ({why})" for n, why in failed))
        return 1
    print(f"\ndemo finished in {took:.0f} s: every step's check held")
    return 0
