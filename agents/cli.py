"""`gpupool`: the one console script."""
from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from agents.client import Client
from streams.api import BILLING_GROUPS
from infra import config as config_mod
from infra import kafka_local, security

# ---------------------------------------------------------------- stack plumbing


def ensure_broker(cfg) -> str:
    """GPUPOOL_KAFKA if set, else the project's own local broker (fetched and started on demand); then the topics
    and the principals `up` creates (service, node, admin), made with the local broker's own principal or, on an
    external broker, with the configured operator's credentials."""
    from infra import principals

    if cfg.kafka:
        conn = security.kafka_conn(cfg)
    else:
        kafka_local.fetch(cfg.home)
        conn = kafka_local.default_broker(cfg).start().bootstrap_conn()
    asyncio.run(principals.bootstrap(cfg, conn))
    return cfg.bootstrap


def client(cfg) -> Client:
    return Client(cfg)


def emit(columns, rows, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps([dict(zip(columns, r)) for r in rows], default=str))
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(columns)
        w.writerows(rows)
        print(buf.getvalue(), end="")
    else:
        widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c))
                  for i, c in enumerate(columns)]
        print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


def parse_time(s: str | None) -> int | None:
    if s is None:
        return None
    if s.isdigit():
        return int(s)
    from datetime import datetime, timezone

    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise SystemExit(f"time {s!r}: ISO 8601 (2026-12-01T09:00) or epoch milliseconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


# ---------------------------------------------------------------- commands


def cmd_kafka(cfg, args) -> int:
    broker = kafka_local.default_broker(cfg)
    if args.action == "fetch":
        print(kafka_local.fetch(cfg.home))
    elif args.action == "start":
        ensure_broker(cfg)
        print(f"kafka on {broker.bootstrap} (SASL/SCRAM-SHA-512; credentials under {security.credentials_dir(cfg.home)})")
    elif args.action == "stop":
        broker.stop()
    return 0


def cmd_worker(cfg, args) -> int:
    from faust.worker import Worker as FaustWorker

    from streams.app import Worker

    asyncio.run(kafka_local.ensure_topics(security.kafka_conn(cfg, security.SERVICE)))
    w = Worker(cfg, with_scheduler=not args.no_scheduler, with_sink=not args.no_sink)
    FaustWorker(w.app, loglevel=args.loglevel, quiet=True).execute_from_commandline()
    return 0


def cmd_agent(cfg, args) -> int:
    from agents.node.sim_agent import SimFleetAgent

    if not args.simulate:
        from agents.node.nvml_agent import run_nvml_agent  # real cards
        return run_nvml_agent(cfg, args)
    agent = SimFleetAgent.from_spec(cfg, args.simulate, telemetry_interval_s=args.interval,
                                    group_id=args.group or "gpupool-agent-sim", faults=args.fault or [],
                                    principal=args.principal)

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stopping.set)
        task = asyncio.create_task(agent.run())
        await agent.stopping.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    return 0


def job_request(args, job_id: str, tenant: str):
    from schemas.events import Constraints, JobRequested, Tier

    return JobRequested(
        job_id=job_id, tenant=tenant, project=args.project, tier=Tier(args.tier),
        compute_milli=args.compute, gpu_memory_mib=int(args.memory_gib * 1024), cpu_milli=args.cpu,
        memory_mib=args.host_memory_mib, duration_s=args.duration, latency_sensitive=args.latency_sensitive,
        reservation_id=args.reservation,
        constraints=Constraints(models=tuple(args.model or ()), max_spread=args.max_spread,
                                interconnect="nvlink" if args.nvlink else "any"))


def cmd_submit(cfg, args) -> int:
    c = client(cfg)
    tenant = c.own_tenant(args.tenant)
    job_id = args.job_id or f"job-{uuid.uuid4().hex[:10]}"
    c.send([job_request(args, job_id, tenant)])
    print(c.qualify(tenant, job_id))
    return 0


def cmd_quota(cfg, args) -> int:
    from schemas.events import QuotaSet

    q = QuotaSet(tenant=args.tenant, project=args.project, gpu_milli=args.compute,
                 gpu_memory_mib=int(args.memory_gib * 1024) if args.memory_gib is not None else None,
                 overcommit_pct=args.overcommit_pct)
    client(cfg).send([q])
    return 0


def cmd_reserve(cfg, args) -> int:
    """Book capacity for a window (`reserve book`) or cancel a booking (`reserve cancel ID`)."""
    from schemas.events import ReservationCancelled, ReservationRequested, Tier

    c = client(cfg)
    if args.action == "cancel":
        if not args.reservation_id:
            raise SystemExit("reserve cancel needs the reservation id")
        c.send([ReservationCancelled(reservation_id=args.reservation_id)])
        return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("compute", "memory_gib") if getattr(args, k) is None]
    if missing:
        raise SystemExit(f"reserve book needs {', '.join(missing)}")
    tenant = c.own_tenant(args.tenant)
    rid = args.reservation_id or f"res-{uuid.uuid4().hex[:10]}"
    start = parse_time(args.start) if args.start else time.time_ns() // 1_000_000
    r = ReservationRequested(reservation_id=rid, tenant=tenant, project=args.project, tier=Tier(args.tier),
                             compute_milli=args.compute, gpu_memory_mib=int(args.memory_gib * 1024),
                             start_ms=start, end_ms=start + int(args.hours * 3_600_000))
    c.send([r])
    print(c.qualify(tenant, rid))
    return 0


def cmd_service(cfg, args) -> int:
    """Declare (or re-declare) an inference service with its SLO, or remove it."""
    from schemas.events import ServiceDeclared, ServiceRemoved

    c = client(cfg)
    if args.action == "remove":
        payload = ServiceRemoved(service_id=args.service_id)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("compute", "memory_gib", "replica_qps")
                   if getattr(args, k) is None]
        if missing:
            raise SystemExit(f"service declare needs {', '.join(missing)}")
        payload = ServiceDeclared(
            service_id=args.service_id, tenant=c.own_tenant(args.tenant), project=args.project,
            replica_compute_milli=args.compute, replica_memory_mib=int(args.memory_gib * 1024),
            boost_compute_milli=args.boost, replica_qps=args.replica_qps, min_replicas=args.min_replicas,
            max_replicas=args.max_replicas, latency_target_ms=args.latency_ms, max_queue=args.max_queue,
            latency_sensitive=not args.not_latency_sensitive)
    c.send([payload])
    return 0


def cmd_jobs(cfg, args) -> int:
    cols, rows = client(cfg).rows("/api/jobs", {"tenant": args.tenant})
    emit(cols, rows, args.format)
    return 0


def cmd_billing(cfg, args) -> int:
    cols, rows = client(cfg).rows("/api/billing", {
        "by": args.by, "tenant": args.tenant, "project": args.project, "since": parse_time(args.since),
        "until": parse_time(args.until)})
    emit(cols, rows, args.format)
    return 0


def cmd_sql(cfg, args) -> int:
    cols, rows = client(cfg).sql(args.statement)
    emit(cols, rows, args.format)
    return 0


def cmd_cluster(cfg, args) -> int:
    doc = client(cfg).api("/cluster/")
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    print(f"nodes {doc['nodes']}  cards {doc['cards']}  unhealthy {doc['unhealthy_cards']}  "
          f"unschedulable {len(doc['unschedulable_nodes'])}")
    print(f"allocated {doc['allocated_milli'] / 1000:.2f} of {doc['capacity_milli'] / 1000:.0f} GPUs "
          f"({doc['allocation_permille'] / 10:.1f}%); fragmentation {doc['fragmentation_milli'] / 1000:.2f} GPUs "
          f"({doc['fragmentation_permille'] / 10:.1f}% of free)")
    for dim in ("model", "rack", "datacenter"):
        free = ", ".join(f"{k} {v / 1000:.2f}" for k, v in doc[f"free_milli_by_{dim}"].items())
        print(f"free GPUs by {dim}: {free}")
    return 0


def cmd_explain(cfg, args) -> int:
    c = client(cfg)
    job = args.job
    if "/" not in job and c.creds.role == "tenant":
        job = c.qualify(c.creds.tenant, job)
    doc = c.api("/api/explain", {"job": job})
    if not doc["events"]:
        print(f"no scheduling decisions recorded for {job}")
        return 1
    for e in doc["events"]:
        who = f"  by {e['actor']}" if e.get("actor") else ""
        print(f"{e['time_ms']}  {e['kind']}  {e['node'] or '-'}{who}")
        for r in e["reasons"]:
            extra = " ".join(f"{k}={v}" for k, v in sorted(r.get("data", {}).items()))
            plugin = f"[{r['plugin']}] " if r.get("plugin") else ""
            print(f"    {plugin}{r['code']}: {r.get('message', '')} {extra}".rstrip())
    return 0


def cmd_user(cfg, args) -> int:
    """Principals: SCRAM credentials and ACLs on the broker, a registry record, and (for this CLI) the credentials
    stored under $GPUPOOL_HOME/credentials, mode 0600."""
    from infra import principals

    c = client(cfg)
    if args.action == "list":
        doc = c.api("/api/principals")
        emit(["name", "role", "tenant"], [[p["name"], p["role"], p["tenant"] or ""] for p in doc["principals"]],
             args.format)
        return 0
    if not args.name:
        raise SystemExit(f"user {args.action} needs a NAME")
    if args.action == "remove":
        n = asyncio.run(principals.remove(c.conn(), args.name))
        security.forget(cfg.home, args.name)
        print(f"removed {args.name} ({n} ACLs)")
        return 0
    if not args.role:
        raise SystemExit(f"user add needs --role ({', '.join(security.ROLES)})")
    creds = security.new_credentials(args.name, args.role, args.tenant)
    asyncio.run(principals.add(c.conn(), creds))
    path = security.save(cfg.home, creds)
    print(f"added {creds.name} ({creds.role}{' of ' + creds.tenant if creds.tenant else ''}); credentials in {path}")
    if args.show_token:
        print(f"HTTP token: {creds.token}")
    return 0


def cmd_simulate(cfg, args, rest: list[str]) -> int:
    if args.protocol == "fgd":
        from agents.sim.fgd_protocol import run_cli
        return run_cli(rest)
    if args.protocol == "colocation":  # flags: --qps --philly --gpus --hours --seed --mode --plots --json (its --help)
        from agents.sim.colocation import run_cli as run_colocation
        return run_colocation(rest)
    raise SystemExit(f"unknown protocol {args.protocol}")


# ---------------------------------------------------------------- up / down / demo

def _pidfile(cfg, name: str) -> Path:
    return cfg.home / "run" / f"{name}.pid"


def spawn(cfg, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    (cfg.home / "run").mkdir(parents=True, exist_ok=True)
    log = open(cfg.home / "run" / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "agents.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, start_new_session=True)
    _pidfile(cfg, name).write_text(str(proc.pid))
    return proc


def stop_pid(pid: int, timeout: float = 20.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except OSError:
                return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def wait_web(cfg, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    c = client(cfg)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"worker exited early; see {cfg.home / 'run' / 'worker.log'}")
        if c.healthy():
            return
        time.sleep(0.5)
    raise SystemExit("worker did not come up")


def cmd_up(cfg, args) -> int:
    ensure_broker(cfg)
    worker = spawn(cfg, "worker", ["worker"])
    wait_web(cfg, worker)
    if args.simulate:
        spawn(cfg, "agent", ["agent", "--simulate", args.simulate])
    print(f"gpupool up: kafka {cfg.bootstrap} (SASL), worker http://{cfg.web_bind}:{cfg.web_port}, home {cfg.home}; "
          f"acting as {cfg.user}")
    return 0


def cmd_down(cfg, args) -> int:
    for name in ("agent", "worker"):
        pf = _pidfile(cfg, name)
        if pf.exists():
            stop_pid(int(pf.read_text()))
            pf.unlink()
    if not cfg.kafka:
        kafka_local.default_broker(cfg).stop()
    print("gpupool down")
    return 0


def cmd_demo(cfg, args) -> int:
    from agents.demo import run_demo
    return run_demo(cfg, args)


# ---------------------------------------------------------------- argument parsing

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool", description="Event-sourced control plane for a shared GPU pool")
    p.add_argument("--as", dest="as_user", metavar="NAME",
                   help="act as this principal (default: $GPUPOOL_USER, else admin)")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--as", dest="as_user", metavar="NAME", default=argparse.SUPPRESS,
                        help="act as this principal (default: $GPUPOOL_USER, else admin)")
    _add = sub.add_parser

    def add_parser(name, **kw):
        return _add(name, parents=[common], **kw)

    sub.add_parser = add_parser

    k = sub.add_parser("kafka", help="fetch, start or stop the local Kafka broker")
    k.add_argument("action", choices=["fetch", "start", "stop"])

    w = sub.add_parser("worker", help="run the Faust worker (folds, scheduler, ClickHouse sink) in the foreground")
    w.add_argument("--no-scheduler", action="store_true")
    w.add_argument("--no-sink", action="store_true")
    w.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])

    a = sub.add_parser("agent", help="run node agents: real GPUs through NVML, or --simulate FLEET")
    a.add_argument("--simulate", metavar="FLEET", help="fleet YAML, openb node CSV, or demo:N")
    a.add_argument("--interval", type=float, default=1.0, help="telemetry interval in seconds")
    a.add_argument("--fault", action="append", help="ecc:NODE:INDEX | clear:NODE:INDEX | lose:NODE | slow:NODE:FACTOR | recover:NODE | restart:NODE, "
                        "optionally @SECONDS after start")
    a.add_argument("--group", help="consumer group for commands")
    a.add_argument("--principal", default="node", help="the node principal the agent connects as")
    a.add_argument("--allow-mig-reconfigure", action="store_true")

    s = sub.add_parser("submit", help="submit a job request (a tenant principal: for its own tenant)")
    s.add_argument("--tenant", help="the tenant (default: the acting tenant principal's; operators must name one)")
    s.add_argument("--project", default="default")
    s.add_argument("--tier", default="offline", choices=["inference", "online-training", "offline"])
    s.add_argument("--compute", type=int, required=True, help="compute units in milli-CU (1000 = one A100)")
    s.add_argument("--memory-gib", type=float, required=True, help="GPU memory")
    s.add_argument("--cpu", type=int, default=1000, help="milli-CPU")
    s.add_argument("--host-memory-mib", type=int, default=1024)
    s.add_argument("--duration", type=int, help="simulated run time in seconds")
    s.add_argument("--model", action="append", help="allowed card model (repeatable)")
    s.add_argument("--latency-sensitive", action="store_true", help="inference: prefer the newest generation")
    s.add_argument("--max-spread", default="datacenter", choices=["node", "nvlink", "rack", "datacenter", "any"],
                   help="the widest a multi-card gang may spread")
    s.add_argument("--nvlink", action="store_true", help="a multi-card job must stay in one NVLink domain")
    s.add_argument("--reservation", help="take the capacity booked by this reservation")
    s.add_argument("--job-id")

    r = sub.add_parser("reserve", help="book capacity for a time window, or cancel a booking")
    r.add_argument("action", choices=["book", "cancel"])
    r.add_argument("reservation_id", nargs="?")
    r.add_argument("--tenant")
    r.add_argument("--project", default="default")
    r.add_argument("--tier", default="online-training", choices=["inference", "online-training", "offline"])
    r.add_argument("--compute", type=int, help="milli-CU")
    r.add_argument("--memory-gib", type=float, help="GPU memory")
    r.add_argument("--start", help="ISO time or epoch ms (default: now)")
    r.add_argument("--hours", type=float, default=1.0)

    v = sub.add_parser("service", help="declare or remove an inference service (replicas follow its load)")
    v.add_argument("action", choices=["declare", "remove"])
    v.add_argument("service_id")
    v.add_argument("--tenant")
    v.add_argument("--project", default="default")
    v.add_argument("--compute", type=int, help="one replica's milli-CU")
    v.add_argument("--memory-gib", type=float, help="one replica's GPU memory")
    v.add_argument("--boost", type=int, default=0, help="milli-CU a vertical boost adds to a replica")
    v.add_argument("--replica-qps", type=int, help="requests/s one replica serves within the SLO")
    v.add_argument("--min-replicas", type=int, default=1)
    v.add_argument("--max-replicas", type=int, default=64)
    v.add_argument("--latency-ms", type=int, default=500, help="p99 latency target")
    v.add_argument("--max-queue", type=int, default=100)
    v.add_argument("--not-latency-sensitive", action="store_true")

    q = sub.add_parser("quota", help="set a tenant's (or project's) quota")
    q.add_argument("action", choices=["set"])
    q.add_argument("tenant")
    q.add_argument("--project")
    q.add_argument("--compute", type=int, required=True, help="quota in milli-CU")
    q.add_argument("--memory-gib", type=float, help="GPU-memory quota (default: not limited)")
    q.add_argument("--overcommit-pct", type=int, default=120)

    j = sub.add_parser("jobs", help="list jobs with state and node (a tenant sees its own)")
    j.add_argument("--tenant")
    j.add_argument("--format", default="table", choices=["table", "json", "csv"])

    sq = sub.add_parser("sql", help="one read-only SQL statement on the bill and the log (finance, auditor, "
                                    "operator)")
    sq.add_argument("statement")
    sq.add_argument("--format", default="table", choices=["table", "json", "csv"])

    us = sub.add_parser("user", help="principals: add NAME --role ROLE [--tenant T] | list | remove NAME")
    us.add_argument("action", choices=["add", "list", "remove"])
    us.add_argument("name", nargs="?")
    us.add_argument("--role", choices=list(security.ROLES))
    us.add_argument("--tenant", help="the tenant of a tenant principal")
    us.add_argument("--show-token", action="store_true", help="print the HTTP token (it is also in the file)")
    us.add_argument("--format", default="table", choices=["table", "json", "csv"])

    b = sub.add_parser("billing", help="GPU-seconds per tenant/project/job/model/day")
    b.add_argument("--tenant")
    b.add_argument("--project")
    b.add_argument("--since")
    b.add_argument("--until")
    b.add_argument("--by", default="tenant", choices=list(BILLING_GROUPS))
    b.add_argument("--format", default="table", choices=["table", "json", "csv"])

    cl = sub.add_parser("cluster", help="the materialized cluster view: allocation, fragmentation, free capacity")
    cl.add_argument("--format", default="table", choices=["table", "json"])

    e = sub.add_parser("explain", help="why a job was placed where it is, or why it waits")
    e.add_argument("job")

    sub.add_parser("audit", help="audit the log: replay --verify [--from T --to T], export --tenant T --out DIR",
                   add_help=False)

    sim = sub.add_parser("simulate", help="offline trace evaluation",
                         epilog="colocation: --qps PATH --philly PATH --gpus N --hours H --seed S --mode load|clock "
                                "--plots DIR --json (docs/colocation.md)")
    sim.add_argument("--protocol", required=True, choices=["fgd", "colocation"])

    u = sub.add_parser("up", help="start broker, worker (and a simulated fleet) in the background")
    u.add_argument("--simulate", metavar="FLEET", default="demo:4")
    sub.add_parser("down", help="stop what `up` started")

    sub.add_parser = _add
    d = sub.add_parser("demo", help="the end-to-end scenario on the embedded defaults")
    d.add_argument("--jobs", type=int, default=20)
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--keep", action="store_true", help="leave the demo's data directory in place")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser().parse_known_args(argv)
    if rest and args.command not in ("simulate", "audit"):
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    cfg = config_mod.load().acting_as(getattr(args, "as_user", None))
    handlers = {"kafka": cmd_kafka, "worker": cmd_worker, "agent": cmd_agent, "submit": cmd_submit,
                "reserve": cmd_reserve, "service": cmd_service, "quota": cmd_quota, "jobs": cmd_jobs,
                "cluster": cmd_cluster, "billing": cmd_billing, "explain": cmd_explain, "sql": cmd_sql,
                "user": cmd_user, "up": cmd_up, "down": cmd_down, "demo": cmd_demo}
    if args.command == "simulate":
        return cmd_simulate(cfg, args, rest)
    if args.command == "audit":
        from agents.audit import run_audit
        return run_audit(cfg, rest)
    return handlers[args.command](cfg, args)


if __name__ == "__main__":
    raise SystemExit(main())
