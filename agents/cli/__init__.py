"""`gpupool`: the one console script. The commands live in agents/cli/: requests.py (what states something),
views.py (what reads), stack.py (processes), users.py (principals); this module is the argument parser."""
from __future__ import annotations

import argparse
import os
import sys

from agents.cli import logs, requests, stack, users, views
from agents.cli.output import emit, parse_time  # noqa: F401 - used by the demo and the audit
from infra import config as config_mod
from infra import security
from pydantic import ValidationError
from streams.edge.api import BILLING_GROUPS

FORMATS = ["table", "json", "csv"]


def cmd_simulate(cfg, args, rest: list[str]) -> int:
    if args.protocol == "fgd":
        from agents.sim.fgd_protocol import run_cli
        return run_cli(rest)
    if args.protocol == "colocation":  # flags: --qps --philly --gpus --hours --seed --mode --plots --json (its --help)
        from agents.sim.colocation import run_cli as run_colocation
        return run_colocation(rest)
    raise SystemExit(f"unknown protocol {args.protocol}")


# ---------------------------------------------------------------- argument parsing


def _percent(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 100 <= v <= 300:
        raise argparse.ArgumentTypeError(f"{v} is outside 100..300 (the cap is a percent of the quota)")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool", description="Event-sourced control plane for a shared GPU pool")
    p.add_argument("--as", dest="as_user", metavar="NAME",
                   help="act as this principal (default: $GPUPOOL_USER, else admin)")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--as", dest="as_user", metavar="NAME", default=argparse.SUPPRESS,
                        help="act as this principal (default: $GPUPOOL_USER, else admin)")

    def add(name: str, handler, **kw) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], **kw)
        sp.set_defaults(handler=handler)
        return sp

    def fmt(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--format", default="table", choices=FORMATS)

    # ---- the stack
    k = add("kafka", stack.cmd_kafka, help="fetch, start or stop the local Kafka broker")
    k.add_argument("action", choices=["fetch", "start", "stop"])
    w = add("worker", stack.cmd_worker,
            help="run the Faust worker (gateway, folds, scheduler, ClickHouse sink, API) in the foreground")
    w.add_argument("--no-scheduler", action="store_true")
    w.add_argument("--no-sink", action="store_true",
                   help="no ClickHouse sink and no SQL here (chDB: one process per data path; another worker has it)")
    w.add_argument("--name", default="worker", help="this worker's name among several (its Faust data directory)")
    w.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    a = add("agent", stack.cmd_agent, help="run node agents: real GPUs through NVML, or --simulate FLEET; "
                                           "`agent inject FAULT...` breaks the supervised simulated fleet")
    a.add_argument("simulate_inject", nargs="*", metavar="inject FAULT", help=argparse.SUPPRESS)
    a.add_argument("--simulate", metavar="FLEET", help="fleet YAML, openb node CSV, or demo:N")
    a.add_argument("--control", metavar="FILE", help="a file of faults the simulated fleet applies as lines are "
                                                      "added (default for inject: $GPUPOOL_HOME/run/faults)")
    a.add_argument("--interval", type=float, default=1.0, help="telemetry interval in seconds")
    a.add_argument("--fault", action="append",
                   help="ecc:NODE:INDEX | clear:NODE:INDEX | lose:NODE | slow:NODE:FACTOR | recover:NODE | "
                        "restart:NODE | fail:JOB, optionally @SECONDS after start")
    a.add_argument("--group", help="consumer group for commands")
    a.add_argument("--principal", default=None,
                   help="the node principal the agent connects as (default: each node's own, node-NODE)")
    a.add_argument("--allow-mig-reconfigure", action="store_true")
    a.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (default: "
                   "$GPUPOOL_AGENT_METRICS_PORT, else none)")
    u = add("up", stack.cmd_up, help="start broker, worker and a simulated fleet in the background, supervised")
    u.add_argument("--simulate", metavar="FLEET", default="default",
                   help="fleet to simulate: a fleet file, demo:N, or default (demo:4 and a node of two A100s in MIG "
                        "mode); '' for none")
    u.add_argument("--brokers", type=int, default=None,
                   help="local Kafka brokers: 1, or a KRaft cluster of N on loopback (replication min(3, N), "
                        "min.insync.replicas 2 from 3); remembered for this home")
    u.add_argument("--workers", type=int, default=1,
                   help="Faust workers sharing the partitions (the first holds the sink and the API's ClickHouse)")
    add("down", stack.cmd_down, help="stop what `up` started, and nothing else")
    sv = add("supervise", stack.cmd_supervise, help=argparse.SUPPRESS)
    sv.add_argument("--home", required=True)
    sv.add_argument("--simulate")
    sv.add_argument("--workers", type=int, default=1)

    # ---- requests
    s = add("submit", requests.cmd_submit, help="submit a job request (a tenant principal: for its own tenant)")
    s.add_argument("--tenant", help="the tenant (default: the acting tenant principal's; operators must name one)")
    # defaults None: a job file's key fills what the command line leaves out (requests.SUBMIT_DEFAULTS)
    s.add_argument("-f", "--file", metavar="JOB_FILE", help="a job file (YAML: the options below as keys, and "
                   "`command:`; '-' for stdin; flags given here win over its keys; docs/jobs.md)")
    s.add_argument("--project", help="default: default")
    s.add_argument("--tier", choices=["inference", "online-training", "offline"], help="default: offline")
    s.add_argument("--compute", type=int, help="compute units in milli-CU (1000 = one A100); required; 0 with "
                   "--memory-gib 0: a CPU-only job (no card, only --cpu and --host-memory-mib)")
    s.add_argument("--memory-gib", type=float, help="GPU memory; required")
    s.add_argument("--cpu", type=int, help="host milli-CPU (default 1000); a gang over several nodes gets this much "
                   "for each part, on each node (docs/jobs.md, \"Gangs\")")
    s.add_argument("--host-memory-mib", type=int, help="host memory, MiB (default 1024); per part of a gang, like "
                   "--cpu")
    s.add_argument("--duration", type=int, help="simulated run time in seconds (a job with no command)")
    s.add_argument("--checkpoint-every", "--checkpoint-interval", type=int, metavar="SECONDS",
                   help="checkpoint interval (a preempted or interrupted job resumes from its last checkpoint)")
    s.add_argument("--model", action="append", help="allowed card model (repeatable)")
    s.add_argument("--latency-sensitive", action="store_true", default=None,
                   help="inference: prefer the newest generation")
    s.add_argument("--max-spread", choices=["node", "nvlink", "rack", "datacenter", "any"],
                   help="the widest a multi-card gang may spread (default: datacenter)")
    s.add_argument("--nvlink", action="store_true", default=None,
                   help="a multi-card job must stay in one NVLink domain")
    s.add_argument("--reservation", help="take the capacity booked by this reservation")
    s.add_argument("--isolation", choices=["shared", "mig", "exclusive"],
                   help="software share, hardware slice (MIG) only, or whole cards only (default: the tier's, shared)")
    s.add_argument("--job-id")
    s.add_argument("--image", help="run the command in this OCI image (default: a plain process on the node)")
    s.add_argument("--env", action="append", metavar="NAME=VALUE", help="an environment variable (repeatable)")
    s.add_argument("--volume", action="append", metavar="NAME:/PATH[:ro|rw]",
                   help="mount a volume of the operator's list (read-only unless :rw; repeatable)")
    s.add_argument("--workdir", help="the working directory (default: the job's own directory)")
    s.add_argument("--retries", type=int, help="requeue a failed run this many times, with back-off (default 0)")
    # the program follows `--`: `gpupool submit --compute 500 --memory-gib 8 -- python train.py --lr 3e-4`
    s.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait to read back the scheduler's answer: placed, waiting or rejected (exit 1 "
                        "when rejected; 0: do not wait)")
    c = add("cancel", requests.cmd_cancel, help="cancel jobs (a tenant: its own; operators: TENANT/NAME)")
    c.add_argument("jobs", nargs="+")
    c.add_argument("--reason")
    r = add("reserve", requests.cmd_reserve,
            help="book capacity for a time window, cancel a booking, or list bookings and where each stands")
    r.add_argument("action", choices=["book", "cancel", "list"])
    r.add_argument("--format", choices=["table", "json", "csv"], default="table")
    r.add_argument("reservation_id", nargs="?")
    r.add_argument("--tenant")
    r.add_argument("--project", default="default")
    r.add_argument("--tier", default="online-training", choices=["inference", "online-training", "offline"])
    r.add_argument("--compute", type=int, help="milli-CU")
    r.add_argument("--memory-gib", type=float, help="GPU memory")
    r.add_argument("--start", help="ISO time or epoch ms (default: now)")
    r.add_argument("--hours", type=float, default=1.0)
    v = add("service", requests.cmd_service, help="declare or remove an inference service (replicas follow its load), "
            "or list its endpoints")
    v.add_argument("action", choices=["declare", "remove", "endpoints"])
    v.add_argument("service_id")
    # the replicas' program follows `--`: `gpupool service declare chat ... --port 0 -- python3 model_server.py`
    v.add_argument("--image", help="run the replicas' command in this OCI image")
    v.add_argument("--env", action="append", metavar="NAME=VALUE", help="a replica's environment variable")
    v.add_argument("--port", type=int, help="the port a replica listens on (0: the node picks one; the program "
                                            "reads PORT); giving it makes the replicas serving ones")
    v.add_argument("--readiness-path", default="/health", help="answered 200 once a replica is ready")
    v.add_argument("--metrics", choices=["vllm", "sglang", "none"], default="none",
                   help="whose Prometheus names a replica's metrics endpoint speaks (its load is scraped from it)")
    v.add_argument("--metrics-path", default="/metrics")
    v.add_argument("--ramp-s", type=float, help="endpoints: the weight ramp of a new replica (default: the pool's)")
    v.add_argument("--format", choices=["table", "json"], default="table")
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
    v.add_argument("--scale-in-stable-s", type=int, help="how long low load must hold before replicas go "
                                                          "(default: the pool's, 300)")
    v.add_argument("--scale-in-cooldown-s", type=int, help="between scale-ins and after a scale-up (default 300)")
    q = add("quota", None, help="set or show quotas: set TENANT --compute N [--project P] | show [TENANT]")
    q.add_argument("action", choices=["set", "show"])
    q.add_argument("tenant", nargs="?")
    q.add_argument("--project")
    q.add_argument("--compute", type=int, help="quota in milli-CU")
    q.add_argument("--memory-gib", type=float, help="GPU-memory quota (default: not limited)")
    q.add_argument("--overcommit-pct", type=_percent, default=120, metavar="100..300",
                   help="the borrowing cap, percent of the quota (default 120)")
    q.add_argument("--wait", type=float, default=15.0, metavar="SECONDS",
                   help="set: how long to wait to read back whether it is in force or refused (0: do not)")
    fmt(q)
    n = add("node", None, help="nodes: list | show NODE | cordon|uncordon|drain|remove|admit NODE... (operators)")
    n.add_argument("action", choices=["list", "show", "cordon", "uncordon", "drain", "remove", "admit"])
    n.add_argument("nodes", nargs="*")
    n.add_argument("--reason")
    n.add_argument("--revoke", action="store_true", help="admit: take the admission back (the node takes no work)")
    fmt(n)
    pr = add("prices", None, help="the price book: show | set --model M --per-gpu-hour X | load FILE")
    pr.add_argument("action", choices=["show", "set", "load"])
    pr.add_argument("file", nargs="?")
    pr.add_argument("--model")
    pr.add_argument("--per-gpu-hour", help="the price of one GPU for one hour, a decimal in --currency (4.20)")
    pr.add_argument("--currency", help="set: ISO 4217 code of the price (default USD); load: the file's `currency:`")
    pr.add_argument("--borrowed", action="store_true")
    pr.add_argument("--datacenter")
    pr.add_argument("--tod-band", choices=["peak", "offpeak"])
    pr.add_argument("--tier", choices=["inference", "online-training", "offline"])
    pr.add_argument("--valid-from", help="ISO time or epoch ms (default: now)")
    fmt(pr)
    us = add("user", None, help="principals: add NAME --role ROLE [--tenant T] [--node NODE [--auto-admit]] | list | "
                                "remove NAME | token NAME (print the HTTP token stored for NAME)")
    us.add_argument("action", choices=["add", "list", "remove", "token"])
    us.add_argument("name", nargs="?")
    us.add_argument("--role", choices=list(security.ROLES))
    us.add_argument("--tenant", help="the tenant of a tenant principal")
    us.add_argument("--node", action="append", default=[], metavar="NODE",
                    help="a node principal: the node it speaks for (repeat for several)")
    us.add_argument("--auto-admit", action="store_true",
                    help="a node principal: its nodes take work when first heard, without `gpupool node admit`")
    us.add_argument("--show-token", action="store_true", help="print the HTTP token (it is also in the file)")
    fmt(us)

    # ---- views
    j = add("jobs", views.cmd_jobs, help="jobs with state, nodes, cards, wait and run time (a tenant: its own)")
    j.add_argument("--tenant")
    j.add_argument("--project")
    j.add_argument("--state", choices=["pending", "running", "completed", "failed", "cancelled", "rejected"])
    j.add_argument("--tier", choices=["inference", "online-training", "offline"])
    j.add_argument("--since", help="submitted at or after (ISO time or epoch ms)")
    fmt(j)
    h = add("history", views.cmd_history, help="a job's whole life: placements, checkpoints, preemptions, bills")
    h.add_argument("job")
    fmt(h)
    rt = add("router", cmd_router, help="nginx in front of services' ready replicas, following their endpoints "
                                        "(docs/serving.md)")
    rt.add_argument("--service", action="append", required=True, help="a service to route (repeatable)")
    rt.add_argument("--listen", type=int, default=8088, help="the port nginx listens on (127.0.0.1)")
    rt.add_argument("--prefix", help="nginx's own directory (default: $GPUPOOL_HOME/router)")
    lg = add("logs", logs.cmd_logs, help="a job's program output, stdout and stderr of each run (its tenant and "
                                        "operators)")
    lg.add_argument("job")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing as output comes, until the latest run "
                                                                 "ends (Ctrl-C stops)")
    lg.add_argument("--attempt", type=int, metavar="N", help="only this run (attempt) of the job")
    lg.add_argument("--part", type=int, metavar="K", help="only this part of a gang job")
    lg.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    lg.add_argument("-q", "--quiet", action="store_true", help="no '==> attempt N, part K on NODE <==' headers")
    lg.add_argument("--format", default="text", choices=["text", "json"], help="json: one piece a line")
    e = add("explain", views.cmd_explain, help="why a job was placed where it is, or why it waits")
    e.add_argument("job")
    fmt(e)
    b = add("billing", views.cmd_billing, help="GPU time (and with --cost, money) per tenant/project/job/model/day")
    b.add_argument("--tenant")
    b.add_argument("--project")
    b.add_argument("--since")
    b.add_argument("--until")
    b.add_argument("--by", default="tenant", choices=list(BILLING_GROUPS))
    b.add_argument("--cost", action="store_true", help="price it with the price book, borrowed time apart")
    fmt(b)
    inv = add("invoice", views.cmd_invoice, help="invoices per tenant for a month or period, as CSV and HTML "
                                                  "(finance: every tenant; a tenant: its own)")
    inv.add_argument("--tenant", help="one tenant (a tenant principal: its own, the default)")
    inv.add_argument("--month", help="a calendar month, UTC: YYYY-MM")
    inv.add_argument("--period", nargs=2, metavar=("FROM", "TO"), help="[FROM, TO): ISO times (UTC if no zone) or "
                                                                      "epoch ms")
    inv.add_argument("--out", default=".", help="the folder the invoices are written to (default: here)")
    inv.add_argument("--format", default="csv,html", help="csv, html or both (csv,html), or json to print the "
                                                           "invoices' documents")
    sq = add("sql", views.cmd_sql, help="one read-only SQL statement on the bill and the log (finance, auditor, "
                                        "operator)")
    sq.add_argument("statement")
    fmt(sq)
    cl = add("cluster", views.cmd_cluster, help="allocation, fragmentation, free capacity")
    cl.add_argument("--format", default="table", choices=["table", "json"])

    sub.add_parser("audit", help="audit the log: replay --verify [--jobs N] [--from T --to T | --from-offset A "
                                 "--to-offset B] [--full], export --tenant T --out DIR",
                   add_help=False)
    sub.add_parser("acceptance", help="seed 004's acceptance suites: report --out DIR [--results FILE]",
                   add_help=False)
    sim = sub.add_parser("simulate", help="offline trace evaluation",
                         epilog="colocation: --qps PATH --philly PATH --gpus N --hours H --seed S --mode load|clock "
                                "--plots DIR --json (docs/colocation.md)")
    sim.add_argument("--protocol", required=True, choices=["fgd", "colocation"])
    d = add("demo", stack.cmd_demo, help="the end-to-end scenario on the embedded defaults")
    d.add_argument("--keep", action="store_true", help="leave the demo's data directory in place")
    d.add_argument("--stay", action="store_true", help="keep the stack (and its dashboard) up after the demo")
    d.add_argument("--out", help="where the evidence pack and the timeline PNG go (default: $GPUPOOL_HOME/demo)")
    return p


def _dispatch(args):
    """The handler of commands whose action picks it."""
    if args.command == "agent" and args.simulate_inject:
        if args.simulate_inject[0] != "inject" or len(args.simulate_inject) < 2:
            raise SystemExit("usage: gpupool agent inject FAULT [FAULT...] (e.g. lose:node-001, fail:acme/job-1)")
        args.simulate, args.faults = "inject", args.simulate_inject[1:]
    if args.command == "quota":
        return requests.cmd_quota_set if args.action == "set" else views.cmd_quota_show
    if args.command == "node":
        if args.action in ("list", "show"):
            if args.action == "show" and len(args.nodes) != 1:
                raise SystemExit("node show needs one NODE")
            return views.cmd_node_list if args.action == "list" else views.cmd_node_show
        if not args.nodes:
            raise SystemExit(f"node {args.action} needs one or more NODE names")
        return requests.cmd_node_change
    if args.command == "prices":
        if args.action == "load" and not args.file:
            raise SystemExit("prices load needs a FILE")
        if args.action == "set" and (not args.model or args.per_gpu_hour is None):
            raise SystemExit("prices set needs --model and --per-gpu-hour")
        return views.cmd_prices_show if args.action == "show" else requests.cmd_prices_change
    if args.command == "user":
        return views.cmd_user_list if args.action == "list" else users.cmd_user_change
    return args.handler


def cmd_router(cfg, args) -> int:
    from pathlib import Path

    from agents import router

    return router.run(cfg, args.service, args.listen, Path(args.prefix) if args.prefix else cfg.home / "router")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    program: list[str] = []
    if "--" in argv and ("submit" in argv[:argv.index("--")] or "service" in argv[:argv.index("--")]):
        argv, program = argv[:argv.index("--")], argv[argv.index("--") + 1:]  # the job's own argv, as given
    args, rest = parser().parse_known_args(argv)
    args.program = program
    if rest and args.command not in ("simulate", "audit", "acceptance"):
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    cfg = config_mod.load().acting_as(getattr(args, "as_user", None))
    try:
        if args.command == "simulate":
            return cmd_simulate(cfg, args, rest)
        if args.command == "audit":
            from agents.audit import run_audit
            return run_audit(cfg, rest)
        if args.command == "acceptance":
            from agents.acceptance import run_cli
            return run_cli(rest)
        if args.command == "supervise":
            from pathlib import Path
            cfg = config_mod.load()
            cfg = type(cfg)(**{**cfg.__dict__, "home": Path(args.home)})
        return _dispatch(args)(cfg, args)
    except ValidationError as exc:
        # a request the schema refuses (a negative --compute, a malformed id): say which field and why, no traceback
        from streams.folds.gateway import printable

        def said(e) -> str:  # an id's pattern as the rule it keeps; what was given cut and escaped
            msg = ("not an id (letters, digits, punctuation and symbols only: no white space, control or format "
                   "characters)") if e["type"] == "string_pattern_mismatch" else e["msg"]
            return f"{'.'.join(str(p) for p in e['loc']) or exc.title}: {msg} (got {printable(repr(e.get('input')), 80)})"

        what = "; ".join(said(e) for e in exc.errors())
        print(f"gpupool {args.command}: invalid {exc.title}: {what}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`gpupool jobs | head`): no traceback, and no second error flushing stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
