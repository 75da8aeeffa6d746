#!/usr/bin/env python3
"""A small deterministic distributed "training" program: the parts of a gang meet over TCP and all-reduce a value
every step (docs/jobs.md, "Gangs"). Pure standard library: it runs as a plain process or in any image with python3.

Each part is one process with the pool's rendezvous variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
TORCHELASTIC_RUN_ID, which names the attempt). Rank 0 listens on MASTER_ADDR:MASTER_PORT; the others connect,
retrying until --rendezvous-s has passed. Every step each rank sleeps --step-ms (its "work"), then contributes a value
of its own (a function of the seed, its rank and the step); rank 0 sums them and sends the sum back (a star
all-reduce), and every rank folds the step and the sum into a running SHA-256 digest -- the same on every rank, and
the same however often the gang was stopped and resumed, and different if a step were skipped or done twice.

Checkpoints, in each part's own $GPUPOOL_CHECKPOINT_DIR (the pool gives each part of a gang its own directory), every
--every steps: a state file `state-NNNNNNNNN.json` ({step, digest, seed, world}), then the manifest `checkpoint.json`
({"path", "step", "progress_ms"}), each written to a temporary file and renamed into place; the last KEEP state files
are kept. On start each rank offers the steps it has state files for (in its directory, and the one
$GPUPOOL_RESUME_FROM names); rank 0 picks the latest step every rank has and all resume from it -- a part killed
between two checkpoints, or one whose last checkpoint the pool never heard of, resumes with the others from their
common one. It prints "resumed from step N (agreed by P parts)", or "starting from step 0".

SIGTERM (the pool stopping the gang): no further step (one whose all-reduce is under way is abandoned); it
checkpoints its last finished step and exits 0 ("stopped by SIGTERM at step N"). A peer that goes away (its node lost, its process killed): it says "peer lost at step N" and
waits up to --peer-wait-s for the pool to stop it (the pool stops every part of a gang whose part failed or whose
node was lost); then it exits 3. At the end every rank prints "digest <hex>" and writes {"digest", "steps", "seed",
"world"} to `result.json` in its checkpoint directory.

    python3 allreduce_train.py [--steps 200] [--every 10] [--step-ms 50] [--seed 0]

Exit status: 0 done or stopped by SIGTERM; 2 a bad option or no rendezvous variables; 3 a peer lost and no stop
came; 4 the rendezvous did not complete in time.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import signal
import socket
import sys
import time

MANIFEST = "checkpoint.json"
RESULT = "result.json"
KEEP = 3  # state files kept: a part stopped a step or two after another still shares one with it
POLL_S = 0.05  # how often a blocked rank looks whether SIGTERM came


class PeerLost(Exception):
    pass


class Stopped(Exception):
    pass


def initial(seed: int, world: int) -> bytes:
    return hashlib.sha256(f"gpupool allreduce_train seed={seed} world={world}".encode()).digest()


def value(seed: int, rank: int, step: int) -> int:
    """What rank `rank` contributes at step `step`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{rank}:{step}".encode()).digest()[:4], "big")


def fold(digest: bytes, step: int, total: int) -> bytes:
    return hashlib.sha256(digest + f"step {step} sum {total}".encode()).digest()


def expected(steps: int, world: int, seed: int = 0) -> str:
    """The final digest of an uninterrupted run, computed at once (no network, no sleeping)."""
    d = initial(seed, world)
    for s in range(1, steps + 1):
        d = fold(d, s, sum(value(seed, r, s) for r in range(world)))
    return d.hex()


# ---------------------------------------------------------------- checkpoints

def _write_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint(directory: str, step: int, digest: bytes, seed: int, world: int, step_ms: int) -> None:
    name = f"state-{step:09d}.json"
    _write_atomic(os.path.join(directory, name), {"step": step, "digest": digest.hex(), "seed": seed, "world": world})
    _write_atomic(os.path.join(directory, MANIFEST), {"path": name, "step": step, "progress_ms": step * step_ms})
    states = sorted(f for f in os.listdir(directory) if f.startswith("state-") and f.endswith(".json"))
    for old in states[:-KEEP]:
        if old != name:
            try:
                os.remove(os.path.join(directory, old))
            except OSError:
                pass
    print(f"checkpoint at step {step}", flush=True)


def _read_state(path: str, directory: str) -> dict | None:
    """A state file, or the state file a manifest (or a directory holding one) names; None if none is there."""
    if not os.path.isabs(path):
        path = os.path.join(directory, path)
    if os.path.isdir(path):
        path = os.path.join(path, MANIFEST)
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and "path" in doc and "digest" not in doc:
        return _read_state(os.path.join(os.path.dirname(path), str(doc["path"])), directory)
    return doc if isinstance(doc, dict) and "step" in doc and "digest" in doc else None


def offered(directory: str, seed: int, world: int) -> dict[int, bytes]:
    """step -> digest of every state this rank could resume from: its directory's state files and the one
    $GPUPOOL_RESUME_FROM names (of this seed and world size), and step 0."""
    states = [_read_state(f, directory) for f in sorted(os.listdir(directory))
              if f.startswith("state-") and f.endswith(".json")]
    hint = os.environ.get("GPUPOOL_RESUME_FROM", "")
    if hint:
        states.append(_read_state(hint, directory))
    got = {0: initial(seed, world)}
    for st in states:
        if st and int(st.get("seed", -1)) == seed and int(st.get("world", -1)) == world:
            got[int(st["step"])] = bytes.fromhex(st["digest"])
    return got


# ---------------------------------------------------------------- the wire: one JSON object a line

class Line:
    """A connection read and written a JSON line at a time, never blocking past POLL_S without looking at `stop`."""

    def __init__(self, sock: socket.socket, stop: dict):
        self.sock, self.stop, self.buf = sock, stop, b""
        sock.settimeout(POLL_S)

    def send(self, doc: dict) -> None:
        try:
            self.sock.sendall(json.dumps(doc, sort_keys=True).encode() + b"\n")
        except OSError as exc:
            raise PeerLost(str(exc)) from exc

    def recv(self) -> dict:
        while b"\n" not in self.buf:
            if self.stop["asked"]:
                raise Stopped()
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as exc:
                raise PeerLost(str(exc)) from exc
            if not data:
                raise PeerLost("connection closed")
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)


def _listen(addr: str, port: int, deadline: float, stop: dict) -> socket.socket:
    """Rank 0's listening socket; a port still held (the previous attempt's master in its grace) is retried."""
    while True:
        s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
            s.listen(64)
            s.settimeout(POLL_S)
            return s
        except OSError as exc:
            s.close()
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline or stop["asked"]:
                raise
            time.sleep(0.2)


def rendezvous(rank: int, world: int, addr: str, port: int, run: str, offer: dict[int, bytes], deadline: float,
               stop: dict) -> tuple[int, list[Line], socket.socket | None]:
    """Meet the other ranks; returns (the step every rank resumes from, rank 0's connections to the others or a
    rank's one connection to rank 0, rank 0's listening socket)."""
    mine = sorted(offer)
    if rank == 0:
        lst = _listen(addr, port, deadline, stop)
        peers: dict[int, tuple[Line, list[int]]] = {}
        while len(peers) < world - 1:
            if stop["asked"]:
                raise Stopped()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(peers) + 1} of {world} parts met by the deadline")
            try:
                conn, _ = lst.accept()
            except socket.timeout:
                continue
            line = Line(conn, stop)
            try:
                hello = line.recv()
            except (PeerLost, ValueError):
                conn.close()
                continue
            r = hello.get("rank")
            if hello.get("run") != run or not isinstance(r, int) or not 0 < r < world or r in peers:
                conn.close()  # another attempt's part, or a rank already here: not this gang
                continue
            peers[r] = (line, list(hello.get("steps", [])))
        common = set(mine)
        for _, steps in peers.values():
            common &= set(steps)
        step = max(common)
        for r in sorted(peers):
            peers[r][0].send({"resume": step})
        return step, [peers[r][0] for r in sorted(peers)], lst
    while True:
        if stop["asked"]:
            raise Stopped()
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 at {addr}:{port} not reached by the deadline")
        try:
            sock = socket.create_connection((addr, port), timeout=1.0)
        except OSError:
            time.sleep(0.2)
            continue
        line = Line(sock, stop)
        try:
            line.send({"rank": rank, "run": run, "steps": mine})
            return int(line.recv()["resume"]), [line], None
        except (PeerLost, ValueError, KeyError):
            sock.close()  # rank 0 went away (or refused us): try again until the deadline
            time.sleep(0.2)


def allreduce(rank: int, lines: list[Line], step: int, mine: int) -> int:
    """The sum of every rank's value at `step` (rank 0 gathers and sends the sum back). A SIGTERM while it waits
    abandons the step (Stopped): nothing of it was folded, so the state is the last finished step's."""
    if rank == 0:
        total = mine
        for line in lines:
            got = line.recv()
            if got.get("step") != step:
                raise PeerLost(f"a peer is at step {got.get('step')}, not {step}")
            total += int(got["value"])
        for line in lines:
            line.send({"step": step, "sum": total})
        return total
    (line,) = lines
    line.send({"step": step, "value": mine})
    got = line.recv()
    if got.get("step") != step:
        raise PeerLost(f"rank 0 is at step {got.get('step')}, not {step}")
    return int(got["sum"])


def _option(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="allreduce_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=_option("ALLREDUCE_STEPS", 200))
    ap.add_argument("--every", type=int, default=_option("ALLREDUCE_EVERY", 10), help="checkpoint every K steps")
    ap.add_argument("--step-ms", type=int, default=_option("ALLREDUCE_STEP_MS", 50), help="work per step (sleep)")
    ap.add_argument("--seed", type=int, default=_option("ALLREDUCE_SEED", 0))
    ap.add_argument("--rendezvous-s", type=float, default=120.0, help="how long the parts may take to meet")
    ap.add_argument("--peer-wait-s", type=float, default=60.0, help="after a peer is lost, how long to wait for a stop")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default $GPUPOOL_CHECKPOINT_DIR, else .)")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.every < 1 or args.step_ms < 0:
        ap.error("--steps >= 0, --every >= 1, --step-ms >= 0")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        print(f"allreduce_train: the rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): {exc}",
              file=sys.stderr, flush=True)
        return 2
    if not 0 <= rank < world:
        print(f"allreduce_train: RANK {rank} outside WORLD_SIZE {world}", file=sys.stderr, flush=True)
        return 2
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    directory = args.dir or os.environ.get("GPUPOOL_CHECKPOINT_DIR") or "."
    os.makedirs(directory, exist_ok=True)

    stop = {"asked": False}

    def on_term(signum, frame):  # noqa: ARG001 - the signal handler's signature
        stop["asked"] = True

    signal.signal(signal.SIGTERM, on_term)

    offer = offered(directory, args.seed, world)
    print(f"rank {rank} of {world}: meeting at {addr}:{port}", flush=True)
    try:
        step, lines, lst = rendezvous(rank, world, addr, port, run, offer, time.monotonic() + args.rendezvous_s, stop)
    except Stopped:
        print("stopped by SIGTERM at step 0 (before the parts met)", flush=True)
        return 0
    except (TimeoutError, OSError) as exc:
        print(f"rendezvous failed: {exc}", file=sys.stderr, flush=True)
        return 4
    digest = offer[step]
    print(f"resumed from step {step} (agreed by {world} parts)" if step else "starting from step 0", flush=True)
    saved = step
    try:
        while step < args.steps and not stop["asked"]:
            end = time.monotonic() + args.step_ms / 1000
            while not stop["asked"] and time.monotonic() < end:
                time.sleep(min(max(end - time.monotonic(), 0), 0.02))
            if stop["asked"]:
                break
            total = allreduce(rank, lines, step + 1, value(args.seed, rank, step + 1))
            step += 1
            digest = fold(digest, step, total)
            if step % args.every == 0 or step == args.steps:
                checkpoint(directory, step, digest, args.seed, world, args.step_ms)
                saved = step
    except Stopped:
        pass  # SIGTERM in the middle of a step's all-reduce: the step is abandoned
    except PeerLost as exc:
        print(f"peer lost at step {step}: {exc}; waiting for the pool to stop this part", flush=True)
        for line in lines:  # the peers waiting on this one learn at once that the gang is broken
            line.sock.close()
        until = time.monotonic() + args.peer_wait_s
        while not stop["asked"] and time.monotonic() < until:
            time.sleep(POLL_S)
        if not stop["asked"]:
            print(f"no stop came in {args.peer_wait_s:g} s: failing", file=sys.stderr, flush=True)
            return 3
    finally:
        for line in lines:
            line.sock.close()
        if lst is not None:
            lst.close()
    if stop["asked"]:
        if saved != step:
            checkpoint(directory, step, digest, args.seed, world, args.step_ms)
        print(f"stopped by SIGTERM at step {step}", flush=True)
        return 0
    if saved != step:
        checkpoint(directory, step, digest, args.seed, world, args.step_ms)
    _write_atomic(os.path.join(directory, RESULT),
                  {"digest": digest.hex(), "steps": step, "seed": args.seed, "world": world})
    print(f"digest {digest.hex()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
