"""The node relay: where a node agent's report becomes a fact. Pure; the worker's relay task (streams/edge/app.py) calls it.

A node agent writes only to its principal's channel (`gpupool.node.NAME`), which only that principal may write, so
the topic says who sent a record; the registry (principals topic) says which nodes the principal speaks for
(`gpupool user add NAME --role node --node NODE`). The relay then
- takes only what a node states (inventory, heartbeats, telemetry, its jobs' events and their programs' output,
  `job.log`): any other kind is `forbidden`;
- refuses a report about a node the principal does not speak for (`not_your_node`): the payload's node must be one of
  the principal's, and the record's source must be that node's (`NODE/...`), so no principal can move another node's
  per-source sequence numbers either;
- refuses a job event (started, checkpointed, completed, failed, stopped, a replica's ready, unready or metrics) or a
  job's log (`job.log`) about a job the
  scheduler never placed on that node (`not_your_node`), by the placement commands it read (`Placements`): a node
  writes only its own jobs' logs;
- stamps an inventory with its principal (`actor`): the node view then holds the node to admission
  (`node.admitted`, docs/security.md), unless the principal is auto-admitted, for which the relay states the
  admission itself (`admission`).
What it relays goes, unchanged otherwise, to the kind's home topic; what it refuses goes to the dead letters, and is
counted (`/stats/` relay, the `gpupool_dead_letters{reason}` metric).
"""
from __future__ import annotations

from dataclasses import dataclass

from schemas.envelope import DecodeError, Envelope, decode_fast, encode, envelope
from schemas.events import MigrateJob, NodeAdmitted, PlaceJob, ResizeJob

NODE_KINDS = frozenset({"node.inventory", "node.heartbeat", "gpu.telemetry"})
JOB_EVENT_KINDS = frozenset({"job.started", "job.checkpointed", "job.completed", "job.failed", "job.stopped"})
# what a node says of a serving replica it runs (docs/serving.md): about one job, relayed only for a job placed there
REPLICA_KINDS = frozenset({"replica.ready", "replica.unready", "replica.metrics"})
JOB_KINDS = JOB_EVENT_KINDS | REPLICA_KINDS | {"job.log"}  # about one job: relayed only for a job placed on the node
RELAYED_KINDS = NODE_KINDS | JOB_KINDS
ADMISSION_SOURCE = "admission/"


@dataclass(frozen=True)
class Verdict:
    env: Envelope | None = None  # what to relay (None: refused)
    raw: bytes | None = None  # its bytes: the node's own, or re-encoded with the principal stamped
    code: str = ""  # the refusal's reason
    detail: str = ""

    @property
    def job_check(self) -> tuple[str, str] | None:
        """(job id, node) a relayed job event or log must be placed on, for the caller to check against Placements."""
        if self.env is None or self.env.kind not in JOB_KINDS:
            return None
        return self.env.payload.job_id, self.env.payload.node


def check(principal, owner: str, raw: bytes | None) -> Verdict:
    """Decide one channel record. `principal`: the registry's entry for the channel's owner (None: unknown)."""
    try:
        env = decode_fast(raw)  # the same answer as decode, in one pass for a current record
    except DecodeError as exc:
        return Verdict(code=exc.code, detail=exc.detail)
    if principal is None or principal.role != "node":
        return Verdict(code="unknown_principal", detail=f"{owner!r} is not a registered node principal")
    if env.kind not in RELAYED_KINDS:
        return Verdict(code="forbidden", detail=f"a node principal may not state {env.kind}")
    node = env.payload.node
    if node not in principal.nodes:
        return Verdict(code="not_your_node", detail=f"{owner} speaks for {', '.join(principal.nodes) or 'no node'}, "
                                                    f"not {node!r} ({env.kind})")
    if not env.source.startswith(f"{node}/"):
        return Verdict(code="not_your_node", detail=f"source {env.source!r} is not node {node!r}'s")
    if env.kind == "node.inventory":
        env = env.model_copy(update={"actor": owner})
        return Verdict(env=env, raw=encode(env))
    return Verdict(env=env, raw=raw)


def admission(principal, env: Envelope, time_ms: int) -> Envelope | None:
    """The relay's own admission of a node it relays an inventory of, when the principal is auto-admitted: stated
    once per node (seq 1: a restated one is a duplicate), so an operator's later revocation stands."""
    if env.kind != "node.inventory" or not principal.auto_admit:
        return None
    node = env.payload.node
    return envelope(NodeAdmitted(node=node, admitted=True,
                                 reason=f"auto-admitted: principal {principal.name} is registered for it"),
                    source=f"{ADMISSION_SOURCE}{node}", seq=1, time_ms=time_ms, actor=principal.name,
                    causation_id=env.event_id)


class Placements:
    """Which nodes the scheduler ever told to run each job (cmd.place, cmd.resize, both ends of cmd.migrate), from
    the commands topic: a node reports only on jobs placed on it. Never forgets a placement: a late report of an
    old run is the job view's to discount (it knows superseded runs), not a forgery."""

    def __init__(self):
        self.nodes_of: dict[str, set[str] | str] = {}

    def fold(self, env: Envelope) -> None:
        p = env.payload
        if isinstance(p, (PlaceJob, ResizeJob)):
            self._add(p.job_id, p.node)
        elif isinstance(p, MigrateJob):
            self._add(p.job_id, p.from_node)
            self._add(p.job_id, p.to_node)

    def _add(self, job: str, node: str) -> None:
        had = self.nodes_of.get(job)
        if had is None:
            self.nodes_of[job] = node  # one node, the common case: a str, not a set
        elif isinstance(had, str):
            if had != node:
                self.nodes_of[job] = {had, node}
        else:
            had.add(node)

    def placed(self, job: str, node: str) -> bool:
        had = self.nodes_of.get(job)
        return had == node if isinstance(had, str) or had is None else node in had
