"""What a node runs for a placement: the user's program, as a plain process or in a container (issue #32, docs/jobs.md
"Running a program", docs/operators.md "Preparing a node").

One module for every node agent: the NVML agent's Executor (agents/node/nvml_agent.py) and the simulated fleet
(agents/node/sim_agent.py) both start, watch and stop runs through `Run`. A run is one attempt of one part of a job
on one node.

From a PlaceJob (`cmd.place`: image, command, env, workdir, volumes, tier, assignments, resume_from, attempt,
gang_index) and the node's configuration (`NodeContext`, read from the environment by `NodeContext.from_env`):

* Without an image: the argv is exec'd directly (never through a shell) in a per-job working directory
  `JOBS_ROOT/NODE/<job path>/attempt-N` (`job_path`: a job id `tenant/name` is the directories `tenant/name`, each
  segment made safe), with only the pool's variables and the user's own (`pool_environment`, plus a minimal PATH,
  HOME and LANG: never the agent's environment), in a session and process group of its own, with rlimits, no new
  privileges (PR_SET_NO_NEW_PRIVS), dying with the agent (PR_SET_PDEATHSIG), in a memory cgroup of its own when the
  agent can make one (the placement's memory is its limit, and an out-of-memory kill is told apart), and as the
  unprivileged job user (GPUPOOL_JOB_USER, default 65534:65534) when the agent runs as root; not root, the job runs
  as the agent's own user.
* With an image: `podman run --runtime runc` with explicit ulimits, `--user`, `--cap-drop all`,
  `--security-opt no-new-privileges`, `--init` (catatonit, so that SIGTERM reaches the program), never
  `--privileged`, `--network` GPUPOOL_JOB_NETWORK (default none), a name derived from the job and attempt
  (`container_name`), the checkpoint directory mounted at /gpupool/checkpoint, allow-listed volumes only (a volume
  the node lacks fails the run with VolumeUnavailable), `-w workdir`, `-e` for the environment, and the job's cards
  as CDI devices (`nvidia.com/gpu=<card or MIG uuid>`, from the spec `nvidia-ctk cdi generate` writes).

A job on a software share of a card also gets its limits and, in a container, the mounts its node's enforcement
needs (`share_environment`, agents/node/shares.py). Standard output and error are read from pipes and handed to an
`Output` callback (`output(job_id, attempt, part,
stream, data, eof)`, awaitable or plain); the default writes the attempt's log file next to its working directory.
The program tells the pool of a checkpoint by writing `$GPUPOOL_CHECKPOINT_DIR/checkpoint.json` (`read_manifest`),
which the run polls and hands to `on_checkpoint`. A stop sends SIGTERM, waits the grace period, then SIGKILL.
How a run ended is an `Exit`: completed, or one of the closed vocabulary of schemas/events.py EXIT_CODES.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import inspect
import json
import logging
import os
import re
import resource
import shutil
import signal
import stat
from collections.abc import Awaitable, Callable, Mapping  # noqa: F401 - Awaitable: Output's
from dataclasses import dataclass, field, replace
from pathlib import Path

from agents.node.shares import ShareConfig, share_mounts
from infra.config import Volume
from schemas.events import Assignment, JobCompleted, JobFailed, PlaceJob
from schemas.program import program_problem

log = logging.getLogger("gpupool.runner")

MANIFEST = "checkpoint.json"  # the program's checkpoint manifest, in its checkpoint directory
CONTAINER_CHECKPOINT_DIR = "/gpupool/checkpoint"  # where a container sees its checkpoint directory
DEFAULT_JOB_USER = (65534, 65534)  # nobody:nogroup
DEFAULT_ULIMITS = {"nofile": 4096, "nproc": 4096, "core": 0}
DEFAULT_GRACE_S = 30.0  # the scheduler's default grace for every tier (agents/scheduler/core.py)
CDI_KIND = "nvidia.com/gpu"
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
TAIL_BYTES = 4096  # what a run keeps of its standard error to explain a start failure
KMSG = "/dev/kmsg"

# Output(job_id, attempt, part, stream, data, eof): `stream` is "stdout" or "stderr"; each stream ends with one call
# with eof=True (data then empty). May return an awaitable (awaited before the next piece is read: back-pressure).
Output = Callable[[str, int, int, str, bytes, bool], "Awaitable[None] | None"]
# on_checkpoint(checkpoint, progress_ms): a new manifest; awaitable or plain.
OnCheckpoint = Callable[[str, int], "Awaitable[None] | None"]


# ---------------------------------------------------------------- the node's configuration

def _parse_pairs(text: str, what: str) -> dict[str, str]:
    out = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        k, eq, v = item.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise ValueError(f"{what} entry {item!r}: want NAME=VALUE")
        out[k.strip()] = v.strip()
    return out


def parse_grace(text: str) -> dict[str, int]:
    """GPUPOOL_GRACE_S, read as the scheduler reads it (infra/config.py): `SECONDS`, or `TIER=SECONDS,...`."""
    from infra.config import parse_grace as parse

    return parse(text)


def parse_ulimits(text: str) -> dict[str, int]:
    """GPUPOOL_JOB_ULIMITS: `nofile=N,nproc=N,core=N` (the ones not named keep their defaults)."""
    out = dict(DEFAULT_ULIMITS)
    for k, v in _parse_pairs(text, "GPUPOOL_JOB_ULIMITS").items():
        if k not in DEFAULT_ULIMITS or not v.isdigit():
            raise ValueError(f"GPUPOOL_JOB_ULIMITS {k}={v}: want nofile=N, nproc=N or core=N")
        out[k] = int(v)
    return out


def parse_user(text: str) -> tuple[int, int]:
    uid, _, gid = text.strip().partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()) or int(uid) == 0 or (gid and int(gid) == 0):
        raise ValueError(f"GPUPOOL_JOB_USER {text!r}: want UID:GID, numbers, not root's")
    return int(uid), int(gid or uid)


def find_init(environ: Mapping[str, str]) -> str | None:
    """catatonit for `podman run --init` (so that a stop's SIGTERM reaches a program that is not PID 1)."""
    given = environ.get("GPUPOOL_CONTAINER_INIT")
    if given is not None:
        return given or None
    for p in ("/usr/libexec/podman/catatonit", "/usr/bin/catatonit", "/usr/libexec/catatonit/catatonit"):
        if os.access(p, os.X_OK):
            return p
    return None


@dataclass(frozen=True)
class NodeContext:
    """One node's configuration of what it runs (docs/operators.md, "Preparing a node")."""
    node: str
    jobs_root: Path  # working directories and logs: JOBS_ROOT/NODE/<job path>/attempt-N
    checkpoint_root: Path  # checkpoint directories: CHECKPOINT_ROOT/<job path> (shared storage: resume elsewhere)
    volumes: Mapping[str, Volume] = field(default_factory=dict, hash=False)
    podman: str | None = None  # the podman binary (None: none here: a job naming an image fails StartFailed)
    cdi_spec_dirs: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
    init_path: str | None = None  # catatonit, for --init
    user: tuple[int, int] | None = DEFAULT_JOB_USER  # uid, gid jobs run as (None: the agent's own user)
    ulimits: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_ULIMITS), hash=False)
    grace: Mapping[str, float] = field(default_factory=dict, hash=False)  # tier -> seconds (parse_grace)
    network: str = "none"  # a container's --network
    pull: bool = False  # pull an image the node lacks (otherwise ImageNotFound)
    manifest_poll_s: float = 0.5
    cgroups: bool = True  # a memory cgroup per plain run, when the agent can make one
    die_with_agent: bool = True  # PR_SET_PDEATHSIG: a plain process dies with the agent that started it
    # the node's cards (its inventory's GpuCards) and its share enforcement (agents/node/shares.py), for the limits
    # and mounts of a job on a software share of a card
    cards: tuple = ()
    shares: ShareConfig = field(default_factory=ShareConfig)

    @classmethod
    def from_env(cls, node: str, home: Path, *, volumes: Mapping[str, Volume] | None = None,
                 environ: Mapping[str, str] = os.environ, **over) -> "NodeContext":
        """GPUPOOL_JOBS_ROOT, GPUPOOL_CHECKPOINT_ROOT, GPUPOOL_PODMAN, GPUPOOL_CDI_SPEC_DIRS, GPUPOOL_JOB_USER,
        GPUPOOL_JOB_ULIMITS, GPUPOOL_GRACE_S, GPUPOOL_JOB_NETWORK, GPUPOOL_PULL, GPUPOOL_CONTAINER_INIT
        (docs/operators.md); a malformed value raises ValueError naming it."""
        podman = environ.get("GPUPOOL_PODMAN")
        if podman is None:
            podman = shutil.which("podman")
        elif podman in ("", "none"):
            podman = None
        user: tuple[int, int] | None = None
        if os.geteuid() == 0:
            user = parse_user(environ.get("GPUPOOL_JOB_USER") or "65534:65534")
        kw = dict(
            node=node,
            jobs_root=Path(environ.get("GPUPOOL_JOBS_ROOT") or home / "jobs"),
            checkpoint_root=Path(environ.get("GPUPOOL_CHECKPOINT_ROOT") or home / "checkpoints"),
            volumes=dict(volumes or {}), podman=podman,
            cdi_spec_dirs=tuple(Path(p) for p in (environ.get("GPUPOOL_CDI_SPEC_DIRS") or
                                                  "/etc/cdi:/var/run/cdi").split(":") if p),
            init_path=find_init(environ), user=user,
            ulimits=parse_ulimits(environ.get("GPUPOOL_JOB_ULIMITS", "")),
            grace=parse_grace(environ.get("GPUPOOL_GRACE_S", "")),
            network=environ.get("GPUPOOL_JOB_NETWORK") or "none",
            pull=(environ.get("GPUPOOL_PULL") or "0").lower() in ("1", "true", "yes"),
            shares=ShareConfig.from_env(environ),
        )
        kw.update(over)
        return cls(**kw)

    def for_node(self, node: str) -> "NodeContext":
        return replace(self, node=node)

    def grace_for(self, tier, asked: float | None = None) -> float:
        """The grace period between SIGTERM and SIGKILL: what the command asked (`asked`: cmd.preempt's and
        cmd.migrate's grace_s, which the scheduler sets from its tier's grace, GPUPOOL_GRACE_S on its ticks), else,
        for a stop the node starts itself (shutdown, restart, a share stop), the node's GPUPOOL_GRACE_S for the
        job's tier, else DEFAULT_GRACE_S."""
        if asked is not None:
            return float(asked)
        t = getattr(tier, "value", tier)
        return float(self.grace.get(t, DEFAULT_GRACE_S))


# ---------------------------------------------------------------- names and places

_SAFE = re.compile(r"[A-Za-z0-9_-]")


def _safe_segment(seg: str) -> str:
    out = "".join(c if _SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in seg)
    if not out:
        out = "%"  # an empty segment ('a//b'): still one directory, never ''
    if len(out) > 120:  # a file name has 255 bytes at most
        out = out[:60] + "~" + hashlib.sha256(seg.encode()).hexdigest()[:32]
    return out


def job_path(job_id: str) -> Path:
    """A job id as relative directories: `acme/train` -> acme/train; each segment keeps letters, digits, _ and -, the
    rest %-encoded (so `.`, `..` and the empty segment can never climb or vanish); an overlong segment is shortened
    with a digest. Distinct ids give distinct paths."""
    return Path(*(_safe_segment(s) for s in job_id.split("/")))


def container_name(job_id: str, attempt: int, part: int = 0) -> str:
    """The container of one run: readable, unique per job, attempt and part (a stop finds it by this name)."""
    readable = re.sub(r"[^a-zA-Z0-9_.-]+", "-", job_id).strip("-.")[:60] or "job"
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:10]
    return f"gpupool-{readable}-{digest}-a{attempt}-p{part}"


def run_label(place: PlaceJob) -> str:
    return f"attempt-{place.attempt}" + (f"-part-{place.gang_index}" if place.gang_size > 1 else "")


def work_dir(place: PlaceJob, ctx: NodeContext) -> Path:
    return ctx.jobs_root / _safe_segment(ctx.node) / job_path(place.job_id) / run_label(place)


def log_file(place: PlaceJob, ctx: NodeContext) -> Path:
    return work_dir(place, ctx).with_name(run_label(place) + ".log")


def checkpoint_dir(place: PlaceJob, ctx: NodeContext) -> Path:
    """The job's checkpoint directory on the node: the same for every attempt and node (shared storage), one per part
    of a gang."""
    d = ctx.checkpoint_root / job_path(place.job_id)
    return d / f"part-{place.gang_index}" if place.gang_size > 1 else d


def visible_devices(assignments: tuple[Assignment, ...]) -> str:
    """CUDA enumerates a MIG slice by its own UUID, a whole card by the card's; order kept, duplicates dropped.
    (CUDA uses only the first MIG device a process is given; the scheduler never places one job on two.)"""
    seen: dict[str, None] = {}
    for a in assignments:
        seen.setdefault(a.mig_uuid or a.gpu_uuid, None)
    return ",".join(seen)


def cdi_devices(assignments: tuple[Assignment, ...]) -> list[str]:
    """The CDI names of the job's cards: `nvidia.com/gpu=GPU-<uuid>` / `nvidia.com/gpu=MIG-<uuid>`, as
    `nvidia-ctk cdi generate --device-name-strategy=uuid` names them."""
    dev = visible_devices(assignments)
    return [f"{CDI_KIND}={u}" for u in dev.split(",")] if dev else []


# ---------------------------------------------------------------- the environment contract

def resume_path(place: PlaceJob, ckpt_dir_seen: str) -> str:
    """GPUPOOL_RESUME_FROM as the program sees it: a checkpoint the manifest named by a path relative to the
    checkpoint directory is given under the directory as this run sees it; an absolute path or a stand-in checkpoint
    (`ckpt:...`) as it is."""
    r = place.resume_from
    if not r or r.startswith("/") or r.startswith("ckpt:"):
        return r
    return f"{ckpt_dir_seen}/{r}"


def share_environment(place: PlaceJob, ctx: NodeContext) -> dict[str, str]:
    """The share hook (issue #32 item 4): for a job on a software share of a card, its limits in the form the node's
    enforcement reads (HAMi-core's CUDA_DEVICE_MEMORY_LIMIT_<i> / CUDA_DEVICE_SM_LIMIT_<i> with LD_PRELOAD and the
    job's own accounting file, or MPS's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / CUDA_MPS_PINNED_DEVICE_MEM_LIMIT);
    agents/node/shares.py, docs/jobs.md "Shares of a card". {} for a job on whole cards or MIG instances."""
    from agents.node.shares import share_environment as for_shares

    return dict(for_shares(place.assignments, ctx.cards, ctx.shares, job_dir=str(work_dir(place, ctx)),
                           in_container=bool(place.image)))


def run_id(place: PlaceJob) -> str:
    """TORCHELASTIC_RUN_ID: the job and attempt, in characters any rendezvous backend takes (`acme/train`, attempt 3:
    `acme_train-a3`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", place.job_id) + f"-a{place.attempt}"


def rendezvous_environment(place: PlaceJob) -> dict[str, str]:
    """What torchrun and plain PyTorch need to meet the job's other parts (docs/jobs.md, "Gangs"): torchrun's
    PET_* options (one node per part; its cards on this node as the processes per node), the run id, and MASTER_*,
    WORLD_SIZE and RANK for a program that starts one process per part and reads them itself. From the placement,
    which carries the master's address and port the scheduler chose (the same in every part's); {} for a placement
    that carries none (a scheduler from before gangs rendezvous)."""
    if not place.master_port:
        return {}
    addr, port = place.master_addr or "127.0.0.1", str(place.master_port)
    return {
        "PET_NNODES": str(place.gang_size),
        "PET_NODE_RANK": str(place.gang_index),
        "PET_NPROC_PER_NODE": str(max(1, len({a.gpu_uuid for a in place.assignments}))),
        "PET_MASTER_ADDR": addr,
        "PET_MASTER_PORT": port,
        "TORCHELASTIC_RUN_ID": run_id(place),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
        "WORLD_SIZE": str(place.gang_size),
        "RANK": str(place.gang_index),
    }


def pool_environment(place: PlaceJob, node_ctx: NodeContext, port: int = 0) -> dict[str, str]:
    """What the pool tells every job (docs/jobs.md, "What a job sees"), for a plain process or a container alike
    (the checkpoint directory as that run sees it). A serving replica (`place.serve`) also gets the port it is to
    listen on, `port`, in PORT and GPUPOOL_PORT, and its compute share in GPUPOOL_COMPUTE_MILLI and (rewritten by
    the node on a resize) the file GPUPOOL_SHARE_FILE (docs/serving.md)."""
    ckpt = CONTAINER_CHECKPOINT_DIR if place.image else str(checkpoint_dir(place, node_ctx))
    devices = visible_devices(place.assignments)
    env = {
        "GPUPOOL_JOB_ID": place.job_id,
        "GPUPOOL_TENANT": place.tenant,
        "GPUPOOL_ATTEMPT": str(place.attempt),
        "GPUPOOL_PART": str(place.gang_index),
        "GPUPOOL_PARTS": str(place.gang_size),
        "GPUPOOL_NODE": node_ctx.node,
        "GPUPOOL_TIER": getattr(place.tier, "value", str(place.tier)),
        "GPUPOOL_CHECKPOINT_DIR": ckpt,
        "GPUPOOL_RESUME_FROM": resume_path(place, ckpt),
        "CUDA_VISIBLE_DEVICES": devices,
        "NVIDIA_VISIBLE_DEVICES": devices or "void",
    }
    env.update(rendezvous_environment(place))
    if place.serve is not None and port:
        env["PORT"] = env["GPUPOOL_PORT"] = str(port)
        env["GPUPOOL_COMPUTE_MILLI"] = str(sum(a.milli for a in place.assignments))
        env["GPUPOOL_SHARE_FILE"] = (f"{CONTAINER_CHECKPOINT_DIR}/{SHARE_FILE}" if place.image
                                     else str(checkpoint_dir(place, node_ctx) / SHARE_FILE))
    env.update(share_environment(place, node_ctx))
    return env


SHARE_FILE = ".gpupool-share"  # a serving replica's compute share in milli, in its checkpoint directory


def write_share(place: PlaceJob, ctx: NodeContext, assignments: tuple[Assignment, ...]) -> None:
    """The serving replica's compute share as its share file says it (at start, and on each resize)."""
    path = checkpoint_dir(place, ctx) / SHARE_FILE
    tmp = path.with_name(SHARE_FILE + ".tmp")
    try:
        tmp.write_text(str(sum(a.milli for a in assignments)))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError:
        pass


def program_environment(place: PlaceJob, ctx: NodeContext, home: str, port: int = 0) -> dict[str, str]:
    """A plain process's whole environment: a minimal PATH, HOME and LANG, the user's own variables, then the pool's
    (which a request can never set: schemas/program.py refuses those names, and they win here regardless)."""
    return {"PATH": MINIMAL_PATH, "HOME": home, "LANG": "C.UTF-8", **place.env, **pool_environment(place, ctx, port)}


# ---------------------------------------------------------------- how a run ended

def completed(place: PlaceJob | None, job_id: str, node: str, command_id: str) -> JobCompleted:
    """A run that exited 0, as its node reports it: with the run's attempt and its part of the gang (a gang is done
    when every part of the run completed: the scheduler counts them)."""
    if place is None:
        return JobCompleted(job_id=job_id, node=node, command_id=command_id)
    return JobCompleted(job_id=job_id, node=node, command_id=command_id, attempt=place.attempt,
                        part=place.gang_index, parts=place.gang_size)


@dataclass(frozen=True)
class Exit:
    """How a run ended. `code` None: it completed (exit status 0); else one of EXIT_CODES. `stopped`: the agent
    ended it (a stop), so no failure is reported."""
    code: str | None
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    stopped: bool = False
    graceful: bool = False  # a stop's run ended on SIGTERM, within the grace period

    @property
    def ok(self) -> bool:
        return self.code is None

    def failed(self, place: PlaceJob, node: str, command_id: str | None = None) -> JobFailed:
        return JobFailed(job_id=place.job_id, node=node, reason=self.reason, command_id=command_id or place.command_id,
                         code=self.code, exit_code=self.exit_code, signal=self.signal, attempt=place.attempt,
                         part=place.gang_index)


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def exit_of_status(rc: int, *, oom: bool = False) -> Exit:
    """A plain process's wait status (asyncio: negative = killed by that signal)."""
    if rc == 0:
        return Exit(None, "completed", exit_code=0)
    if rc < 0:
        if oom:
            return Exit("OOMKilled", f"out of memory: killed by the kernel ({_signame(-rc)})", signal=-rc)
        return Exit("Signal", f"killed by signal {-rc} ({_signame(-rc)})", signal=-rc)
    return Exit("ExitCode", f"exit code {rc}", exit_code=rc)


# podman's own errors, told apart from the program's output on the same stderr
_PODMAN_NOT_FOUND = re.compile(r"(executable file `?.*`? not found|failed to exec pid1: No such file or directory|"
                               r"no such file or directory: OCI runtime attempted to invoke a command that was not "
                               r"found|OCI runtime attempted to invoke a command that was not found)", re.I)
_PODMAN_ERROR = re.compile(r"^(Error: .*|ERROR \(catatonit:\d+\): .*)$", re.M)


def exit_of_container(rc: int, state: Mapping, stderr_tail: str) -> Exit:
    """A container's end from `podman run`'s status, `podman inspect`'s State and the end of its stderr."""
    code = state.get("ExitCode", rc) if state else rc
    if state and state.get("OOMKilled"):
        return Exit("OOMKilled", "out of memory: the container was killed by the kernel", signal=9)
    err = _PODMAN_ERROR.findall(stderr_tail)
    last = err[-1].strip() if err else ""
    if rc in (1, 125, 126, 127) and last:
        if _PODMAN_NOT_FOUND.search(last):
            return Exit("CommandNotFound", f"command not found in the image: {last[:300]}", exit_code=127)
        if rc in (125, 126) or "catatonit" in last:
            return Exit("StartFailed", f"the container did not start: {last[:300]}", exit_code=rc)
    if code == 0:
        return Exit(None, "completed", exit_code=0)
    if 128 < code <= 128 + 64:
        # a container's init reports a program killed by signal N as 128+N (as Kubernetes reads it)
        return Exit("Signal", f"killed by signal {code - 128} ({_signame(code - 128)})", signal=code - 128)
    return Exit("ExitCode", f"exit code {code}", exit_code=code)


# ---------------------------------------------------------------- checkpoints

def read_manifest(path: Path) -> tuple[str, int] | None:
    """The program's checkpoint manifest: JSON {"path": "...", "progress_ms": N} (progress_ms optional, "step"
    optional and informative). `path` relative to the checkpoint directory (a checkpoint that moves with the job),
    or absolute (e.g. on a volume). None when absent, partial or malformed: the program writes it atomically (a
    temporary file, then rename), and a malformed one is ignored until it is rewritten."""
    raw = _read_small(path)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    p = doc.get("path")
    ms = doc.get("progress_ms", 0)
    if not isinstance(p, str) or not p or len(p) > 4096 or "\x00" in p or any(ord(c) < 32 for c in p):
        return None
    if not isinstance(ms, int) or isinstance(ms, bool) or ms < 0:
        ms = 0
    return p.strip(), ms


def _read_small(path: Path, limit: int = 65536) -> bytes | None:
    """A regular file of at most `limit` bytes, never through a symbolic link: the manifest lies in a directory the
    job owns, and the agent reading it may be root."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


# ---------------------------------------------------------------- start-up checks

class StartRefused(Exception):
    def __init__(self, exit: Exit):
        super().__init__(exit.reason)
        self.exit = exit


def _refuse(code: str, reason: str) -> StartRefused:
    return StartRefused(Exit(code, reason))


def check_volumes(place: PlaceJob, ctx: NodeContext) -> list[tuple[Volume, str, bool]]:
    """The mounts a run gets: (volume, path in the job, read-only), each of the node's allow-list and present here;
    else VolumeUnavailable."""
    out = []
    for m in place.volumes:
        v = ctx.volumes.get(m.volume)
        if v is None:
            raise _refuse("VolumeUnavailable", f"volume {m.volume!r} is not in node {ctx.node}'s allow-list "
                                               f"(GPUPOOL_VOLUMES)")
        if not Path(v.host_path).exists():
            raise _refuse("VolumeUnavailable", f"volume {m.volume!r} is missing on node {ctx.node}: "
                                               f"{v.host_path} does not exist")
        if v.read_only and not m.read_only:
            raise _refuse("VolumeUnavailable", f"volume {m.volume!r} may only be mounted read-only")
        out.append((v, m.path, m.read_only or v.read_only))
    return out


def cdi_known(dirs: tuple[Path, ...]) -> set[str]:
    """Every `kind=name` the CDI specs in these directories define (JSON or YAML specs)."""
    names: set[str] = set()
    for d in dirs:
        try:
            files = sorted(d.iterdir())
        except OSError:
            continue
        for f in files:
            if f.suffix not in (".json", ".yaml", ".yml"):
                continue
            try:
                text = f.read_text()
                if f.suffix == ".json":
                    doc = json.loads(text)
                else:
                    import yaml

                    doc = yaml.safe_load(text)
                kind = doc["kind"]
                names.update(f"{kind}={dev['name']}" for dev in doc.get("devices") or ())
            except Exception as exc:  # noqa: BLE001 - one bad spec must not hide the others
                log.warning("CDI spec %s unreadable: %s", f, exc)
    return names


def reachable(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory above `path` that user uid:gid cannot pass through (None: it can reach path)."""
    for d in reversed(path.parents):
        try:
            st = d.stat()
        except OSError:
            return d
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if not st.st_mode & bit:
            return d
    return None


def passable_roots(home: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """GPUPOOL_JOBS_ROOT / GPUPOOL_CHECKPOINT_ROOT for a local stack (`gpupool up`, the demo) whose home the job user
    cannot pass through: a home under /root, or made under a umask of 077, holds jobs that user could never reach. {}
    when nothing is needed: not root (jobs run as the agent's own user), the roots are set already, or the job user
    reaches $GPUPOOL_HOME/jobs. Otherwise a directory per home under the system's temporary directory,
    `gpupool-jobs-<digest of the home>` (0711, passable and not listable), made now with its `jobs` and `checkpoints`
    (docs/operators.md, "Preparing a node")."""
    if os.geteuid() != 0 or environ.get("GPUPOOL_JOBS_ROOT") or environ.get("GPUPOOL_CHECKPOINT_ROOT"):
        return {}
    user = parse_user(environ.get("GPUPOOL_JOB_USER") or "65534:65534")
    home = Path(home).absolute()
    there = home
    while not there.exists() and there != there.parent:
        there = there.parent  # the runner makes what is missing below it passable (0711)
    if reachable(there / "x", *user) is None:
        return {}
    import tempfile

    base = Path(tempfile.gettempdir()) / f"gpupool-jobs-{hashlib.sha256(str(home).encode()).hexdigest()[:12]}"
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:  # a name in a shared directory: never another's, no link
        raise ValueError(f"{base} is not a directory of root's: set GPUPOOL_JOBS_ROOT and GPUPOOL_CHECKPOINT_ROOT")
    os.chmod(base, 0o711)
    for d in (base / "jobs", base / "checkpoints"):
        _mkdirs(d, 0o711)
    if reachable(base / "jobs" / "x", *user) is not None:
        raise ValueError(f"the job user {user[0]} cannot reach {base}: set GPUPOOL_JOBS_ROOT and "
                         f"GPUPOOL_CHECKPOINT_ROOT to storage it can pass through")
    return {"GPUPOOL_JOBS_ROOT": str(base / "jobs"), "GPUPOOL_CHECKPOINT_ROOT": str(base / "checkpoints")}


def _mkdirs(path: Path, mode: int) -> None:
    """Create path and its missing parents with `mode` (not the umask's)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
            os.chmod(d, mode)


# ---------------------------------------------------------------- memory cgroups (plain processes)

class JobCgroup:
    """A memory cgroup for one plain run: its limit is the placement's memory; its oom_kill count tells an
    out-of-memory kill apart from another SIGKILL. cgroup v1 (a child of the agent's own memory cgroup) or v2 (under
    /sys/fs/cgroup/gpupool-jobs). None where the agent cannot make one (not root, a read-only cgroupfs): the run goes
    on without, and an out-of-memory kill then reads as Signal 9."""

    def __init__(self, path: Path, v2: bool):
        self.path = path
        self.v2 = v2

    @classmethod
    def make(cls, name: str, memory_mib: int) -> "JobCgroup | None":
        try:
            v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
            if v2:
                base = Path("/sys/fs/cgroup/gpupool-jobs")
                base.mkdir(exist_ok=True)
                with contextlib.suppress(OSError):
                    (base / "cgroup.subtree_control").write_text("+memory")
            else:
                own = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                            if ln.split(":", 2)[1] == "memory"), None)
                if own is None:
                    return None
                base = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / "gpupool-jobs"
                base.mkdir(exist_ok=True)
            path = base / name
            if path.exists():
                cls(path, v2).remove()
            path.mkdir()
            cg = cls(path, v2)
            if memory_mib > 0:
                limit = str(memory_mib * 1024 * 1024)
                if v2:
                    (path / "memory.max").write_text(limit)
                    with contextlib.suppress(OSError):
                        (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.limit_in_bytes").write_text(limit)
                    with contextlib.suppress(OSError):
                        (path / "memory.memsw.limit_in_bytes").write_text(limit)
            return cg
        except (OSError, ValueError, IndexError) as exc:
            log.debug("no memory cgroup for %s: %s", name, exc)
            return None

    def procs_fd(self) -> int:
        return os.open(self.path / "cgroup.procs", os.O_WRONLY)

    def oom_kills(self) -> int:
        try:
            text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        for _ in range(50):
            self.kill_all()
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                import time

                time.sleep(0.02)
        log.warning("cgroup %s not removed", self.path)


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
_RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE}


def _child_setup(cg_fd: int | None, limits: list[tuple[int, int]], pdeathsig: bool) -> Callable[[], None]:
    """What the child does between fork and exec, after it became the job user: join its cgroup (through a file the
    agent opened), its rlimits, no new privileges, and (optionally) death with the agent. Everything is prepared
    before the fork: no import, no lookup here."""
    prctl = _libc.prctl
    setrlimit = resource.setrlimit
    write, close = os.write, os.close
    kill_sig = int(signal.SIGKILL)

    def setup() -> None:
        if cg_fd is not None:
            write(cg_fd, b"0")  # "0": the writing process itself
            close(cg_fd)
        for which, value in limits:
            setrlimit(which, (value, value))
        if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        if pdeathsig:
            prctl(PR_SET_PDEATHSIG, kill_sig, 0, 0, 0)

    return setup


def _limits(ulimits: Mapping[str, int]) -> list[tuple[int, int]]:
    out = []
    for name, value in ulimits.items():
        which = _RLIMITS[name]
        _, hard = resource.getrlimit(which)
        out.append((which, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return out


def _oom_in_kernel_log(container_id: str) -> bool:
    """Whether the kernel log names an OOM kill in this container's cgroup (a node where podman's own OOM report
    does not come through). Root only; False where the log cannot be read."""
    if not container_id:
        return False
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    found = False
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # a record overwritten while reading: go on
                    continue
                break
            if not rec:
                break
            if b"oom-kill:" in rec and container_id.encode() in rec:
                found = True
    finally:
        os.close(fd)
    return found


async def _call(fn, *args) -> None:
    if fn is None:
        return
    out = fn(*args)
    if inspect.isawaitable(out):
        await out


def tee(*outputs: Output | None) -> Output:
    """One Output that hands every piece to each of `outputs` in turn (the log file, the log shipper)."""
    outs = [o for o in outputs if o is not None]

    async def both(job_id, attempt, part, stream, data, eof):
        for o in outs:
            await _call(o, job_id, attempt, part, stream, data, eof)

    return both


class LogFile:
    """The default Output: the attempt's stdout and stderr, as they come, into one file (agent-owned, beside the
    working directory). Opened on the first piece, closed when both streams ended."""

    def __init__(self, path: Path):
        self.path = path
        self.f = None
        self.open_streams = {"stdout", "stderr"}

    def __call__(self, job_id, attempt, part, stream, data, eof) -> None:
        if self.f is None and (data or not eof):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.f = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        if data and self.f is not None:
            self.f.write(data)
            self.f.flush()
        if eof:
            self.open_streams.discard(stream)
            if not self.open_streams and self.f is not None:
                self.f.close()
                self.f = None


# ---------------------------------------------------------------- one run

class Run:
    """One attempt of one part of a job on this node: start(), wait(), stop(grace), kill().

    `argv` overrides the placement's command (a stand-in run of the NVML agent: GPUPOOL_JOB_COMMANDS or a sleep).
    `output` gets stdout and stderr (default: the attempt's log file); `on_checkpoint` each new manifest."""

    def __init__(self, place: PlaceJob, ctx: NodeContext, *, argv: list[str] | None = None,
                 output: Output | None = None, on_checkpoint: OnCheckpoint | None = None, port: int = 0):
        self.place = place
        self.ctx = ctx
        self.port = port  # a serving replica's (place.serve): PORT / GPUPOOL_PORT
        self.argv = list(argv) if argv is not None else list(place.command)
        self.container = bool(place.image)
        self.output = output if output is not None else LogFile(log_file(place, ctx))
        self.on_checkpoint = on_checkpoint
        self.name = container_name(place.job_id, place.attempt, place.gang_index) if self.container else ""
        self.workdir = work_dir(place, ctx)
        self.ckpt_dir = checkpoint_dir(place, ctx)
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # the process (group) of a plain run; a container's init once known
        self.checkpoint = ""  # the last checkpoint its manifest named ("": none this run)
        self.progress_ms = 0
        self.stopping = False
        self.killed = False
        self._cgroup: JobCgroup | None = None
        self._stderr_tail = b""
        self._tasks: list[asyncio.Task] = []
        self._readers: list[asyncio.StreamReader] = []
        self._transports: list = []
        self._manifest_seen: bytes | None = None
        self._exit: Exit | None = None
        self._done = asyncio.Event()
        self._stop_graceful: bool | None = None
        self._container_id = ""
        self._monitor_dir: Path | None = None

    # ---- start

    async def start(self) -> Exit | None:
        """Start the run. None: it runs; an Exit: it did not start, and why."""
        try:
            if self.container:
                await self._start_container()
            else:
                await self._start_process()
        except StartRefused as exc:
            self._finish(exc.exit)
            return exc.exit
        self._tasks.append(asyncio.create_task(self._pump(self._readers[0], "stdout")))
        self._tasks.append(asyncio.create_task(self._pump(self._readers[1], "stderr")))
        self._tasks.append(asyncio.create_task(self._watch()))
        self._waiter = asyncio.create_task(self._wait_proc())
        return None

    def _prepare_dirs(self) -> None:
        """The working directory (the job user's, 0700) and the checkpoint directory (the job user's); the roots
        above them 0711 (passable, not listable)."""
        uid, gid = self.ctx.user or (os.geteuid(), os.getegid())
        for root in (self.ctx.jobs_root, self.ctx.checkpoint_root):
            _mkdirs(root, 0o711)
        _mkdirs(self.workdir.parent, 0o711)
        _mkdirs(self.ckpt_dir.parent, 0o711)
        for d in (self.workdir, self.ckpt_dir):
            d.mkdir(exist_ok=True)
            if self.ctx.user is not None:
                os.chown(d, uid, gid)
            os.chmod(d, 0o700)
        self._manifest_seen = _read_small(self.ckpt_dir / MANIFEST)
        if self.place.serve is not None:
            write_share(self.place, self.ctx, self.place.assignments)

    async def _start_process(self) -> None:
        p = self.place
        if not self.argv:
            raise _refuse("StartFailed", "no command to run")
        why = program_problem(tuple(self.argv), p.env, p.workdir, p.volumes, None)
        if why:
            raise _refuse("StartFailed", why)
        check_volumes(p, self.ctx)
        if p.volumes:
            raise _refuse("StartFailed", "volumes are mounted into containers only: give the job an image "
                                         "(a plain process sees the node's file system as its user may)")
        try:
            self._prepare_dirs()
        except OSError as exc:
            raise _refuse("StartFailed", f"cannot prepare the job's directories on {self.ctx.node}: {exc}")
        if self.ctx.user is not None:
            for d in (self.workdir, self.ckpt_dir):
                blocked = reachable(d, *self.ctx.user)
                if blocked is not None:
                    raise _refuse("StartFailed", (
                        f"the job user {self.ctx.user[0]} cannot reach {d}: {blocked} is not passable for it "
                        f"(chmod o+x {blocked}, or set GPUPOOL_JOBS_ROOT / GPUPOOL_CHECKPOINT_ROOT to storage it can "
                        f"reach: docs/operators.md)"))
        cwd = self.workdir
        if p.workdir:
            cwd = Path(p.workdir)
            if not cwd.is_dir():
                raise _refuse("StartFailed", f"workdir {p.workdir} does not exist on node {self.ctx.node}")
        env = program_environment(p, self.ctx, str(self.workdir), self.port)
        argv0 = self.argv[0]
        if "/" not in argv0:
            found = shutil.which(argv0, path=env["PATH"])
            if found is None:
                raise _refuse("CommandNotFound", f"command not found: {argv0} (PATH={env['PATH']})")
        label = f"{_safe_segment(self.ctx.node)}-{hashlib.sha256(p.job_id.encode()).hexdigest()[:16]}-" \
                f"{run_label(p)}"
        self._cgroup = JobCgroup.make(label, p.memory_mib) if self.ctx.cgroups and os.geteuid() == 0 else None
        cg_fd = None
        if self._cgroup is not None:
            try:
                cg_fd = self._cgroup.procs_fd()
            except OSError:
                self._cgroup.remove()
                self._cgroup = None
        kw: dict = {}
        if self.ctx.user is not None:
            kw = dict(user=self.ctx.user[0], group=self.ctx.user[1], extra_groups=[])
        try:
            await self._spawn(
                self.argv, env=env, cwd=str(cwd), start_new_session=True,
                preexec_fn=_child_setup(cg_fd, _limits(self.ctx.ulimits), self.ctx.die_with_agent),
                pass_fds=(cg_fd,) if cg_fd is not None else (), **kw)
        except FileNotFoundError as exc:
            self._drop_cgroup()
            raise _refuse("CommandNotFound", f"command not found: {argv0} ({exc.strerror})")
        except PermissionError as exc:
            self._drop_cgroup()
            raise _refuse("StartFailed", f"cannot execute {argv0}: {exc.strerror}")
        except (OSError, ValueError, Exception) as exc:  # noqa: BLE001 - SubprocessError from the child's set-up
            self._drop_cgroup()
            raise _refuse("StartFailed", f"cannot start {argv0}: {exc}")
        finally:
            if cg_fd is not None:
                os.close(cg_fd)
        self.pid = self.proc.pid

    async def _spawn(self, argv: list[str], **kw) -> None:
        """Start argv with its stdout and stderr on pipes of our own: asyncio's own pipes would make wait() wait for
        every process holding them (a child the program left behind), not for the program."""
        fds = [*os.pipe(), *os.pipe()]
        try:
            self.proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=fds[1],
                                                             stderr=fds[3], **kw)
        except BaseException:
            for fd in (fds[0], fds[2]):
                os.close(fd)
            raise
        finally:
            os.close(fds[1])
            os.close(fds[3])
        loop = asyncio.get_running_loop()
        self._readers = []
        self._transports = []
        for fd in (fds[0], fds[2]):
            reader = asyncio.StreamReader(limit=1 << 20)
            transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r),
                                                        os.fdopen(fd, "rb", buffering=0))
            self._readers.append(reader)
            self._transports.append(transport)

    def _drop_cgroup(self) -> None:
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None

    async def _podman(self, *args: str, timeout: float = 60.0) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(self.ctx.podman, *args, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return 124, "", f"podman {args[0]} timed out"
        except asyncio.CancelledError:  # the run is over: the question need not be answered
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.wait())
            raise
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    def container_argv(self, mounts: list[tuple[Volume, str, bool]]) -> list[str]:
        """`podman run ...` for this run (pure but for the context)."""
        p, ctx = self.place, self.ctx
        argv = [ctx.podman or "podman", "run", "--name", self.name, "--runtime", "runc", "--pull", "never",
                "--cap-drop", "all", "--security-opt", "no-new-privileges", "--network", ctx.network,
                "--stop-signal", "SIGTERM", "--label", f"gpupool.job={p.job_id}",
                "--label", f"gpupool.node={ctx.node}", "--label", f"gpupool.attempt={p.attempt}"]
        for name in ("nofile", "nproc"):
            v = ctx.ulimits.get(name, DEFAULT_ULIMITS[name])
            argv += ["--ulimit", f"{name}={v}:{v}"]
        if ctx.user is not None:
            argv += ["--user", f"{ctx.user[0]}:{ctx.user[1]}"]
        else:
            argv += ["--userns", "keep-id", "--user", f"{os.geteuid()}:{os.getegid()}"]
        if ctx.init_path:
            argv += ["--init", "--init-path", ctx.init_path]
        if p.memory_mib > 0:
            argv += ["--memory", f"{p.memory_mib}m", "--memory-swap", f"{p.memory_mib}m"]
        argv += ["-v", f"{self.ckpt_dir}:{CONTAINER_CHECKPOINT_DIR}:rw"]
        for v, path, ro in mounts:
            argv += ["-v", f"{v.host_path}:{path}:{'ro' if ro else 'rw'}"]
        for m in share_mounts(p.assignments, ctx.cards, ctx.shares):  # HAMi-core's library, MPS's pipes
            argv += ["-v", f"{m.host_path}:{m.container_path}:{'ro' if m.read_only else 'rw'}"]
        for dev in cdi_devices(p.assignments):
            argv += ["--device", dev]
        if p.workdir:
            argv += ["-w", p.workdir]
        if p.serve is not None and self.port and ctx.network not in ("none", "host"):
            argv += ["-p", f"{self.port}:{self.port}"]  # the replica's port, published on the node's
        for k, v in {**p.env, **pool_environment(p, ctx, self.port)}.items():
            argv += ["-e", f"{k}={v}"]
        argv.append(p.image)
        argv += self.argv
        return argv

    async def _start_container(self) -> None:
        p = self.place
        why = program_problem(tuple(self.argv), p.env, p.workdir, p.volumes, p.image)
        if why:
            raise _refuse("StartFailed", why)
        if not self.ctx.podman:
            raise _refuse("StartFailed", f"the job names an image ({p.image}) and node {self.ctx.node} has no podman: "
                                         f"podman and runc are needed to run containers (docs/operators.md, "
                                         f"\"Preparing a node\")")
        mounts = check_volumes(p, self.ctx)
        rc, _, err = await self._podman("image", "exists", p.image)
        if rc != 0:
            if not self.ctx.pull:
                raise _refuse("ImageNotFound", f"image {p.image} is not on node {self.ctx.node} (the node does not "
                                               f"pull: GPUPOOL_PULL=1 lets it)")
            rc, _, err = await self._podman("pull", "--quiet", p.image, timeout=1800)
            if rc != 0:
                raise _refuse("ImageNotFound", f"image {p.image} could not be pulled: {err.strip()[-300:]}")
        devices = cdi_devices(p.assignments)
        if devices:
            known = cdi_known(self.ctx.cdi_spec_dirs)
            missing = [d for d in devices if d not in known]
            if missing:
                raise _refuse("StartFailed", (
                    f"no CDI device {', '.join(missing)} on node {self.ctx.node} (in "
                    f"{', '.join(map(str, self.ctx.cdi_spec_dirs))}): run `nvidia-ctk cdi generate "
                    f"--output=/etc/cdi/nvidia.yaml` (docs/operators.md)"))
        try:
            self._prepare_dirs()
        except OSError as exc:
            raise _refuse("StartFailed", f"cannot prepare the job's directories on {self.ctx.node}: {exc}")
        await self._podman("rm", "--force", "--ignore", self.name)  # a stale one of an agent that died
        argv = self.container_argv(mounts)
        # podman's monitor (conmon) runs where podman was started; some conmon builds leave their record of an OOM
        # kill there (a file "oom") where podman does not look: a directory of the agent's own per run catches it
        self._monitor_dir = self.workdir.with_name(run_label(p) + ".podman")
        shutil.rmtree(self._monitor_dir, ignore_errors=True)
        self._monitor_dir.mkdir(mode=0o700)
        try:
            await self._spawn(
                argv, env={"PATH": os.environ.get("PATH", MINIMAL_PATH), "HOME": os.environ.get("HOME", "/root"),
                           "LANG": "C.UTF-8", **({"XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"]}
                                                 if "XDG_RUNTIME_DIR" in os.environ else {})},
                cwd=str(self._monitor_dir), start_new_session=True)
        except OSError as exc:
            raise _refuse("StartFailed", f"cannot run podman: {exc}")

    # ---- while it runs

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        p = self.place
        try:
            while True:
                data = await stream.read(65536)
                if not data:
                    break
                if name == "stderr":
                    self._stderr_tail = (self._stderr_tail + data)[-TAIL_BYTES:]
                try:
                    await _call(self.output, p.job_id, p.attempt, p.gang_index, name, data, False)
                except Exception:  # noqa: BLE001 - a failing sink must not stop the program
                    log.exception("output of %s", p.job_id)
        finally:
            with contextlib.suppress(Exception):
                await _call(self.output, p.job_id, p.attempt, p.gang_index, name, b"", True)

    async def _check_manifest(self) -> None:
        path = self.ckpt_dir / MANIFEST
        raw = _read_small(path)
        if raw is None or raw == self._manifest_seen:
            return
        self._manifest_seen = raw
        got = read_manifest(path)
        if got is None:
            return
        ckpt, ms = got
        if ckpt == self.checkpoint:
            return
        self.checkpoint, self.progress_ms = ckpt, ms
        try:
            await _call(self.on_checkpoint, ckpt, ms)
        except Exception:  # noqa: BLE001
            log.exception("checkpoint report of %s", self.place.job_id)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.manifest_poll_s)
            if self.container and self.pid is None and self.ctx.podman:
                rc, out, _ = await self._podman("inspect", "--format", "{{.State.Pid}} {{.Id}}", self.name,
                                                timeout=10)
                if rc == 0 and out.split() and out.split()[0].isdigit() and int(out.split()[0]) > 0:
                    self.pid, self._container_id = int(out.split()[0]), out.split()[1]
            await self._check_manifest()

    async def _wait_proc(self) -> None:
        rc = await self.proc.wait()
        if self.container:
            state = {}
            if self.ctx.podman:
                r, out, _ = await self._podman("inspect", "--format", "{{json .State}}|{{.Id}}", self.name,
                                               timeout=30)
                if r == 0:
                    js, _, cid = out.strip().rpartition("|")
                    with contextlib.suppress(ValueError):
                        state = json.loads(js)
                    self._container_id = cid or self._container_id
                await self._podman("rm", "--force", "--ignore", self.name, timeout=60)
        else:
            # the job is its main process: what it left behind in its process group (and cgroup) goes with it
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self._cgroup is not None:
                self._cgroup.kill_all()
        for t in self._tasks[:2]:  # the pumps end at EOF; a pipe held open by a process that escaped is cut
            try:
                await asyncio.wait_for(asyncio.shield(t), 10)
            except asyncio.TimeoutError:
                t.cancel()
        for tr in self._transports:
            tr.close()
        for t in self._tasks[2:]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._check_manifest()  # the last word of the program (re-read after exit)
        tail = self._stderr_tail.decode(errors="replace")
        if self.container:
            exit = exit_of_container(rc, state, tail)
            conmon_oom = self._monitor_dir is not None and (self._monitor_dir / "oom").exists()
            if exit.code == "Signal" and exit.signal == 9 and not self.stopping and not self.killed \
                    and (conmon_oom or _oom_in_kernel_log(self._container_id)):
                exit = Exit("OOMKilled", "out of memory: the container was killed by the kernel", signal=9)
            if self._monitor_dir is not None:
                shutil.rmtree(self._monitor_dir, ignore_errors=True)
        else:
            oom = self._cgroup is not None and self._cgroup.oom_kills() > 0
            exit = exit_of_status(rc, oom=oom and rc == -signal.SIGKILL)
            self._drop_cgroup()
        if self.stopping or self.killed:
            exit = replace(exit, stopped=True)
        self._finish(exit)

    def _finish(self, exit: Exit) -> None:
        self._exit = exit
        self._done.set()

    async def wait(self) -> Exit:
        await self._done.wait()
        return self._exit

    @property
    def running(self) -> bool:
        return self.proc is not None and not self._done.is_set()

    # ---- ending it

    async def stop(self, grace_s: float) -> Exit:
        """SIGTERM, wait up to grace_s, then SIGKILL; returns how it ended (`graceful`: it went on SIGTERM)."""
        if self._done.is_set() or self.proc is None:
            return await self.wait()
        self.stopping = True
        if self.container:
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 60
            while True:  # a container podman has not made yet cannot be stopped: try until it exists or ended
                rc, _, err = await self._podman("stop", "--time", str(max(0, int(round(grace_s)))), self.name,
                                                timeout=grace_s + 60)
                if rc == 0 or self.proc.returncode is not None or loop.time() > give_up:
                    break
                await asyncio.sleep(0.2)
            if rc != 0 and self.proc.returncode is None:
                log.warning("podman stop %s: %s", self.name, err.strip()[-300:])
                await self._podman("kill", "--signal", "KILL", self.name, timeout=30)
            r, out, _ = await self._podman("inspect", "--format", "{{.State.ExitCode}}", self.name, timeout=30)
            code = int(out.strip()) if r == 0 and out.strip().lstrip("-").isdigit() else None
            if code is None:  # already removed: podman run's own status tells
                await asyncio.wait_for(self.proc.wait(), 60)
                code = self.proc.returncode
            self._stop_graceful = code != 128 + signal.SIGKILL
        else:
            self._stop_graceful = await self._signal_and_wait(grace_s)
        return replace(await self.wait(), stopped=True, graceful=bool(self._stop_graceful))

    async def _signal_and_wait(self, grace_s: float) -> bool:
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            if sig == signal.SIGKILL and self._cgroup is not None:
                self._cgroup.kill_all()
            try:
                await asyncio.wait_for(self.proc.wait(), wait)
                return sig == signal.SIGTERM
            except asyncio.TimeoutError:
                continue
        return False

    async def kill(self) -> None:
        """SIGKILL now (the node is lost: nothing is reported, nothing waited for but the process's end)."""
        if self._done.is_set() or self.proc is None:
            return
        self.killed = True
        self._stop_graceful = False
        if self.container:
            await self._podman("kill", "--signal", "KILL", self.name, timeout=30)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self._cgroup is not None:
                self._cgroup.kill_all()
        await self.wait()
