"""The SDK's link to its dispatcher, and when a request cut off by a lost dispatcher is resumed:
pure decisions, no sockets (tandem/client.py does the I/O).

The client pings its dispatcher every `heartbeat_s`; every Pong names the dispatcher's run
(`Pong.instance`, random per process start). The dispatcher is lost, and every request in flight
on it with it, when

* a Pong comes from another run than the one before: it restarted, and the requests the old run
  held are gone (a supervised restart is often back before any silence is noticed), or
* nothing has been heard for `timeout_s` after it had answered, and one more ping went
  unanswered (tandem/client.py): it died, hangs, or the link is cut. (A peer that never
  answers a ping is never declared lost: the request's deadline bounds it.)

A lost request is re-submitted as a continuation (GenerateRequest.resume_ids: the prompt plus the
tokens already delivered, at the same positions and seed), at most `max_resumes` times and
within its deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HEARTBEAT_S = 1.0    # a ping per second while the client is open
DEFAULT_TIMEOUT_S = 4.0      # this long without a Pong: the dispatcher is lost
DEFAULT_MAX_RESUMES = 3      # continuations of one request after lost dispatchers


@dataclass
class LinkState:
    """What the client knows of its dispatcher from the heartbeat."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    instance: str = ""          # the run that answered last ("" before any answer)
    last_heard: float | None = None   # monotonic time of the last Pong (None: none yet)
    ready: bool = False         # the last Pong said ready (a restarted run loads its tokenizer)
    silent_lost: bool = False   # the current silence was already reported

    def heard(self, instance: str, ready: bool, now: float) -> bool:
        """A Pong arrived. True when it shows the dispatcher was lost: another run answers."""
        restarted = bool(self.instance) and bool(instance) and instance != self.instance
        if instance:
            self.instance = instance
        self.last_heard, self.ready, self.silent_lost = now, ready, False
        return restarted

    def overdue(self, now: float) -> bool:
        """Nothing heard for timeout_s (a query: `silent` decides)."""
        return self.last_heard is not None and now - self.last_heard > self.timeout_s

    def silent(self, now: float) -> bool:
        """True once per silence, when nothing has been heard for timeout_s."""
        if self.silent_lost:
            return False
        if self.overdue(now):
            self.silent_lost, self.ready = True, False
            return True
        return False


def resume_refusal(resumes: int, max_resumes: int, left_s: float) -> str:
    """Why a request whose dispatcher was lost is not resumed ("" = resume it): its resume
    budget is spent, or its deadline has passed."""
    if resumes >= max_resumes:
        return f"its resume budget is spent ({resumes} of max_resumes = {max_resumes})"
    if left_s <= 0:
        return "its deadline has passed"
    return ""
