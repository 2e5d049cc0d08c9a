"""Terminal progress bars for the CLI: model preparation and benchmarks.

    with Progress(40, "bench spec") as bar:
        for ...:
            ...
            bar.advance(note="pipesd plain")       # [bench spec] ████░░░░ 12/40 30% 0:42 <1:38
            bar.write("a log line")                # printed above the bar, not through it

    with Progress(3, "models", tick=True) as bar:  # long steps: the clock keeps moving
        bar.stage("loading")                         # shown while the step runs
        slow_call()
        bar.advance(note="saving")

    with Progress.step("dequantising"):             # one long call of unknown length: spinner
        slow_call()

Drawn on stderr, only when it is a terminal (`TANDEM_PROGRESS=1` forces it on, `=0` off), so
pipes, logs and `--json` output stay clean. No dependency beyond the standard library.
"""

from __future__ import annotations

import os
import sys
import threading
import time

WIDTH = 24


def _enabled(stream) -> bool:
    forced = os.environ.get("TANDEM_PROGRESS", "")
    if forced in ("0", "1"):
        return forced == "1"
    return bool(getattr(stream, "isatty", lambda: False)())


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def render(label: str, done: int, total: int | None, elapsed: float, note: str = "") -> str:
    """One line of a bar (pure, for tests): a known total gets a bar, a count, a percentage and
    an estimate of the time left; an unknown one a spinner and the elapsed time."""
    if total:
        frac = min(1.0, done / total)
        full = int(frac * WIDTH)
        bar = "█" * full + "░" * (WIDTH - full)
        left = f" <{_clock(elapsed / done * (total - done))}" if 0 < done < total else ""
        line = f"[{label}] {bar} {done}/{total} {frac:4.0%} {_clock(elapsed)}{left}"
    else:
        spin = "|/-\\"[int(elapsed * 4) % 4]
        line = f"[{label}] {spin} {_clock(elapsed)}"
    return line + (f"  {note}" if note else "")


class Progress:
    def __init__(self, total: int | None, label: str, stream=None, enabled: bool | None = None,
                 tick: bool = False):
        self.total, self.label, self.tick = total, label, tick
        self.stream = stream or sys.stderr
        self.enabled = _enabled(self.stream) if enabled is None else enabled
        self.done = 0
        self.note = ""
        self.start = time.monotonic()
        self._width = 0
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # --- drawing ---------------------------------------------------------------------------------
    def _draw(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            line = render(self.label, self.done, self.total, time.monotonic() - self.start,
                          self.note)
            self.stream.write("\r" + line.ljust(self._width))
            self.stream.flush()
            self._width = len(line)

    def _clear(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self.note = note
        self._draw()

    def stage(self, note: str) -> None:
        """Say what runs now, without advancing."""
        self.note = note
        self._draw()

    def write(self, line: str, file=None) -> None:
        """Print a line above the bar (to stdout unless `file`), then redraw the bar."""
        with self._lock:   # the ticker must not redraw between clearing and printing
            self._clear()
            self.stream.flush()
            print(line, file=file or sys.stdout, flush=True)
        self._draw()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1)
        if self.total is None:
            self.note = self.note or "done"
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        if self.enabled and self.tick and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")
            self._ticker.start()
        self._draw()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- a single long step ------------------------------------------------------------------------
    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            self._draw()

    @classmethod
    def step(cls, label: str, stream=None, enabled: bool | None = None) -> "Progress":
        """A context manager for one long call: spinner and elapsed time, redrawn 4 times a
        second (where the bar is drawn at all)."""
        return cls(None, label, stream, enabled, tick=True)
