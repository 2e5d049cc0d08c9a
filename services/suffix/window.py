"""Window formation for split mode: gather ready requests until the window is full or its oldest
request has waited `window_ms`, then hand the window to a planner (planning.plan_window).

Pure: the caller supplies the clock (`now`, seconds, e.g. time.monotonic()) to every method, so
the dispatcher's event loop and tests with a fake clock drive it the same way. A loop looks like:
add() on each ready hidden state; sleep until deadline(); take(now) when ready(now).

The DySCo paper's exact-match and DSB windows are 8 ms / 8 requests (the defaults). FIFO and
interleaving serve one session per call; their callers use WindowConfig(window_ms=0, max_size=1)
so every request is its own window. That choice belongs to the caller, not to this module.
"""

from collections import deque
from dataclasses import dataclass

from services.suffix.planning import Request


@dataclass(frozen=True)
class WindowConfig:
    window_ms: float = 8.0  # longest the oldest pending request waits before its window closes
    max_size: int = 8  # requests per window; the window closes as soon as it is full

    def __post_init__(self):
        if self.window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {self.window_ms}")
        if self.max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {self.max_size}")


class WindowBuilder:
    """Pending requests, oldest first; the current window is the first max_size of them."""

    def __init__(self, config: WindowConfig = WindowConfig()):
        self.config = config
        self.pending: deque[tuple[float, Request]] = deque()  # (time added, request)

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, request: Request, now: float) -> None:
        # One request per session: a second would make the session run its suffix twice in one
        # step, and a session cannot have its next hidden state before its previous token.
        if any(r.sid == request.sid for _, r in self.pending):
            raise ValueError(f"session {request.sid!r} already has a pending request")
        if self.pending and now < self.pending[-1][0]:
            raise ValueError(f"clock went backwards: {now} < {self.pending[-1][0]}")
        self.pending.append((now, request))

    def deadline(self) -> float | None:
        """When the current window closes: its oldest request's timer, or earlier the moment it
        filled up. None when nothing is pending."""
        if not self.pending:
            return None
        timer = self.pending[0][0] + self.config.window_ms / 1000.0
        if len(self.pending) >= self.config.max_size:
            return min(timer, self.pending[self.config.max_size - 1][0])
        return timer

    def ready(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def take(self, now: float) -> list[Request]:
        """Remove and return the window closed by `now` (up to max_size, oldest first), or [] if
        it is still open. Later requests stay pending; their window's timer runs from the oldest
        of them. take(math.inf) flushes one window regardless of time."""
        if not self.ready(now):
            return []
        n = min(self.config.max_size, len(self.pending))
        return [self.pending.popleft()[1] for _ in range(n)]
