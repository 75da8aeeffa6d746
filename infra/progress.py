"""Progress a person sees, on stderr: a spinner or a bar (rich) when stderr is a terminal, one line per step
otherwise, so logs, pipes and tests stay plain. Used by `gpupool up`, `kafka fetch`, `audit replay` and
`simulate`."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


def interactive() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _console():
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def status(text: str) -> Iterator[Callable[[str], None]]:
    """A spinner with `text` while the block runs; yields a function that changes the text. Plain: one line."""
    if not interactive():
        print(f"{text} ...", file=sys.stderr, flush=True)
        yield lambda t: print(f"{t} ...", file=sys.stderr, flush=True)
        return
    with _console().status(text) as st:
        yield lambda t: st.update(t)


class Bar:
    """`update(done, total)`: a bar with count and ETA on a terminal; otherwise a line at each tenth."""

    def __init__(self, label: str):
        self.label = label
        self._next = 10
        self._rich = None
        if interactive():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._rich = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), console=_console(), transient=False)
            self._task = self._rich.add_task(label, total=None)
            self._rich.start()

    def update(self, done: int, total: int | None) -> None:
        if self._rich is not None:
            self._rich.update(self._task, completed=done, total=total)
            return
        pct = 100 * done // total if total else 100
        while pct >= self._next:
            print(f"{self.label}: {self._next}% ({done}/{total})", file=sys.stderr, flush=True)
            self._next += 10

    __call__ = update

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
