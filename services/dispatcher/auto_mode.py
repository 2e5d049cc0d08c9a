"""mode="auto" on the dispatcher: which candidates a request has, the live link figures, and
the estimates fed by every finished request. Wiring only; the decision is
services/dispatcher/auto_policy.py.

An auto request is admitted as the mode chosen for it: `admit` returns the request rewritten as
if the client had named that mode (and policy or cut), so the chosen mode runs it unchanged,
its metrics carry the chosen mode, and its Done.stats say why (`auto`, `segments`).

Candidates: cloud-only always; the configured spec policies (or the request's own `policy`)
while the drafter is up; split at the configured cuts (or the request's own `cut`) while the
prefix and a suffix are up. A policy or cut the request names itself is checked like in its
mode (a bad one is a bad field); a configured one this request cannot use (the oracle trigger
with sampling) is left out.
"""

from __future__ import annotations

import math

import msgspec

from common import metrics, protocol
from common.protocol import ProtocolError
from services.dispatcher import auto_policy
from services.dispatcher.auto_policy import CLOUD_ONLY, Candidate, Choice, Estimates, Link
from services.dispatcher.config import names
from services.dispatcher.spec_mode import check_knobs, check_policy
from services.dispatcher.spec_session import POLICIES
from services.dispatcher.split_mode import check_cut

NAME = "auto"


class Auto:
    def __init__(self, cfg):
        self.cfg = cfg
        self.estimates = Estimates(ewma=cfg.auto.ewma)
        self.admitted = 0      # auto requests admitted: every explore_every-th one may explore

    def policies(self) -> list[str]:
        return names(self.cfg.auto.policies)

    def cuts(self) -> list[int]:
        return [int(c) for c in names(self.cfg.auto.cuts)] or [self.cfg.split.cut]

    def slo_s(self, msg: protocol.GenerateRequest) -> float | None:
        ms = msg.tpt_slo_ms or self.cfg.auto.tpt_slo_ms
        return ms / 1000.0 if ms > 0 else None

    def candidates(self, d, msg: protocol.GenerateRequest) -> list[Candidate]:
        """The candidates of this request now (raises ProtocolError for a policy or cut the
        request names that its mode would refuse)."""
        out = [CLOUD_ONLY]
        s = msgspec.structs.replace(msg.sampling, coupling=msg.sampling.coupling
                                    or d.cfg.sampling_coupling)
        if msg.policy:
            check_knobs(check_policy(msg.policy, s), msg.policy_knobs)
        if msg.cut:
            check_cut(d.cfg.target, msg.cut)
        if "spec" in d.modes and d.drafter.up:
            for name in [msg.policy] if msg.policy else self.policies():
                try:
                    check_knobs(check_policy(name, s), msg.policy_knobs)
                except ProtocolError:
                    continue
                out.append(Candidate("spec", policy=name))
        if "split" in d.modes and d.prefix.up and any(p.up for p in d.suffixes):
            for cut in [msg.cut] if msg.cut else self.cuts():
                try:
                    check_cut(d.cfg.target, cut)
                except ProtocolError:
                    continue
                out.append(Candidate("split", cut=cut))
        return out

    def link(self, d) -> Link:
        edge = d.modes["spec"].edge if "spec" in d.modes else None
        rtt = d.verifier.rtt if d.verifier is not None else math.nan
        rtt = rtt if math.isfinite(rtt) else 0.0
        if edge is None:
            return Link(rtt_s=rtt)
        alpha, beta = edge.link.params()
        return Link(rtt_s=rtt, alpha_s=alpha, beta_s=beta, gamma_s=edge.speed.gamma)

    def admit(self, d, msg: protocol.GenerateRequest
              ) -> tuple[protocol.GenerateRequest, Choice]:
        """Choose for an auto request: the request as the chosen mode would get it, and why."""
        slo = self.slo_s(msg)
        candidates = self.candidates(d, msg)
        every = self.cfg.auto.explore_every
        explore = every > 0 and self.admitted % every == every - 1
        self.admitted += 1
        choice = auto_policy.choose(candidates, self.estimates, self.link(d), slo, explore)
        c = choice.candidate
        chosen = msgspec.structs.replace(msg, mode=c.mode, policy=c.policy if c.mode == "spec"
                                         else msg.policy, cut=c.cut or msg.cut)
        metrics.AUTO_CHOICES.labels(d.name, c.mode, c.label, choice.reason).inc()
        return chosen, choice

    def observe(self, d, stats: dict) -> None:
        """A request that finished normally (any mode, chosen or named): its figures feed the
        estimates. Requests too short to time a decode step, and speculative ones that lost
        their drafter or ran degraded, teach nothing and are skipped."""
        n = stats.get("generated_tokens") or 0
        ttft = stats.get("ttft_s")
        if n < 2 or ttft is None:
            return
        decode = max(0.0, stats["duration_s"] - ttft) / (n - 1)
        e = self.estimates
        if stats["mode"] == "cloud-only":
            e.observe_cloud(decode)
        elif stats["mode"] == "spec":
            if stats.get("drafter_lost") or stats.get("degraded") or not stats.get("rounds") \
                    or stats.get("acceptance_rate") is None:
                return
            policy = POLICIES.get(stats["policy"])
            e.observe_spec(stats["policy"], self.link(d),
                           acceptance=stats["acceptance_rate"],
                           draft_len=stats["mean_draft_length"],
                           forwards_per_token=stats.get("cloud_forwards_per_token") or 1.0,
                           decode_s_per_token=decode,
                           proactive=bool(policy and policy.proactive))
        elif stats["mode"] == "split" and stats.get("cut"):
            e.observe_split(stats["cut"], stats.get("edge_forward_s", 0.0) / n,
                            stats.get("cloud_forward_s", 0.0) / n)


def declare_metrics(service: str, policies: list[str]) -> None:
    """The choice counters this dispatcher can move, at 0."""
    for mode, label in [("cloud-only", "cloud-only"), ("split", "split"),
                        *[("spec", p) for p in policies]]:
        for reason in auto_policy.REASONS:
            metrics.AUTO_CHOICES.labels(service, mode, label, reason)
