"""Why a run ended, said once for everyone who says it: the scheduler's back-off reason, the job view, the jobs list's
text and `explain`/`history` (docs/jobs.md, "Exit reasons and retries"). Pure: no clock, no I/O.

A failed run's report (`job.failed`) carries a code from a closed vocabulary (schemas/events.EXIT_CODES), the exit
code or the signal where there is one, and a reason in words. A report from before exit reasons (code None) is read
as it always was: its reason alone."""
from __future__ import annotations

# The few signals a person meets when a program dies (POSIX numbers, the same on every Linux architecture the pool
# runs on); any other is said by its number.
SIGNALS = {1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
           11: "SIGSEGV", 13: "SIGPIPE", 14: "SIGALRM", 15: "SIGTERM"}

# Back-off between a failed run and the next (Kubernetes' pod back-off: 10 s doubling, capped at five minutes), in
# log time: the scheduler's only clock.
BACKOFF_BASE_MS = 10_000
BACKOFF_CAP_MS = 300_000


def backoff_ms(failures: int) -> int:
    """The wait before the run after the `failures`-th failed one (1, 2, ...): 10 s x 2^(failures-1), at most 5 min."""
    if failures < 1:
        return 0
    return min(BACKOFF_BASE_MS << min(failures - 1, 20), BACKOFF_CAP_MS)


def exit_label(code: str | None, exit_code: int | None = None, signal: int | None = None) -> str:
    """The short form a list shows: "ExitCode 3", "Signal 9 (SIGKILL)", "OOMKilled", ...; "" for a report without a
    code (before exit reasons)."""
    if not code:
        return ""
    if code == "ExitCode" and exit_code is not None:
        return f"ExitCode {exit_code}"
    if code == "Signal" and signal is not None:
        name = SIGNALS.get(signal)
        return f"Signal {signal}" + (f" ({name})" if name else "")
    return code


def exit_words(code: str | None, exit_code: int | None = None, signal: int | None = None) -> str:
    """What a sentence says of it: "exit code 3", "killed by signal 9 (SIGKILL)", "out of memory (OOMKilled)", ...;
    "" for a report without a code."""
    if not code:
        return ""
    if code == "ExitCode":
        return f"exit code {exit_code}" if exit_code is not None else "a non-zero exit code"
    if code == "Signal":
        if signal is None:
            return "killed by a signal"
        name = SIGNALS.get(signal)
        return f"killed by signal {signal}" + (f" ({name})" if name else "")
    return {"OOMKilled": "killed out of memory (OOMKilled)", "ImageNotFound": "image not found (ImageNotFound)",
            "CommandNotFound": "command not found (CommandNotFound)",
            "ShareExceeded": "held more than its share of a card (ShareExceeded)",
            "StartFailed": "could not be started (StartFailed)",
            "VolumeUnavailable": "a volume it asked for is unavailable (VolumeUnavailable)",
            "Simulated": "a simulated failure (Simulated)"}.get(code, code)


def failure_text(code: str | None, reason: str, exit_code: int | None = None, signal: int | None = None) -> str:
    """The whole sentence of one failed run: the code's words and the node's reason ("exit code 1: loss is NaN");
    a report without a code reads as before, its reason alone."""
    words = exit_words(code, exit_code, signal)
    if not words:
        return reason
    if not reason or reason == words:
        return words
    return f"{words}: {reason}"
