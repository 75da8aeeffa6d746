"""What a job runs: the program part of a job request and of a placement (issue #32, docs/jobs.md).

A user gives an argv (never run through a shell by the node agent), an optional OCI image, environment variables of
their own, a working directory and named volumes from the operator's allow-list. The pool sets some variables itself
(the devices, the share limits, the checkpoint contract, the rendezvous of a gang): a request may not set those.
Everything here is checked where a request enters the pool (the model validators run in the gateway, the CLI and
every producer that builds these models), and again by the node agent before it starts anything.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Sizes: a request is a Kafka record and a line of the audit; a program's own configuration belongs in files.
ARGV_MAX_ITEMS = 1024
ARG_MAX_CHARS = 8192
ARGV_MAX_CHARS = 65536
ENV_MAX_ITEMS = 128
ENV_VALUE_MAX_CHARS = 8192
ENV_MAX_CHARS = 65536
MOUNTS_MAX = 16
RETRIES_MAX = 10

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# The names the pool sets itself (docs/jobs.md, "What a job sees"): a request may not set or override them.
RESERVED_ENV = frozenset({
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "LD_PRELOAD",
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY", "CUDA_DEVICE_MEMORY_SHARED_CACHE",  # HAMi-core's per-job accounting file
    "PORT",  # a serving replica's port (Serve below), as Heroku and Cloud Run name it; also GPUPOOL_PORT
})
RESERVED_ENV_PREFIXES = ("GPUPOOL_", "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "CUDA_MPS_", "PET_",
                         "TORCHELASTIC_")

# argv[0] names a program (a name looked up on PATH, or a path): a string with white space or a shell's
# metacharacters there is a shell line given as one item, which the agent would never run as the user meant.
PROGRAM_NAME = re.compile(r"[A-Za-z0-9_./+@:=,-]{1,4096}")
IMAGE_REF = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$"
VOLUME_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
# A path inside the job's file system: absolute, plain characters, no `.` or `..` segment.
PATH_CHARS = re.compile(r"/[A-Za-z0-9_.@+=,-]+(/[A-Za-z0-9_.@+=,-]+)*")
SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/etc", "/run", "/bin", "/sbin", "/lib", "/lib64", "/usr", "/boot")


def reserved_env(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def path_problem(path: str, what: str) -> str | None:
    if not PATH_CHARS.fullmatch(path) or any(seg in (".", "..") for seg in path.split("/")):
        return (f"{what} {path[:200]!r}: an absolute path of letters, digits and . _ - @ + = , only, without "
                f"'.' or '..' segments")
    return None


class Mount(BaseModel):
    """A named volume of the operator's allow-list (GPUPOOL_VOLUMES, docs/operators.md) mounted at `path` in the
    job. The request names the volume, never a host path: where it lives is the operator's to say."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    volume: Annotated[str, Field(pattern=VOLUME_NAME)]
    path: Annotated[str, Field(min_length=2, max_length=255)]
    read_only: bool = True

    @model_validator(mode="after")
    def _path(self):
        why = path_problem(self.path, "mount path")
        if why:
            raise ValueError(why)
        if self.path == "/" or any(self.path == d or self.path.startswith(d + "/") for d in SYSTEM_DIRS) \
                or self.path.startswith("/gpupool"):
            raise ValueError(f"mount path {self.path!r}: not over a system directory or the pool's own /gpupool")
        return self

    @classmethod
    def parse(cls, text: str) -> "Mount":
        """`NAME:/PATH[:ro|rw]` (read-only unless `:rw`), as `--volume` and a job file write it."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ValueError(f"volume {text!r}: want NAME:/PATH[:ro|rw] (NAME from the operator's list; a host path "
                             f"is never mounted by name)")
        if not re.fullmatch(VOLUME_NAME, parts[0]):
            raise ValueError(f"volume {text!r}: {parts[0][:80]!r} is not a volume's name (lower-case letters, digits, "
                             f". _ -): a job names a volume of the operator's list, never a host path")
        return cls(volume=parts[0], path=parts[1], read_only=len(parts) == 2 or parts[2] == "ro")

    def __str__(self) -> str:
        return f"{self.volume}:{self.path}:{'ro' if self.read_only else 'rw'}"


def program_problem(command: tuple[str, ...], env: dict[str, str], workdir: str, volumes: tuple[Mount, ...],
                    image: str | None) -> str | None:
    """Why a program may not be run as given, in words its sender reads; None when it may."""
    if len(command) > ARGV_MAX_ITEMS:
        return f"command: at most {ARGV_MAX_ITEMS} arguments, not {len(command)}"
    if sum(len(a) for a in command) > ARGV_MAX_CHARS:
        return f"command: at most {ARGV_MAX_CHARS} characters in all"
    for i, arg in enumerate(command):
        if "\x00" in arg:
            return f"command[{i}]: holds a NUL character, which no program can receive"
        if len(arg) > ARG_MAX_CHARS:
            return f"command[{i}]: at most {ARG_MAX_CHARS} characters"
    if command and not PROGRAM_NAME.fullmatch(command[0]):
        return (f"command[0] {command[0][:80]!r} is not a program name: the agent runs the argv as given and never "
                f"through a shell, so give the program and each argument as separate items (for a shell line, "
                f"say so: [\"sh\", \"-c\", \"...\"])")
    if (env or workdir or volumes or image) and not command and image is None:
        return "env, workdir and volumes need a command (or an image whose own command runs)"
    if len(env) > ENV_MAX_ITEMS:
        return f"env: at most {ENV_MAX_ITEMS} variables, not {len(env)}"
    if sum(len(k) + len(v) for k, v in env.items()) > ENV_MAX_CHARS:
        return f"env: at most {ENV_MAX_CHARS} characters in all"
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            return f"env: {name[:80]!r} is not a variable name (letters, digits and _, not starting with a digit)"
        if reserved_env(name):
            return (f"env: {name} is set by the pool itself (devices, share limits, checkpoints, rendezvous: "
                    f"docs/jobs.md) and may not be given by a request")
        if "\x00" in value:
            return f"env: {name} holds a NUL character"
        if len(value) > ENV_VALUE_MAX_CHARS:
            return f"env: {name}: at most {ENV_VALUE_MAX_CHARS} characters"
    if workdir:
        why = path_problem(workdir, "workdir")
        if why:
            return why
    if len(volumes) > MOUNTS_MAX:
        return f"volumes: at most {MOUNTS_MAX}"
    paths = [m.path for m in volumes]
    if len(set(paths)) != len(paths):
        return "volumes: two mounts at one path"
    return None


READINESS_PATH = r"^/[A-Za-z0-9_./~?=&%+-]{0,254}$"
METRICS_FLAVOURS = ("vllm", "sglang", "none")


class Serve(BaseModel):
    """How a replica of an inference service is reached (issue #33 item 4, docs/serving.md): the port it listens on
    (0: the node picks a free one), the path its readiness probe asks (a 200 answer: ready), and whose Prometheus
    names its metrics endpoint speaks (`vllm`, `sglang`, or `none`: its load is reported by hand, `inference.load`).
    The node tells the program its port in PORT and GPUPOOL_PORT."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    port: Annotated[int, Field(ge=0, le=65535, strict=True)] = 0
    readiness_path: Annotated[str, Field(pattern=READINESS_PATH)] = "/health"
    metrics: Literal["vllm", "sglang", "none"] = "none"
    metrics_path: Annotated[str, Field(pattern=READINESS_PATH)] = "/metrics"
