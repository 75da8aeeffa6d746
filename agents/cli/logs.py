"""`gpupool logs JOB [-f] [--attempt N] [--part K] [--tail N]`: a job's program output, as its node shipped it
(docs/jobs.md, "Logs"). Asks the worker's /api/logs as the acting principal: a tenant's member reads its own tenant's
jobs, operators any job; nobody else."""
from __future__ import annotations

import io
import json
import sys
import time

from agents.cli.views import _job, _not_on_record
from agents.client import Client

FOLLOW_EVERY_S = 1.0  # how often -f asks for what came after its cursor
STREAMS = ("stdout", "stderr")


def dropped_line(n: int) -> str:
    return f"[... {n} bytes dropped by the log cap ...]"


class Printer:
    """Writes pieces in the order given: a header where the run (attempt, part) changes, a line saying what the
    caps cut where they cut it, the text as it was written. A piece seen before (the same run, stream and number:
    a re-relayed copy) is not written again."""

    def __init__(self, out, headers: bool = True):
        self.out = out
        self.headers = headers
        self.seen: set[tuple[int, int, str, int]] = set()
        self.finals: set[tuple[int, int, str]] = set()
        self.parts: dict[int, set[int]] = {}  # attempt -> its parts seen
        self.run: tuple[int, int] | None = None
        self.where: tuple[int, int, str] | None = None  # the run and stream the last text was of
        self.open_line = False  # the last text written did not end its line

    def _newline(self) -> None:
        if self.open_line:
            self.out.write("\n")
            self.open_line = False

    def piece(self, p: dict) -> None:
        key = (p["attempt"], p["part"], p["stream"], p["seq"])
        if key in self.seen:
            return
        self.seen.add(key)
        self.parts.setdefault(p["attempt"], set()).add(p["part"])
        if p["final"]:
            self.finals.add(key[:3])
        run = (p["attempt"], p["part"])
        if run != self.run:
            self._newline()
            if self.headers:
                self.out.write(f"==> attempt {p['attempt']}, part {p['part']} on {p['node']} <==\n")
            self.run = run
        if key[:3] != self.where and (p["text"] or p["dropped_bytes"]):
            self._newline()  # another stream's text starts on its own line
        if p["dropped_bytes"]:
            self._newline()
            self.out.write(dropped_line(p["dropped_bytes"]) + "\n")
        if p["text"]:
            self.out.write(p["text"])
            self.open_line = not p["text"].endswith("\n")
            self.where = key[:3]

    def close(self) -> None:
        self._newline()

    def ended(self) -> bool:
        """Whether the latest run seen has ended: both streams of each of its parts have their final piece."""
        if not self.parts:
            return False
        attempt = max(self.parts)
        return all((attempt, part, s) in self.finals for part in self.parts[attempt] for s in STREAMS)


def last_lines(text: str, n: int) -> str:
    """The last `n` lines of rendered output, under the header of the run they start in."""
    lines = text.splitlines(keepends=True)
    kept = lines[-n:] if n else []
    if kept and not kept[0].startswith("==> "):
        header = next((ln for ln in reversed(lines[:len(lines) - len(kept)]) if ln.startswith("==> ")), None)
        if header is not None:
            kept.insert(0, header)
    return "".join(kept)


def cmd_logs(cfg, args) -> int:
    c = Client(cfg)
    job = _job(c, args.job)
    params = {"job": job, "attempt": args.attempt, "part": args.part}
    as_json = args.format == "json"
    printer = Printer(sys.stdout, headers=not args.quiet)

    def show(pieces: list[dict]) -> None:
        for p in pieces:
            if as_json:
                if (p["attempt"], p["part"], p["stream"], p["seq"]) not in printer.seen:
                    printer.seen.add((p["attempt"], p["part"], p["stream"], p["seq"]))
                    print(json.dumps(p))
            else:
                printer.piece(p)
        sys.stdout.flush()

    after = -1
    if args.tail is not None:
        # the last N lines: the pieces that end the output (each holds at least a line's part), cut to N lines
        doc = c.api("/api/logs", {**params, "tail": max(1, args.tail)})
        pieces, after = doc["pieces"], doc["next"]
        if as_json:
            show(pieces)
        else:
            buf = io.StringIO()
            render = Printer(buf, headers=not args.quiet)
            for p in pieces:
                render.piece(p)
            render.close()
            sys.stdout.write(last_lines(buf.getvalue(), args.tail))
            printer.seen, printer.parts, printer.finals = render.seen, render.parts, render.finals
            printer.run, printer.where = render.run, render.where
        got_any = bool(pieces)
    else:
        got_any = False
        while True:
            doc = c.api("/api/logs", {**params, "after": after})
            show(doc["pieces"])
            got_any = got_any or bool(doc["pieces"])
            after = doc["next"]
            if not doc["more"]:
                break
    if args.follow:
        try:
            while not printer.ended():
                time.sleep(FOLLOW_EVERY_S)
                doc = c.api("/api/logs", {**params, "after": after})
                show(doc["pieces"])
                got_any = got_any or bool(doc["pieces"])
                after = doc["next"]
        except KeyboardInterrupt:
            pass
    if not as_json:
        printer.close()
    if not got_any:
        said = _not_on_record(c, args.job, job)
        print(said.replace("no job", "no output of job", 1) if said.startswith("no job") else said, file=sys.stderr)
        return 1
    return 0
