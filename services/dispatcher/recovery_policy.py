"""What to do when a cloud session fails, as pure decisions (no I/O, no clock of its own):
replay it, give up, or let the error through — and which replicas a replay may use.

services/dispatcher/recovery.py does the I/O (reconnecting, replaying); it asks `decide` after
every failure and `ReplicaHealth` before choosing a replica, passing the time in. So every rule
here is unit-tested without processes (tests/unit/test_recovery_policy.py).

Rules
* Only a failure that a replay can cure is retried: the replica went down (`unavailable`),
  restarted (`unknown_session`), or lost messages (`unknown_round`, a token gap, a stall).
  Anything else (`bad_field`, `busy`, `internal`, ...) is the request's answer.
* A request that is finished or cancelled is never replayed; one whose deadline has passed ends
  with `deadline`; one that has been replayed `max_recoveries` times gives up with its error.
* Replays back off exponentially with jitter (Petals' and openai-python's way), so a replica
  that restarts is not hit by every session at the same instant; the wait never runs past the
  request's deadline.
* A replica that fails `ban_failures` times within `ban_window_s` is banned for `ban_s`: new
  sessions and replays go elsewhere (the sessions one crash fails together count once). A ban
  never leaves a request without a replica: when every replica that is up is banned, they are
  all eligible again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common import protocol

# wire codes a replay can cure, and the reason (a metrics label) each stands for
RECOVERABLE = {protocol.UNAVAILABLE: "down", protocol.UNKNOWN_SESSION: "restarted",
               protocol.UNKNOWN_ROUND: "gap"}


@dataclass(frozen=True)
class RecoveryPolicy:
    max_recoveries: int = 8        # replays of one request before it gives up
    backoff_s: float = 0.05        # wait before the first replay; doubles with every replay
    backoff_max_s: float = 2.0     # cap on that wait
    jitter: float = 0.25           # the wait is scaled by a factor in [1 - jitter, 1 + jitter]
    ban_failures: int = 3          # a replica failing this many times ...
    ban_window_s: float = 30.0     # ... within this window ...
    ban_s: float = 15.0            # ... gets no new sessions for this long; 0 = never banned
    incident_s: float = 2.0        # failures of one replica this close together are one failure
                                   # (a crash fails every session it held at once)


@dataclass(frozen=True)
class Replay:
    """Replay the session (on a live replica) after waiting `delay_s`."""
    reason: str
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """End the request with this error (its own code, or `deadline`)."""
    code: str
    message: str


@dataclass(frozen=True)
class PassThrough:
    """Not a failure recovery can help with: the error is the request's answer, unchanged."""


Decision = Replay | GiveUp | PassThrough


def decide(policy: RecoveryPolicy, *, code: str, message: str, reason: str | None,
           replays: int, time_left: float, finished: bool, tokens: int,
           rand: float = 0.5) -> Decision:
    """The decision after a failure. `reason`: the dispatcher's own diagnosis (gap, stall), else
    None to go by `code`; `replays`: replays so far; `tokens`: tokens streamed so far (for the
    message); `rand`: a uniform draw in [0, 1) for the jitter."""
    reason = reason or RECOVERABLE.get(code)
    if reason is None or finished:
        return PassThrough()
    if time_left <= 0:
        # no time left to replay in: the request ran out of time, whatever interrupted it
        return GiveUp(protocol.DEADLINE, f"deadline passed after {tokens} tokens ({message})")
    if replays >= policy.max_recoveries:
        return GiveUp(code, f"{message} (gave up after {replays} replays)")
    return Replay(reason, backoff(policy, replays, time_left, rand))


def backoff(policy: RecoveryPolicy, replays: int, time_left: float, rand: float = 0.5) -> float:
    """Wait before replay number `replays + 1`: exponential, capped, jittered, within the
    time left."""
    base = min(policy.backoff_max_s, policy.backoff_s * (2 ** replays))
    scale = 1.0 + policy.jitter * (2.0 * rand - 1.0)
    return max(0.0, min(base * scale, time_left))


@dataclass
class ReplicaHealth:
    """Failures per replica, and the bans they earn (one per role on a dispatcher)."""
    policy: RecoveryPolicy
    failures: dict[str, deque] = field(default_factory=dict)
    banned_until: dict[str, float] = field(default_factory=dict)

    def failed(self, replica: str, now: float) -> bool:
        """A session failed on `replica` at `now`; True when this failure bans it."""
        times = self.failures.setdefault(replica, deque())
        if times and now - times[-1] < self.policy.incident_s:
            return False   # the same incident as the failure before
        times.append(now)
        while times and times[0] < now - self.policy.ban_window_s:
            times.popleft()
        if self.policy.ban_s > 0 and len(times) >= self.policy.ban_failures \
                and not self.banned(replica, now):
            self.banned_until[replica] = now + self.policy.ban_s
            times.clear()
            return True
        return False

    def banned(self, replica: str, now: float) -> bool:
        return self.banned_until.get(replica, 0.0) > now

    def eligible(self, up: list[str], now: float) -> list[str]:
        """Of the replicas that are up, those a session may use: the unbanned ones, or all of
        them when every one is banned (a ban must not fail a request that has a replica)."""
        ok = [r for r in up if not self.banned(r, now)]
        return ok or list(up)
