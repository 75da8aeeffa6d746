#!/usr/bin/env python3
"""A small deterministic "training" program that shows a job resumes where it left off (docs/jobs.md, "An example
program"). Pure standard library: it runs as a plain process or in any image with python3.

It runs STEPS steps. Each step sleeps a little (the "work": --step-ms) and folds the step's number into a running
digest (a SHA-256 chain), so the final digest is the same however many times the run was stopped and resumed -- and
differs if a step were skipped or done twice. Every K steps (--every) it checkpoints into $GPUPOOL_CHECKPOINT_DIR: a
state file, then the manifest `checkpoint.json` -- {"path": "<state file's name in the directory>", "step": N,
"progress_ms": N} -- each written to a temporary file and renamed into place, so a reader (the node agent, a resumed
run) sees the old checkpoint or the new one, never half of one.

On start it resumes from $GPUPOOL_RESUME_FROM (a state file, a manifest, or a directory holding one; a path not
absolute is taken in the checkpoint directory) or else from the manifest in the checkpoint directory, and prints
"resumed from step N"; with neither, "starting from step 0". On SIGTERM (the pool's stop: preemption, drain,
migration) it finishes no further step, checkpoints where it is and exits 0 at once. At the end it prints
"digest <hex>" and writes {"digest": ..., "steps": ...} to `result.json` in the checkpoint directory.

    python3 digest_train.py [--steps 200] [--every 10] [--step-ms 50] [--seed 0]

Each option may also come from the environment (DIGEST_STEPS, DIGEST_EVERY, DIGEST_STEP_MS, DIGEST_SEED); the
command line wins. Exit status: 0 done or stopped by SIGTERM; 1 the checkpoint found is of another seed; 2 a bad
option. A resume point that cannot be read (a token that is no file) is passed over for the manifest.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

MANIFEST = "checkpoint.json"
RESULT = "result.json"
KEEP = 2  # state files kept (the manifest's and the one before it)


def initial(seed: int) -> bytes:
    return hashlib.sha256(f"gpupool digest_train seed={seed}".encode()).digest()


def fold(digest: bytes, step: int) -> bytes:
    """Step `step` (1, 2, ...) folded into the running digest."""
    return hashlib.sha256(digest + f"step {step}".encode()).digest()


def expected(steps: int, seed: int = 0) -> str:
    """The final digest of an uninterrupted run, computed at once (no sleeping)."""
    d = initial(seed)
    for i in range(1, steps + 1):
        d = fold(d, i)
    return d.hex()


def _write_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint(directory: str, step: int, digest: bytes, seed: int, step_ms: int) -> None:
    """The state at `step` to a state file, then the manifest naming it (each renamed into place); older state
    files beyond KEEP are removed."""
    name = f"state-{step:09d}.json"
    _write_atomic(os.path.join(directory, name), {"step": step, "digest": digest.hex(), "seed": seed})
    _write_atomic(os.path.join(directory, MANIFEST), {"path": name, "step": step, "progress_ms": step * step_ms})
    states = sorted(f for f in os.listdir(directory) if f.startswith("state-") and f.endswith(".json"))
    for old in states[:-KEEP]:
        if old != name:
            try:
                os.remove(os.path.join(directory, old))
            except OSError:
                pass
    print(f"checkpoint at step {step}", flush=True)


def _state_of(path: str, directory: str) -> dict | None:
    """The state a resume point names: a state file, a manifest (the state file it names), or a directory with a
    manifest; None when there is none there."""
    if not os.path.isabs(path):
        path = os.path.join(directory, path)
    if os.path.isdir(path):
        path = os.path.join(path, MANIFEST)
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and "path" in doc and "digest" not in doc:  # a manifest: the state file it names
        return _state_of(os.path.join(os.path.dirname(path), str(doc["path"])), directory)
    return doc if isinstance(doc, dict) and "step" in doc and "digest" in doc else None


def resume_point(directory: str, seed: int) -> tuple[int, bytes, str]:
    """(step, digest, what it came from): $GPUPOOL_RESUME_FROM, else the directory's manifest, else the start."""
    for where in (os.environ.get("GPUPOOL_RESUME_FROM", ""), MANIFEST):
        if not where:
            continue
        state = _state_of(where, directory)
        if state is None:
            continue
        if int(state.get("seed", seed)) != seed:
            raise SystemExit(f"digest_train: {where} is a checkpoint of seed {state.get('seed')}, not {seed}")
        return int(state["step"]), bytes.fromhex(state["digest"]), where
    return 0, initial(seed), ""


def _option(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="digest_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=_option("DIGEST_STEPS", 200))
    ap.add_argument("--every", type=int, default=_option("DIGEST_EVERY", 10), help="checkpoint every K steps")
    ap.add_argument("--step-ms", type=int, default=_option("DIGEST_STEP_MS", 50), help="work per step (sleep)")
    ap.add_argument("--seed", type=int, default=_option("DIGEST_SEED", 0))
    ap.add_argument("--dir", default=None, help="checkpoint directory (default $GPUPOOL_CHECKPOINT_DIR, else .)")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.every < 1 or args.step_ms < 0:
        ap.error("--steps >= 0, --every >= 1, --step-ms >= 0")
    directory = args.dir or os.environ.get("GPUPOOL_CHECKPOINT_DIR") or "."
    os.makedirs(directory, exist_ok=True)

    stop = {"asked": False}

    def on_term(signum, frame):  # noqa: ARG001 - the signal handler's signature
        stop["asked"] = True

    signal.signal(signal.SIGTERM, on_term)

    step, digest, source = resume_point(directory, args.seed)
    if source:
        print(f"resumed from step {step} ({source})", flush=True)
    else:
        print("starting from step 0", flush=True)
    saved = step
    while step < args.steps and not stop["asked"]:
        # the step's work: a sleep in slices, so a SIGTERM is answered within one slice, not one step
        end = time.monotonic() + args.step_ms / 1000
        while not stop["asked"]:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.02))
        if stop["asked"]:
            break  # this step is not done: the checkpoint is of the last one that is
        step += 1
        digest = fold(digest, step)
        if step % args.every == 0 or step == args.steps:
            checkpoint(directory, step, digest, args.seed, args.step_ms)
            saved = step
    if stop["asked"]:
        if saved != step:
            checkpoint(directory, step, digest, args.seed, args.step_ms)
        print(f"stopped by SIGTERM at step {step}", flush=True)
        return 0
    if saved != step:  # steps 0 (nothing to do) or a resume at the end
        checkpoint(directory, step, digest, args.seed, args.step_ms)
    _write_atomic(os.path.join(directory, RESULT), {"digest": digest.hex(), "steps": step, "seed": args.seed})
    print(f"digest {digest.hex()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
