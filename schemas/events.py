"""Event and command contracts: frozen pydantic v2 models in one discriminated union on `kind`.

Quantities are integers: milli-GPU, milli-CPU, MiB, milliseconds. A compute unit (CU) is defined in
schemas/gpu_models.py: 1000 milli-CU = one A100-class GPU's dense throughput.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from schemas.money import DEFAULT_CURRENCY, Currency
from schemas.program import IMAGE_REF, RETRIES_MAX, Mount, Serve, program_problem

# Integers are integers: `true`, `1.0` and `"1"` are refused where a number is expected (pydantic's lax mode took
# `true` as 1), as a quantity in milli-GPU or MiB must be exact.
Int = Annotated[int, Strict()]
NonNeg = Annotated[int, Strict(), Field(ge=0)]
GRACE_MAX_S = 3600  # the longest grace period an operator may give a tier (GPUPOOL_GRACE_S)
Pos = Annotated[int, Strict(), Field(gt=0)]
# An id (a job, node, card, reservation, service, principal, reason code...): 1 to 200 characters, each a letter, mark,
# digit, punctuation or symbol (Unicode categories L, M, N, P, S). No white space, no control characters, no format
# characters (bidi overrides such as U+202E, zero-width characters, the BOM): an id is printed in tables and logs, and
# must read there as it was written (docs/producing-jobs.md, "Ids").
ID_MAX = 200
ID_PATTERN = r"^[^\p{C}\p{Z}]+$"
Ident = Annotated[str, Field(min_length=1, max_length=ID_MAX, pattern=ID_PATTERN)]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Tier(StrEnum):
    """Seed 001's three tiers; lower value = more important."""
    INFERENCE = "inference"
    ONLINE_TRAINING = "online-training"
    OFFLINE = "offline"  # offline training and batch inference: preemptible


TIER_RANK = {Tier.INFERENCE: 0, Tier.ONLINE_TRAINING: 1, Tier.OFFLINE: 2}

# How a job is isolated from others on a card: "shared" a software share of a card (or a MIG instance: never less
# isolation than asked), "mig" a hardware slice only (a free MIG instance or one carved out of idle slices, never a
# software share), "exclusive" whole cards only (no share, no MIG). docs/scheduler.md, "Isolation".
Isolation = Literal["shared", "mig", "exclusive"]
# A request that says nothing gets its tier's default (the documented table): every tier shares by default, so that a
# request asks for isolation rather than being kept waiting for it.
DEFAULT_ISOLATION: dict[Tier, str] = {Tier.INFERENCE: "shared", Tier.ONLINE_TRAINING: "shared",
                                      Tier.OFFLINE: "shared"}


class Reason(Frozen):
    """A machine-readable explanation: which check said what, about what."""
    code: Ident
    message: str = ""
    plugin: str = ""
    nodes: tuple[str, ...] = ()
    data: dict[str, int | str] = {}


# ---------------------------------------------------------------- inventory and health

class MigInstance(Frozen):
    uuid: Ident
    profile: Ident  # e.g. "1g.10gb"
    start: NonNeg  # first memory slice of the placement
    size: Pos  # memory slices
    job_id: str | None = None


class GpuCard(Frozen):
    uuid: Ident
    index: NonNeg
    model: Ident
    memory_mib: Pos
    compute_capability: str = "8.0"
    nvlink_domain: str | None = None
    nvlink_peers: tuple[str, ...] = ()
    pci_bus: str = ""
    numa_node: Int = 0
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_profiles: tuple[str, ...] = ()
    mig_layout: tuple[MigInstance, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    firmware_version: str = ""


class NodeInventory(Frozen):
    kind: Literal["node.inventory"] = "node.inventory"
    node: Ident
    rack: str = "rack-0"
    datacenter: str = "dc-0"
    cpu_milli: NonNeg
    memory_mib: NonNeg
    gpus: tuple[GpuCard, ...] = ()
    labels: dict[str, str] = {}
    # The address the node's programs are reached at by the other parts of a gang (the rendezvous master's address,
    # docs/jobs.md "Gangs"): an IP address or host name the node advertises (GPUPOOL_NODE_ADDRESS on a real node, a
    # distinct loopback address per node in the simulated fleet). "": not said (a node from before gangs rendezvous);
    # a gang whose rank 0 is on such a node is told its node name. Serving replicas are reached there too
    # (docs/serving.md; "": 127.0.0.1).
    address: Annotated[str, Field(max_length=253, pattern=r"^[A-Za-z0-9.:_-]*$")] = ""


class NodeHeartbeat(Frozen):
    kind: Literal["node.heartbeat"] = "node.heartbeat"
    node: Ident


class GpuSample(Frozen):
    gpu_uuid: Ident
    mig_uuid: str | None = None
    util_pct: Annotated[int, Strict(), Field(ge=0, le=100)]
    mem_used_mib: NonNeg
    mem_total_mib: NonNeg
    temperature_c: Int = 0
    power_mw: NonNeg = 0
    ecc_corrected: NonNeg = 0
    ecc_uncorrected: NonNeg = 0
    xid_errors: tuple[Int, ...] = ()
    job_ids: tuple[Ident, ...] = ()  # as a job id anywhere: the minute history (JobMinute) takes them as they are
    fault: str = ""  # a fault the node agent saw on the card (an NVML read error, retired pages...): out of service


class GpuTelemetry(Frozen):
    kind: Literal["gpu.telemetry"] = "gpu.telemetry"
    node: Ident
    samples: tuple[GpuSample, ...]


class NodeCordon(Frozen):
    kind: Literal["node.cordon"] = "node.cordon"
    node: Ident
    cordoned: bool = True
    drain: bool = False
    reason: str = ""


class NodeLiveness(Frozen):
    """Emitted by the telemetry fold when a node's liveness flips (2 missed heartbeats)."""
    kind: Literal["node.liveness"] = "node.liveness"
    node: Ident
    alive: bool
    last_heartbeat_ms: NonNeg = 0


class GpuHealth(Frozen):
    """A card removed from (or returned to) service; `cleared` events come from an operator."""
    kind: Literal["gpu.health"] = "gpu.health"
    node: Ident
    gpu_uuid: Ident
    healthy: bool
    reason: str = ""


# ---------------------------------------------------------------- jobs

class Constraints(Frozen):
    models: tuple[str, ...] = ()  # allowed models; empty = any
    min_compute_capability: str | None = None
    mig_allowed: bool = True
    interconnect: Literal["any", "nvlink"] = "any"  # "nvlink": a multi-card job must stay inside one NVLink domain
    # The widest spread a multi-card gang accepts: one node, one NVLink domain, one rack, one data center, or any.
    max_spread: Literal["node", "nvlink", "rack", "datacenter", "any"] = "datacenter"
    datacenter: str | None = None
    min_driver: str | None = None
    min_cuda: str | None = None


class JobRequested(Frozen):
    kind: Literal["job.requested"] = "job.requested"
    job_id: Ident
    tenant: Ident
    project: Ident = "default"
    tier: Tier = Tier.OFFLINE
    # What the user asks for: compute units (milli-CU) and GPU memory, never a card model. Both 0: a CPU-only job
    # (data preparation, evaluation, a tokenizer): no card, only the host's CPU and memory (`cpu_only`).
    compute_milli: NonNeg
    gpu_memory_mib: NonNeg
    cpu_milli: NonNeg = 1000
    memory_mib: NonNeg = 1024
    gang: bool = True  # several cards: all or nothing
    constraints: Constraints = Constraints()
    duration_s: NonNeg | None = None  # simulation: how long the work runs
    checkpoint_interval_s: NonNeg = 0
    latency_sensitive: bool = False  # inference that wants the newest generation and memory-rich units
    reservation_id: str | None = None  # consume capacity booked by this reservation
    service_id: str | None = None  # a replica of this inference service (set by the autoscaler)
    isolation: Isolation | None = None  # None: the tier's default (DEFAULT_ISOLATION)
    # The program (schemas/program.py, docs/jobs.md): the argv the node runs (never through a shell), in `image`
    # when given (an OCI container), else as a plain process; no command: the simulated stand-in run of duration_s.
    image: Annotated[str, Field(pattern=IMAGE_REF)] | None = None
    command: tuple[str, ...] = ()
    env: dict[str, str] = {}
    workdir: str = ""
    volumes: tuple[Mount, ...] = ()
    retries: Annotated[int, Strict(), Field(ge=0, le=RETRIES_MAX)] = 0  # a failed run is requeued this many times
    serve: Serve | None = None  # a serving replica (its service's, set by the autoscaler): port, readiness, metrics

    @model_validator(mode="after")
    def _mig_needs_mig(self):
        if (self.compute_milli == 0) != (self.gpu_memory_mib == 0):
            raise ValueError("compute_milli and gpu_memory_mib: both positive (a GPU job), or both 0 (a CPU-only job)")
        if self.cpu_only:
            if not self.cpu_milli:
                raise ValueError("a CPU-only job (compute_milli 0) asks for CPU: cpu_milli > 0")
            if self.isolation not in (None, "shared") or self.service_id is not None or \
                    self.reservation_id is not None:
                raise ValueError("a CPU-only job (compute_milli 0) has no card: no isolation, service or "
                                 "reservation")
        if self.isolation == "mig" and not self.constraints.mig_allowed:
            raise ValueError("isolation 'mig' with constraints.mig_allowed false: no slice could serve it")
        why = program_problem(self.command, self.env, self.workdir, self.volumes, self.image)
        if why:
            raise ValueError(why)
        if self.serve is not None and self.service_id is None:
            raise ValueError("serve: only a replica of an inference service serves (service_id)")
        return self

    @property
    def program(self) -> dict:
        """The program's fields as a placement carries them (PlaceJob)."""
        return {"image": self.image, "command": self.command, "env": self.env, "workdir": self.workdir,
                "volumes": self.volumes, "serve": self.serve}

    @property
    def isolation_asked(self) -> str:
        """What isolation the job gets: as asked, else its tier's default (a CPU-only job: the host, shared)."""
        return self.isolation or ("shared" if not self.compute_milli else DEFAULT_ISOLATION[self.tier])

    @property
    def cpu_only(self) -> bool:
        """No card asked for: the job takes only a node's CPU and host memory."""
        return not self.compute_milli


class JobCancelled(Frozen):
    kind: Literal["job.cancelled"] = "job.cancelled"
    job_id: Ident
    reason: str = ""


class JobScaleRequested(Frozen):
    kind: Literal["job.scale_requested"] = "job.scale_requested"
    job_id: Ident
    compute_milli: Pos
    gpu_memory_mib: Pos


class JobStarted(Frozen):
    kind: Literal["job.started"] = "job.started"
    job_id: Ident
    node: Ident
    command_id: Ident


class JobCheckpointed(Frozen):
    kind: Literal["job.checkpointed"] = "job.checkpointed"
    job_id: Ident
    node: Ident
    progress_ms: NonNeg
    checkpoint: str = ""
    command_id: str | None = None


class JobCompleted(Frozen):
    """One run of one part ended by exiting 0. A job of one part is then done; a gang (`parts` > 1) is done when every
    part of the run completed (docs/jobs.md, "Gangs")."""
    kind: Literal["job.completed"] = "job.completed"
    job_id: Ident
    node: Ident
    command_id: Ident
    attempt: NonNeg = 0  # the run (0: not said, a node from before gangs)
    part: NonNeg = 0  # the gang part (gang_index) that completed
    parts: Pos = 1  # the gang's parts in that run (gang_size)


# Why a run ended other than by completing: a closed vocabulary (docs/jobs.md, "Exit reasons"); `reason` says it in
# words, with the details (the exit code, the signal, the image, the share).
EXIT_CODES = ("ExitCode", "Signal", "OOMKilled", "ImageNotFound", "CommandNotFound", "ShareExceeded", "StartFailed",
              "VolumeUnavailable", "Simulated")
ExitReason = Literal["ExitCode", "Signal", "OOMKilled", "ImageNotFound", "CommandNotFound", "ShareExceeded",
                     "StartFailed", "VolumeUnavailable", "Simulated"]


class JobFailed(Frozen):
    kind: Literal["job.failed"] = "job.failed"
    job_id: Ident
    node: str = ""
    reason: str
    command_id: str | None = None
    code: ExitReason | None = None  # None: a report from before exit reasons (v1), read as ExitCode
    exit_code: Int | None = None
    signal: Int | None = None
    attempt: NonNeg = 0  # the run that ended (0: not said)
    part: NonNeg = 0  # the gang part (gang_index) that ended


class JobLog(Frozen):
    """A piece of a run's standard output or error, as the node agent read it (docs/jobs.md, "Logs"). A node writes
    only its own jobs' logs; `seq` counts a stream's pieces from 0, so a reader puts them in order and sees gaps;
    `dropped_bytes` says how much the caps cut before this piece (a truncation is marked, never silent)."""
    kind: Literal["job.log"] = "job.log"
    job_id: Ident
    node: Ident
    attempt: NonNeg = 0
    part: NonNeg = 0
    stream: Literal["stdout", "stderr"] = "stdout"
    seq: NonNeg = 0
    text: Annotated[str, Field(max_length=16384)] = ""
    dropped_bytes: NonNeg = 0
    final: bool = False  # the last piece of this stream of this run


class JobStopped(Frozen):
    """The node agent stopped the job on a preempt command (after checkpointing), or of its own accord: the agent
    shut down or restarted (`reason` says which; `command_id` is then the placement's). The job resumes from
    `checkpoint`."""
    kind: Literal["job.stopped"] = "job.stopped"
    job_id: Ident
    node: Ident
    command_id: Ident
    progress_ms: NonNeg = 0
    checkpoint: str = ""
    reason: str = ""


# ---------------------------------------------------------------- scheduler commands

class Assignment(Frozen):
    """One slice of one card given to a job."""
    gpu_uuid: Ident
    milli: Annotated[int, Strict(), Field(gt=0, le=1000)]  # share of the card
    memory_mib: Pos
    mig_profile: str | None = None
    mig_uuid: str | None = None  # the MIG instance, when the slice is one


class PlaceJob(Frozen):
    kind: Literal["cmd.place"] = "cmd.place"
    command_id: Ident
    job_id: Ident
    tenant: Ident
    node: Ident
    assignments: tuple[Assignment, ...]
    cpu_milli: NonNeg = 0
    memory_mib: NonNeg = 0
    duration_s: NonNeg | None = None
    checkpoint_interval_s: NonNeg = 0
    resume_from: str = ""
    borrowed: bool = False
    # A gang spread over several nodes gets one cmd.place per node: all share the job id, each names its part.
    gang_size: Pos = 1
    gang_index: NonNeg = 0
    gang_nodes: tuple[str, ...] = ()
    reasons: tuple[Reason, ...] = ()
    # the program (schemas/program.py), as the request gave it
    image: str | None = None
    command: tuple[str, ...] = ()
    env: dict[str, str] = {}
    workdir: str = ""
    volumes: tuple[Mount, ...] = ()
    serve: Serve | None = None  # a serving replica: the node gives it a port, probes it, scrapes its metrics
    tier: Tier = Tier.OFFLINE  # whose grace period a stop the node starts itself waits out
    # The placement's number among the job's placements (1, 2, ...: each requeue places it anew). Every command
    # about the run names it; a node refuses a placement older than one it knows superseded (agents/node/fencing.py).
    # 0: not numbered (a producer that predates attempts).
    attempt: NonNeg = 0
    # The rendezvous of a job's parts (docs/jobs.md, "Gangs"): rank 0's node address (its inventory's `address`,
    # else its name) and a port the scheduler chose for this attempt from the operator's range (SchedulerTick
    # .rendezvous_ports), the same in every part's placement. "" / 0: none given (a job without a program).
    master_addr: str = ""
    master_port: Annotated[int, Strict(), Field(ge=0, le=65535)] = 0


class ResizeJob(Frozen):
    kind: Literal["cmd.resize"] = "cmd.resize"
    command_id: Ident
    job_id: Ident
    node: Ident
    assignments: tuple[Assignment, ...]
    reasons: tuple[Reason, ...] = ()
    attempt: NonNeg = 0  # the run it resizes (0: whichever runs)


class PreemptJob(Frozen):
    kind: Literal["cmd.preempt"] = "cmd.preempt"
    command_id: Ident
    job_id: Ident
    node: Ident
    grace_s: NonNeg = 30  # the stopped job's tier's grace (docs/jobs.md, "Stops and grace periods")
    reasons: tuple[Reason, ...] = ()
    attempt: NonNeg = 0  # the run it stops, or an older one (0: whichever runs)


class MigrateJob(Frozen):
    kind: Literal["cmd.migrate"] = "cmd.migrate"
    command_id: Ident
    job_id: Ident
    from_node: Ident
    to_node: Ident
    assignments: tuple[Assignment, ...]
    reasons: tuple[Reason, ...] = ()
    attempt: NonNeg = 0
    grace_s: NonNeg = 30  # the moved job's tier's grace: SIGTERM, this long to checkpoint and exit, then SIGKILL


class MigReconfigure(Frozen):
    kind: Literal["cmd.mig_reconfigure"] = "cmd.mig_reconfigure"
    command_id: Ident
    node: Ident
    gpu_uuid: Ident
    layout: tuple[MigInstance, ...]
    reasons: tuple[Reason, ...] = ()


class ReleaseJob(Frozen):
    kind: Literal["cmd.release"] = "cmd.release"
    command_id: Ident
    job_id: Ident
    node: Ident
    reasons: tuple[Reason, ...] = ()
    attempt: NonNeg = 0  # the run it ends, and every older one (0: whichever runs)


class JobPending(Frozen):
    """Why a job still waits, as data; emitted when the reason changes."""
    kind: Literal["job.pending"] = "job.pending"
    job_id: Ident
    reasons: tuple[Reason, ...]


class Rejected(Frozen):
    kind: Literal["job.rejected"] = "job.rejected"
    job_id: Ident
    code: Ident
    reasons: tuple[Reason, ...] = ()


class RequestRejected(Frozen):
    """The gateway's answer to a request it did not let in (a job request's answer is `job.rejected` instead):
    which request (`request_id`: inbox and offset), from whom, about what, and why."""
    kind: Literal["request.rejected"] = "request.rejected"
    request_id: Ident
    principal: Ident
    request_kind: str = ""
    subject: str = ""  # the reservation, service, node or tenant the request names
    code: Ident
    message: str = ""


DEFAULT_RENDEZVOUS_PORTS = (29500, 29999)  # torchrun's default master port and the 499 above it


class SchedulerTick(Frozen):
    """A cycle tick: time enters the scheduler only through its input log. `grace_s`: the operator's grace period per
    tier (GPUPOOL_GRACE_S, docs/jobs.md "Stops and grace periods") as the ticker read it, so the grace a stop waits
    is on the log the scheduler and every replay read; empty (a ticker that predates it): the grace stays as it was."""
    kind: Literal["scheduler.tick"] = "scheduler.tick"
    now_ms: NonNeg
    grace_s: dict[Tier, Annotated[int, Strict(), Field(ge=0, le=GRACE_MAX_S)]] = {}
    # the operator's rendezvous port range (GPUPOOL_RENDEZVOUS_PORTS, first and last, inclusive) a gang's master port
    # is chosen from; empty (a ticker that predates it): the range stays as it was (DEFAULT_RENDEZVOUS_PORTS at first)
    rendezvous_ports: tuple[Annotated[int, Strict(), Field(ge=1, le=65535)], ...] = ()

    @model_validator(mode="after")
    def _port_range(self):
        r = self.rendezvous_ports
        if r and (len(r) != 2 or r[0] > r[1]):
            raise ValueError("rendezvous_ports: (first, last) with first <= last")
        return self


# ---------------------------------------------------------------- reservations

class ReservationRequested(Frozen):
    """Capacity booked for a start time (seed 000): held idle from `start_ms` until a job names the reservation or
    `end_ms` passes. Conflicts are decided by tier, then by booking time (the earlier booking locks harder)."""
    kind: Literal["reservation.requested"] = "reservation.requested"
    reservation_id: Ident
    tenant: Ident
    project: Ident = "default"
    tier: Tier = Tier.ONLINE_TRAINING
    compute_milli: Pos
    gpu_memory_mib: Pos
    cpu_milli: NonNeg = 0
    memory_mib: NonNeg = 0
    constraints: Constraints = Constraints()
    start_ms: NonNeg
    end_ms: NonNeg


class ReservationCancelled(Frozen):
    kind: Literal["reservation.cancelled"] = "reservation.cancelled"
    reservation_id: Ident


class ReservationDecided(Frozen):
    """The scheduler's answer about a reservation: accepted, rejected, displaced (by a stronger one), active (capacity
    held on a node), used (a job took it), expired."""
    kind: Literal["reservation.decided"] = "reservation.decided"
    reservation_id: Ident
    status: Literal["accepted", "rejected", "displaced", "active", "used", "expired", "cancelled"]
    node: str = ""
    reasons: tuple[Reason, ...] = ()
    # active: the cards the hold keeps (on `node`, and a gang hold's other nodes): in the scheduler's own view only --
    # nothing is sent to a node -- so the readers of the node views (node list, cluster) learn of it here
    assignments: tuple[Assignment, ...] = ()


# ---------------------------------------------------------------- inference services

class ServiceDeclared(Frozen):
    """A long-running, replicated inference service with an SLO. Re-declaring it replaces the spec."""
    kind: Literal["service.declared"] = "service.declared"
    service_id: Ident
    tenant: Ident
    project: Ident = "default"
    replica_compute_milli: Pos  # one replica's compute at its base size
    replica_memory_mib: Pos
    boost_compute_milli: NonNeg = 0  # extra compute a vertical boost adds to a replica (0: no vertical step)
    replica_qps: Pos  # requests/s one base-size replica serves within the SLO
    min_replicas: NonNeg = 1
    max_replicas: Pos = 64
    latency_target_ms: Pos = 500  # the SLO: p99 latency
    max_queue: NonNeg = 100
    latency_sensitive: bool = True
    constraints: Constraints = Constraints()
    # the service's own scale-in windows (Kubernetes HPA's scaleDown stabilization window); None: the pool's
    # (ElasticConfig scale_in_stable_ms / scale_in_cooldown_ms, 5 minutes each)
    scale_in_stable_s: NonNeg | None = None
    scale_in_cooldown_s: NonNeg | None = None
    # The replicas' program (schemas/program.py, as a job's): none, a stand-in replica that serves nothing. With
    # `serve`, each replica listens on a port, is counted ready once its readiness probe answers, and its endpoint is
    # served to the tenant and to the router (docs/serving.md); `serve.metrics` names whose Prometheus series the node
    # scrapes into the service's load.
    image: Annotated[str, Field(pattern=IMAGE_REF)] | None = None
    command: tuple[str, ...] = ()
    env: dict[str, str] = {}
    serve: Serve | None = None

    @model_validator(mode="after")
    def _program(self):
        why = program_problem(self.command, self.env, "", (), self.image)
        if why:
            raise ValueError(why)
        return self


class ReplicaReady(Frozen):
    """A node's word that a serving replica it runs answers its readiness probe: where it is reached. Relayed only
    for a job placed on that node (streams/folds/node_relay.py)."""
    kind: Literal["replica.ready"] = "replica.ready"
    job_id: Ident
    node: Ident
    command_id: Ident  # the placement (cmd.place) of the run
    attempt: NonNeg = 0
    address: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_-]+$")]
    port: Annotated[int, Field(ge=1, le=65535, strict=True)]


class ReplicaUnready(Frozen):
    """A node's word that a replica takes no more traffic: its probe failed, or it is drained before a stop."""
    kind: Literal["replica.unready"] = "replica.unready"
    job_id: Ident
    node: Ident
    command_id: Ident
    attempt: NonNeg = 0
    reason: Literal["probe_failed", "draining", "ended"] = "probe_failed"
    drain_ms: NonNeg = 0  # draining: how long the node waits before it signals the program to stop


class ReplicaMetrics(Frozen):
    """One scrape of a replica's Prometheus endpoint by its node (agents/node/scrape.py), in integers: counters as
    read (cumulative; the fold takes differences), gauges as read. The autoscaler folds them into the service's
    `inference.load` (streams/folds/serving.py)."""
    kind: Literal["replica.metrics"] = "replica.metrics"
    job_id: Ident
    node: Ident
    command_id: Ident
    attempt: NonNeg = 0
    scraped_ms: NonNeg  # the node's time of the scrape: counters' rates are over the replica's own clock
    requests_total: NonNeg = 0  # finished requests, cumulative
    running: NonNeg = 0  # requests being served now
    waiting: NonNeg = 0  # requests queued
    # the end-to-end latency histogram, cumulative: (upper bound in ms, count of requests at or under it), finite
    # buckets in increasing order; latency_count counts every request (the +Inf bucket)
    latency_buckets: tuple[tuple[NonNeg, NonNeg], ...] = ()
    latency_count: NonNeg = 0
    latency_sum_ms: NonNeg = 0
    kv_cache_permille: Annotated[int, Strict(), Field(ge=0, le=1000)] = 0


class ServiceRemoved(Frozen):
    kind: Literal["service.removed"] = "service.removed"
    service_id: Ident


class InferenceLoad(Frozen):
    """Load of one service (replica empty) or one replica: what the autoscaler reads."""
    kind: Literal["inference.load"] = "inference.load"
    service_id: Ident
    replica: str = ""
    qps: Annotated[int, Strict(), Field(ge=0)]  # requests/s, integer
    p50_ms: NonNeg = 0
    p99_ms: NonNeg = 0
    queue_depth: NonNeg = 0
    util_pct: Annotated[int, Strict(), Field(ge=0, le=100)] = 0


class ServiceScaled(Frozen):
    """One autoscaler action with its trigger and, once done, how long it took."""
    kind: Literal["service.scaled"] = "service.scaled"
    service_id: Ident
    action: Literal["vertical_up", "horizontal_up", "traffic_shift", "vertical_revert", "scale_in", "shrink"]
    replicas: NonNeg
    jobs: tuple[str, ...] = ()
    took_ms: NonNeg = 0
    reasons: tuple[Reason, ...] = ()


# ---------------------------------------------------------------- principals (docs/security.md)

class PrincipalRegistered(Frozen):
    """Who a broker principal is: its role, its tenant (tenant role only) and the SHA-256 of its HTTP token. Written by
    an operator (`gpupool user add`) to the compacted principals topic, keyed by name."""
    kind: Literal["principal.registered"] = "principal.registered"
    name: Ident
    role: Literal["tenant", "operator", "finance", "auditor", "node", "service"]
    tenant: str | None = None
    token_sha256: str = ""
    # node role only: the nodes it speaks for (its channel `gpupool.node.NAME` carries their reports and nothing
    # else), and whether a node of them is admitted to the pool when first heard (else an operator admits it)
    nodes: tuple[Ident, ...] = ()
    auto_admit: bool = False


class PrincipalRemoved(Frozen):
    kind: Literal["principal.removed"] = "principal.removed"
    name: Ident


# ---------------------------------------------------------------- quota and ledger

class QuotaSet(Frozen):
    kind: Literal["quota.set"] = "quota.set"
    tenant: Ident
    project: str | None = None  # None: the tenant level
    gpu_milli: NonNeg  # quota in milli-CU
    gpu_memory_mib: NonNeg | None = None  # GPU-memory quota (None: memory is not limited at this level)
    overcommit_pct: Annotated[int, Strict(), Field(ge=100, le=300)] = 120


class QuotaChanged(Frozen):
    kind: Literal["quota.changed"] = "quota.changed"
    tenant: Ident
    project: str | None = None
    used_milli: NonNeg
    reserved_milli: NonNeg = 0  # of used_milli, what reservation holds keep idle
    borrowed_milli: NonNeg = 0
    used_memory_mib: NonNeg = 0
    job_id: str | None = None


class QuotaBorrowed(Frozen):
    kind: Literal["quota.borrowed"] = "quota.borrowed"
    tenant: Ident
    job_id: Ident
    milli: Pos


class QuotaReturned(Frozen):
    kind: Literal["quota.returned"] = "quota.returned"
    tenant: Ident
    job_id: Ident
    milli: Pos


class PriceSet(Frozen):
    """One row of the price book (docs/billing.md): the price of one whole GPU of a model for one hour, in micro-units
    of `currency` (ISO 4217; a row written before prices carried one is in USD), from `valid_from_ms` on. '*' in
    datacenter, tod_band or tier matches any value; a later row for the same key supersedes an earlier one from its
    own valid_from on (old bills stay as they were)."""
    kind: Literal["price.set"] = "price.set"
    gpu_model: Ident
    datacenter: str = "*"
    tod_band: Literal["*", "peak", "offpeak"] = "*"
    tier: Literal["*", "inference", "online-training", "offline"] = "*"
    borrowed: bool = False
    micro_per_gpu_hour: NonNeg
    valid_from_ms: NonNeg = 0
    currency: Currency = DEFAULT_CURRENCY


class UsageAccrued(Frozen):
    """GPU time one job used on one node between two event times; the unit of billing."""
    kind: Literal["usage.accrued"] = "usage.accrued"
    tenant: Ident
    project: Ident
    job_id: Ident
    tier: Tier
    node: Ident
    gpu_model: Ident
    datacenter: str
    start_ms: NonNeg
    end_ms: NonNeg
    gpu_milli: NonNeg  # milli-GPUs held during the interval (sum over assignments)
    gpu_milli_ms: NonNeg  # gpu_milli * (end_ms - start_ms): exact; GPU-seconds = gpu_milli_ms / 1e6
    borrowed: bool = False
    # What the quota ledger charged for the same holding, in its unit (milli-CU: the model's compute units for the
    # share, MIG slice or whole cards held, docs/billing.md), and that times the interval.
    cu_milli: NonNeg = 0
    cu_milli_ms: NonNeg = 0
    reserved: bool = False  # run on the tenant's own reservation: reserved in-quota capacity, never borrowed
    attempt: NonNeg = 0  # the run (placement) it bills: a run's intervals follow each other without overlap


# ---------------------------------------------------------------- telemetry history (docs/observability.md)

class JobMinute(Frozen):
    """What one job took of one card (or MIG instance) in one minute: the card's samples that named it, and its
    part of the card's utilization and memory (a sample naming n jobs gives each 1/n of it)."""
    job_id: Ident
    tenant: str = ""
    tier: str = ""  # the job's tier when the worker knew it ("" otherwise)
    samples: Pos
    util_permille: NonNeg  # mean over the minute's samples, permille of the card (1000 = 100 % busy)
    mem_used_mib: NonNeg  # mean


class CardMinute(Frozen):
    """One card's (or one MIG instance's) minute: mean and max of each gauge, the ECC counters' latest values."""
    gpu_uuid: Ident
    mig_uuid: str = ""  # "" for the whole card
    gpu_model: str = ""
    samples: Pos
    util_mean_permille: NonNeg
    util_max_pct: Annotated[int, Strict(), Field(ge=0, le=100)]
    mem_used_mean_mib: NonNeg
    mem_used_max_mib: NonNeg
    mem_total_mib: NonNeg
    temperature_mean_c: Int = 0
    temperature_max_c: Int = 0
    power_mean_mw: NonNeg = 0
    power_max_mw: NonNeg = 0
    ecc_corrected: NonNeg = 0
    ecc_uncorrected: NonNeg = 0
    xid_errors: tuple[Int, ...] = ()
    jobs: tuple[JobMinute, ...] = ()


class TelemetryMinute(Frozen):
    """One node's closed minute of telemetry, downsampled by the worker's fold (streams/folds/telemetry_history.py) on the
    log's time: the minute [minute_ms, minute_ms + 60 s) of broker append times of its telemetry records."""
    kind: Literal["telemetry.minute"] = "telemetry.minute"
    node: Ident
    datacenter: str = ""
    minute_ms: NonNeg
    cards: tuple[CardMinute, ...]


class PoolMinute(Frozen):
    """The pool at the end of one minute of log time, as the worker's node and job views held it: capacity,
    allocation, free and fragmented GPU milli (FGD's measure, streams/folds/cluster_metrics.py), by card model too, and the
    queue by tier (jobs waiting, and how long the longest has waited)."""
    kind: Literal["pool.minute"] = "pool.minute"
    worker: Ident  # the worker that measured it (one per pool)
    minute_ms: NonNeg
    capacity_milli: NonNeg
    allocated_milli: NonNeg
    free_milli: NonNeg
    fragmentation_milli: NonNeg
    allocated_milli_by_model: dict[str, Int] = {}
    capacity_milli_by_model: dict[str, Int] = {}
    queue_by_tier: dict[str, Int] = {}
    oldest_wait_ms_by_tier: dict[str, Int] = {}


# ---------------------------------------------------------------- lifecycle (issue #13)

class NodeRemoved(Frozen):
    """An operator decommissions a node for good (`removed`), or re-adds it (`removed: false`): a removed node takes
    no work, its work is checkpointed and moved off, its capacity leaves the pool, and a later inventory from it does
    not bring it back. The latest by event time wins (like `node.cordon`)."""
    kind: Literal["node.removed"] = "node.removed"
    node: Ident
    removed: bool = True
    reason: str = ""


class NodeAdmitted(Frozen):
    """Whether a node may take work (docs/security.md, "Node identity"). A node whose inventory came through a node
    principal's channel (the worker's relay stamps it with the principal as `actor`) takes no work until admitted:
    by an operator (`gpupool node admit NODE`; `--revoke` states `admitted: false`), or by the relay itself when the
    principal is registered with auto-admission. The latest by event time wins (like `node.cordon`)."""
    kind: Literal["node.admitted"] = "node.admitted"
    node: Ident
    admitted: bool = True
    reason: str = ""


class JobInterrupted(Frozen):
    """The scheduler ended a run the job did not end itself: its node was lost (code NodeLost: silent for two
    heartbeats) or a card it held failed (GpuFault). Usage is billed up to `billed_to_ms`, its capacity and quota
    are released (a `cmd.release` to each node it held, so a node that comes back stops it), and it is requeued to
    resume from `checkpoint` ahead of newer work of its tier."""
    kind: Literal["job.interrupted"] = "job.interrupted"
    job_id: Ident
    node: str = ""
    code: Ident
    attempt: NonNeg = 0
    billed_to_ms: NonNeg = 0
    checkpoint: str = ""
    reasons: tuple[Reason, ...] = ()
    # the cmd.place command ids of the run it ended: a node's later report naming one is of a superseded run
    commands: tuple[str, ...] = ()


class QuotaRejected(Frozen):
    """The scheduler refused a `quota.set`: the quotas of a tenant's projects would add up to more than the tenant's
    own (docs/scheduler.md, Admission). The quota in force is unchanged."""
    kind: Literal["quota.rejected"] = "quota.rejected"
    tenant: Ident
    project: str | None = None
    gpu_milli: NonNeg
    code: Ident
    reasons: tuple[Reason, ...] = ()


Event = Annotated[
    Union[
        NodeInventory, NodeHeartbeat, GpuTelemetry, NodeCordon, NodeLiveness, GpuHealth,
        JobRequested, JobCancelled, JobScaleRequested, JobStarted, JobCheckpointed, JobCompleted,
        JobFailed, JobStopped, JobLog,
        PlaceJob, ResizeJob, PreemptJob, MigrateJob, MigReconfigure, ReleaseJob, JobPending, Rejected,
        RequestRejected, SchedulerTick, PrincipalRegistered, PrincipalRemoved,
        ReservationRequested, ReservationCancelled, ReservationDecided,
        ServiceDeclared, ServiceRemoved, InferenceLoad, ServiceScaled, ReplicaReady, ReplicaUnready, ReplicaMetrics,
        QuotaSet, QuotaChanged, QuotaBorrowed, QuotaReturned, UsageAccrued, PriceSet,
        NodeRemoved, NodeAdmitted, JobInterrupted, QuotaRejected, TelemetryMinute, PoolMinute,
    ],
    Field(discriminator="kind"),
]

EVENT_TYPES: tuple[type[Frozen], ...] = Event.__origin__.__args__  # type: ignore[attr-defined]
KINDS: dict[str, type[Frozen]] = {t.model_fields["kind"].default: t for t in EVENT_TYPES}
COMMAND_KINDS = frozenset(k for k in KINDS if k.startswith("cmd."))
