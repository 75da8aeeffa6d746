"""`gpupool up | down | supervise | worker | agent | kafka | demo`: the local stack's processes.

`up` starts the broker (and the principals it needs), then one supervisor process in its own session, which runs
the worker and the simulated fleet and restarts whichever crashes (with backoff), and restarts the local broker if it
dies. `up` waits for each part in turn, saying what it waits for, and fails naming the part that died and the end of
its log. `down` stops exactly what `up` started: it signals a process only if its command line says it is this
home's supervisor (or this home's broker), never whatever process a stale pid file names.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agents.client import Client, supervisor_pid
from infra import kafka_local, security

RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30, 60)


def ensure_broker(cfg, say=lambda _: None) -> str:
    """GPUPOOL_KAFKA if set, else the project's own local broker (fetched and started on demand); then the topics
    and the principals `up` creates (service, admin), made with the local broker's own principal or, on an
    external broker, with the configured operator's credentials."""
    from infra import principals

    if cfg.kafka:
        say(f"using the broker at {cfg.kafka} as {cfg.user}")
        conn = security.kafka_conn(cfg)
    else:
        say("fetching Kafka (once) and starting the local broker (SASL/SCRAM on 127.0.0.1)")
        kafka_local.fetch(cfg.home)
        conn = kafka_local.default_broker(cfg).start().bootstrap_conn()
    say("topics and principals (service, admin)")
    asyncio.run(principals.bootstrap(cfg, conn))
    return cfg.bootstrap


def run_dir(cfg) -> Path:
    path = cfg.home / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != pid
    except ChildProcessError:
        return True


def stop_pid(pid: int, timeout: float = 30.0) -> bool:
    """SIGTERM, then SIGKILL after `timeout`; True when it was running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    return True


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])


def _state(cfg) -> dict:
    try:
        return json.loads((run_dir(cfg) / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def cmd_up(cfg, args) -> int:
    from infra.progress import status

    with status("gpupool up: starting") as step:
        return _up(cfg, args, lambda text: step(f"gpupool up: {text}"))


def _up(cfg, args, say) -> int:
    pid = supervisor_pid(cfg)
    if pid is not None:
        print(f"gpupool is already up (supervisor pid {pid}, home {cfg.home}); `gpupool down` first to change it")
        return 0
    if args.simulate:
        fleet_size(args.simulate)  # a bad fleet file is said now, in one line, before anything starts
    if args.workers < 1:
        raise SystemExit("gpupool up: --workers must be at least 1")
    if args.brokers is not None and not cfg.kafka:
        cfg = remember_brokers(cfg, args.brokers)
    ensure_broker(cfg, say)
    if args.simulate:  # one principal a simulated node, auto-admitted: starting the fleet is the operator's word
        from agents.node import fleet
        from agents.node.channels import ensure_fleet

        say("node principals for the simulated fleet (one a node, auto-admitted)")
        ensure_fleet(cfg, [inv.node for inv in fleet.load(args.simulate)])
    rd = run_dir(cfg)
    (rd / "state.json").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "agents.cli", "supervise", "--home", str(cfg.home), "--workers", str(args.workers)]
    if args.simulate:
        argv += ["--simulate", args.simulate]
    env = {**os.environ, "GPUPOOL_HOME": str(cfg.home)}
    if args.simulate:  # the fleet runs programs as the job user: their directories where that user reaches them
        from agents.node.runner import passable_roots

        try:
            env.update(passable_roots(cfg.home))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"gpupool up: {exc}") from None
    with open(rd / "supervisor.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    (rd / "supervisor.pid").write_text(str(proc.pid))
    try:
        _wait_up(cfg, proc, args, say)
    except SystemExit:
        stop_pid(proc.pid)
        (rd / "supervisor.pid").unlink(missing_ok=True)
        raise
    _default_prices(cfg, say)
    others = "".join(f", worker-{i + 1} on port {cfg.web_port + i}" for i in range(1, args.workers))
    print(f"gpupool up: kafka {cfg.bootstrap} (SASL{f', {cfg.kafka_brokers} brokers' if cfg.kafka_brokers > 1 else ''}), "
          f"worker http://{cfg.web_bind}:{cfg.web_port}{others}, home {cfg.home}; acting as {cfg.user}; a supervisor "
          f"(pid {proc.pid}) restarts what crashes")
    return 0


def remember_brokers(cfg, brokers: int):
    """Record the local cluster's size under the home: later commands (down, the CLI's clients) find it there."""
    from dataclasses import replace

    from infra.config import cluster_file

    if brokers < 1:
        raise SystemExit("gpupool up: --brokers must be at least 1")
    path = cluster_file(cfg.home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"brokers": brokers}))
    return replace(cfg, kafka_brokers=brokers)


def _fail_if_died(cfg, proc) -> None:
    if proc.poll() is not None:
        raise SystemExit(f"gpupool up: the supervisor exited ({proc.returncode}):\n"
                         f"{_tail(run_dir(cfg) / 'supervisor.log')}")
    for name, st in _state(cfg).items():
        if st.get("exits"):
            raise SystemExit(f"gpupool up: the {name} died at start (exit {st.get('last_exit')}); the end of "
                             f"{run_dir(cfg) / (name + '.log')}:\n{_tail(run_dir(cfg) / (name + '.log'))}")


def _wait_up(cfg, proc, args, say, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    c = Client(cfg)
    say("waiting for the worker (folds, gateway, scheduler, sink, API)")
    while not c.healthy():
        _fail_if_died(cfg, proc)
        if time.monotonic() > deadline:
            raise SystemExit(f"gpupool up: the worker did not answer in {timeout:.0f}s; the end of its log:\n"
                             f"{_tail(run_dir(cfg) / 'worker.log')}")
        time.sleep(0.5)
    if not args.simulate:
        return
    want = fleet_size(args.simulate)
    say(f"waiting for the simulated fleet's {want} node(s) to report")
    while True:
        _fail_if_died(cfg, proc)
        try:
            if c.api("/cluster/")["nodes"] >= want:
                return
        except SystemExit:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"gpupool up: the fleet did not report in {timeout:.0f}s; the end of its log:\n"
                             f"{_tail(run_dir(cfg) / 'agent.log')}")
        time.sleep(0.5)


def fleet_size(spec: str) -> int:
    from agents.node import fleet

    try:
        return len(fleet.load(spec))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"fleet {spec}: {type(exc).__name__}: {exc}") from None


def _default_prices(cfg, say) -> None:
    """The shipped price book, as events from the admin, the first time the pool has none."""
    c = Client(cfg, security.ADMIN)
    try:
        if c.api("/api/prices")["rows"]:
            return
    except SystemExit:
        return
    from agents.cli.requests import price_rows
    from importlib import resources

    say("loading the shipped price book (infra/prices.yaml)")
    c.send(price_rows(resources.files("infra").joinpath("prices.yaml").read_text()))


def cmd_down(cfg, args) -> int:
    stopped = []
    pid = supervisor_pid(cfg)
    if pid is not None and stop_pid(pid, timeout=60):
        stopped.append(f"supervisor {pid} (and the worker and fleet it ran)")
    (run_dir(cfg) / "supervisor.pid").unlink(missing_ok=True)
    if not cfg.kafka:
        broker = kafka_local.default_broker(cfg)
        bpid = broker.running_pid()
        broker.stop()
        if bpid:
            stopped.append(f"broker {bpid}")
    print("gpupool down: " + ("stopped " + "; ".join(stopped) if stopped else "nothing of this home was running"))
    return 0


# ---------------------------------------------------------------- the supervisor


class Supervisor:
    """Runs the stack's long-lived processes and restarts each that exits, with backoff; writes run/state.json."""

    def __init__(self, cfg, simulate: str | None, workers: int = 1):
        self.cfg = cfg
        self.components = {"worker": ["worker"]}
        self.env: dict[str, dict[str, str]] = {"worker": {}}
        for i in range(2, workers + 1):  # they share the partitions; the first alone has the sink and ClickHouse
            name = f"worker-{i}"
            self.components[name] = ["worker", "--no-sink", "--name", name]
            self.env[name] = {"GPUPOOL_WEB_PORT": str(cfg.web_port + i - 1)}
        if simulate:
            control = run_dir(cfg) / "faults"
            control.touch()
            self.components["agent"] = ["agent", "--simulate", simulate, "--control", str(control)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.state: dict[str, dict] = {name: {"exits": 0} for name in self.components}
        self.stopping = False

    def _spawn(self, name: str) -> None:
        log = open(run_dir(self.cfg) / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "agents.cli", *self.components[name]], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.env.get(name, {})})
        self.state[name].update(pid=self.procs[name].pid, started=time.time())

    def _save(self) -> None:
        tmp = run_dir(self.cfg) / "state.json.tmp"
        tmp.write_text(json.dumps(self.state))
        tmp.replace(run_dir(self.cfg) / "state.json")

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        for name in self.components:
            self._spawn(name)
        self._save()
        due: dict[str, float] = {}
        while not self.stopping:
            time.sleep(0.5)
            for name, proc in list(self.procs.items()):
                if name in due:
                    if time.monotonic() >= due[name]:
                        del due[name]
                        self._spawn(name)
                        self._save()
                    continue
                code = proc.poll()
                if code is None:
                    continue
                st = self.state[name]
                st["exits"] += 1
                st.update(last_exit=code, last_exit_at=time.time())
                backoff = RESTART_BACKOFF_S[min(st["exits"] - 1, len(RESTART_BACKOFF_S) - 1)]
                print(f"supervisor: {name} exited with {code}; restarting in {backoff}s", flush=True)
                due[name] = time.monotonic() + backoff
                self._save()
            if not self.cfg.kafka:
                broker = kafka_local.default_broker(self.cfg)
                if not broker.all_running():
                    print("supervisor: a local broker is not running; starting it", flush=True)
                    try:
                        broker.start()
                    except (RuntimeError, TimeoutError) as exc:
                        print(f"supervisor: the broker did not start: {exc}", flush=True)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        return 0


def cmd_supervise(cfg, args) -> int:
    return Supervisor(cfg, args.simulate, args.workers).run()


# ---------------------------------------------------------------- single processes


def cmd_kafka(cfg, args) -> int:
    broker = kafka_local.default_broker(cfg)
    if args.action == "fetch":
        print(kafka_local.fetch(cfg.home))
    elif args.action == "start":
        ensure_broker(cfg)
        print(f"kafka on {broker.bootstrap} (SASL/SCRAM-SHA-512; credentials under "
              f"{security.credentials_dir(cfg.home)})")
    elif args.action == "stop":
        broker.stop()
    return 0


def cmd_worker(cfg, args) -> int:
    from faust.worker import Worker as FaustWorker

    from streams.edge.app import Worker

    os.umask(0o077)  # what the worker writes (the embedded ClickHouse's parts, Faust's data): its user's only
    conn = security.kafka_conn(cfg, security.SERVICE)
    asyncio.run(kafka_local.ensure_topics(conn))
    w = Worker(cfg, with_scheduler=not args.no_scheduler, with_sink=not args.no_sink, name=args.name,
               brokers=asyncio.run(kafka_local.cluster_size(conn)))
    worker = FaustWorker(w.app, loglevel=args.loglevel, quiet=True)
    # Faust's start-up spinner sets the root logger to DEBUG for as long as the process lives (every library's debug
    # record is then made and handed to it): without the spinner the root logger stays at --loglevel
    worker.spinner = None
    worker.execute_from_commandline()
    return 0


def cmd_agent(cfg, args) -> int:
    from agents.node.sim_agent import SimFleetAgent

    if args.simulate == "inject":  # `gpupool agent inject FAULT...`: to the supervised fleet's control file
        path = Path(args.control) if args.control else run_dir(cfg) / "faults"
        with path.open("a") as f:
            for fault in args.faults:
                f.write(fault + "\n")
        print(f"{len(args.faults)} fault(s) sent to {path}")
        return 0
    if not args.simulate:
        from agents.node.nvml_agent import run_nvml_agent  # real cards
        return run_nvml_agent(cfg, args)
    try:
        agent = SimFleetAgent.from_spec(cfg, args.simulate, telemetry_interval_s=args.interval,
                                        group_id=args.group or None, faults=args.fault or [],
                                        principal=args.principal, control=Path(args.control) if args.control else None)
    except (OSError, ValueError) as exc:  # a bad fleet file or fault: one line naming it
        raise SystemExit(f"gpupool agent: {exc}") from None
    if not args.principal:  # each simulated node reports as its own principal, made now if missing (an operator)
        from agents.node.channels import ensure_fleet

        ensure_fleet(cfg, sorted(agent.nodes))
    from agents.node.nvml_agent import metrics_port

    agent.metrics.serve(metrics_port(args))

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


def cmd_demo(cfg, args) -> int:
    from agents.demo import run_demo
    return run_demo(cfg, args)
