"""mode="auto" on the dispatcher: which candidates a request has, the live link figures, and
the estimates fed by every finished request. Wiring only; the decision is
services/dispatcher/auto_policy.py.

An auto request is admitted as the mode chosen for it: `admit` returns the request rewritten as
if the client had named that mode (and policy or cut), so the chosen mode runs it unchanged,
its metrics carry the chosen mode, and its Done.stats say why (`auto`, `segments`).

Switching. A request that starts speculative (a chain policy) or cloud-only, with the other of
the two among its candidates, runs as stretches (`run`): every `auto_switch_every` tokens the
running stretch asks auto_policy.recheck (at once when the link's round trip moved,
auto_policy.link_moved); on a switch it stops at a token boundary and leaves
its verifier session open, and the next stretch opens with `adopt` naming it (protocol ADOPT):
the verifier keeps the KV cache of the committed tokens and prefills only the last one or two.
Switching to cloud-only, the verifier decodes on from there, and the drafter session stays
open, idle; switching back to speculative, it is rolled back to the committed tokens it holds
and catches up on the ones committed since (a new request's first speculative stretch opens it
on the whole stream). The output stays exactly the target's: every stretch starts from exactly
the committed tokens.

Candidates: cloud-only always; the configured spec policies (or the request's own `policy`)
while the drafter is up; split at the configured cuts (or the request's own `cut`) while the
prefix and a suffix are up. A policy or cut the request names itself is checked like in its
mode (a bad one is a bad field); a configured one this request cannot use (the oracle trigger
with sampling) is left out.
"""

from __future__ import annotations

import asyncio
import math
import time

import msgspec

from common import metrics, protocol
from common.protocol import ProtocolError
from common.runtime import PeerError
from services.dispatcher import auto_policy, cloud_only
from services.dispatcher.auto_policy import CLOUD_ONLY, Candidate, Choice, Estimates, Link, Switch
from services.dispatcher.config import names
from services.dispatcher.spec.mode import check_knobs, check_policy, spec_run
from services.dispatcher.spec.session import POLICIES
from services.dispatcher.spec.verifier_link import OPEN_SEQ
from services.dispatcher.split_mode import check_cut

NAME = "auto"
# a speculative stretch's figures, copied into its segment of Stats.segments
SPEC_FIGURES = ("rounds", "acceptance_rate", "mean_draft_length", "cloud_forwards_per_token")


class Auto:
    """mode="auto" on one dispatcher: its estimates, shared by every request."""

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
              ) -> tuple[protocol.GenerateRequest, Choice, Candidate | None]:
        """Choose for an auto request: the request as the chosen mode would get it, why, and
        the mode it may switch to while it runs (None: it does not switch)."""
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
        return chosen, choice, self.partner(choice, candidates)

    def partner(self, choice: Choice, candidates: list[Candidate]) -> Candidate | None:
        """What a request started as `choice` may switch to: cloud-only from a chain policy,
        from cloud-only the chain policy predicted fastest (or the first)."""
        if self.cfg.auto.switch_every <= 0:
            return None
        c = choice.candidate
        if c.mode == "spec":
            return CLOUD_ONLY if switchable(c.policy) else None
        if c.mode != "cloud-only":
            return None
        specs = [x for x in candidates if x.mode == "spec" and switchable(x.policy)]
        predicted = {p.candidate: p.tpt_s for p in choice.predictions}
        return min(specs, key=lambda x: predicted.get(x, math.inf), default=None)

    async def run(self, req) -> None:
        """Serve a request that may switch: its stretches in turn, each adopting the verifier
        session (and the drafter session) the ones before left open. A request chosen for a
        spec policy starts cloud-only while its drafter session opens (`cloud_first`): the
        verifier's prefill gives the first token, the drafter's runs beside it, and the request
        switches to the policy once the drafter holds the prompt."""
        d, cfg = req.d, self.cfg.auto
        current, other, why = req.choice.candidate, req.switch_to, req.choice.reason
        slo = self.slo_s(req.msg)
        handover = drafter = None
        forwards = 0   # the verifier's forwards for this request: one per cloud-only token
        prefill: asyncio.Task | None = None   # the drafter session opening beside the cloud
        if cfg.cloud_first and current.mode == "spec" and other == CLOUD_ONLY and not req.tokens:
            prefill = asyncio.get_running_loop().create_task(
                open_drafter(req, current.policy, self.cfg.spec.q_width))
            current, other, why = CLOUD_ONLY, current, auto_policy.CLOUD_FIRST
        try:
            while True:
                start = len(req.tokens)
                segment = {"mode": current.mode, "policy": current.label, "tokens": 0,
                           "why": why}
                req.segments.append(segment)
                began = time.monotonic()
                verdict: list[Switch] = []
                window: list[tuple[int, float]] = []   # where the live figure's window starts
                judged_rtt: list[float] = []           # the round trip it was last judged on

                def due(current=current, other=other, start=start, segment=segment,
                        verdict=verdict, window=window, judged_rtt=judged_rtt,
                        opening=prefill if why == auto_policy.CLOUD_FIRST else None) -> bool:
                    n, now = len(req.tokens), time.monotonic()
                    segment["tokens"] = n - start
                    if opening is not None:   # a cloud-first stretch: until the drafter is ready
                        if not opening.done():
                            return False
                        if opening.result() is not None and req.max_tokens - n > 1:
                            verdict.append(Switch(other, auto_policy.SWITCH_DRAFTER_READY))
                            return True
                    link = self.link(d)
                    if not window:   # the stretch's first token (its prefill) is not its pace
                        window.append((n, now))
                        judged_rtt.append(link.rtt_s)
                        return False
                    n0, t0 = window[0]
                    moved = (n - start >= auto_policy.MIN_STRETCH_TOKENS and auto_policy.link_moved(
                        judged_rtt[0], link.rtt_s, cfg.link_move))
                    if n - n0 < cfg.switch_every and not moved:
                        return False
                    live = (now - t0) / (n - n0) if n > n0 else math.nan
                    if moved:
                        live = auto_policy.pace_on_new_link(current, live, self.estimates, link)
                    window[0], judged_rtt[0] = (n, now), link.rtt_s
                    pace = slo if slo is None else auto_policy.remaining_pace(
                        slo, now - req.first_token_at, n - 1, req.max_tokens - n)
                    v = auto_policy.recheck(current, other, live, self.estimates, link, pace,
                                            cfg.hysteresis)
                    if isinstance(v, Switch):
                        verdict.append(v)
                        return True
                    return False

                req.switcher = due
                try:
                    if current.mode == "cloud-only":
                        try:
                            handover = await cloud_only.stretch(req, segment_tag(start),
                                                                handover)
                        finally:
                            forwards += len(req.tokens) - start
                    else:
                        run = spec_run(req, check_policy(current.policy, req.sampling),
                                       d.modes["spec"].edge, segment_tag(start), handover,
                                       drafter)
                        drafter = None   # the stretch owns it now (and closes it, or hands it on)
                        try:
                            await run.run()
                        finally:
                            await run.close()
                            forwards += run.forwards
                            # this stretch's own figures (req.stats holds the last stretch's)
                            segment.update({k: req.stats.get(k) for k in SPEC_FIGURES})
                        handover, drafter = run.handover, run.drafter_handover
                finally:
                    req.switcher = None
                    segment["tokens"] = len(req.tokens) - start
                    segment["seconds"] = round(time.monotonic() - began, 6)
                if handover is None or req.done or not verdict:
                    return
                if verdict[0].reason == auto_policy.SWITCH_DRAFTER_READY:
                    drafter, prefill = prefill.result(), None
                metrics.AUTO_SWITCHES.labels(d.name, current.mode, verdict[0].to.mode,
                                             verdict[0].reason).inc()
                current, other, why = verdict[0].to, current, verdict[0].reason
        finally:
            if req.tokens:
                req.stats["cloud_forwards_per_token"] = forwards / len(req.tokens)
            if prefill is not None:   # the request ended before its drafter was needed
                prefill.cancel()
                d.spawn(d.close_remote(d.drafter, drafter_sid(req)))
            if drafter is not None:   # kept open for a speculative stretch that never came
                d.spawn(d.close_remote(d.drafter, drafter[0]))
            if handover is not None:   # left open for a stretch that never came
                d.spawn(d.close_remote(*handover))

    def observe(self, d, stats: dict) -> None:
        """A request that finished normally (any mode, chosen or named): each of its stretches
        feeds the estimates (auto_policy.stretches says which teach what)."""
        e, link = self.estimates, self.link(d)
        for st in auto_policy.stretches(stats):
            c = st.candidate
            if c.mode == "cloud-only":
                e.observe_cloud(st.tpt_s)
            else:
                policy = POLICIES.get(c.policy)
                e.observe_spec(c.policy, link, acceptance=st.acceptance, draft_len=st.draft_len,
                               forwards_per_token=st.forwards_per_token,
                               decode_s_per_token=st.tpt_s,
                               proactive=bool(policy and policy.proactive))
        n = stats.get("generated_tokens") or 0
        if stats["mode"] == "split" and stats.get("cut") and n >= 2:
            e.observe_split(stats["cut"], stats.get("edge_forward_s", 0.0) / n,
                            stats.get("cloud_forward_s", 0.0) / n)


def drafter_sid(req) -> str:
    """The drafter session a cloud-first request opens while its first tokens come from the
    cloud (its speculative stretch takes it over)."""
    return f"{req.sid}~d"


async def open_drafter(req, policy: str, q_width: int) -> tuple | None:
    """Open the request's drafter session on the committed tokens: (sid, tokens it holds,
    seq of its open) once the drafter has the prompt in its cache, as a speculative stretch
    takes a drafter session over; None when the drafter is down or refuses."""
    d = req.d
    if not d.drafter.up:
        return None
    committed = list(req.prompt_ids) + list(req.tokens)
    ch = d.drafter.channel()
    try:
        await ch.send(protocol.DraftOpen(
            sid=drafter_sid(req), seq=OPEN_SEQ, token_ids=committed, sampling=req.sampling,
            top_k=q_width, max_tokens=req.max_tokens, tree_nodes=0,
            features=POLICIES[policy].trigger == "pipesd-learned", **req.constraint_fields()))
        msg, _ = await ch.recv(req.remaining())
    except (PeerError, ProtocolError, TimeoutError):
        return None
    finally:
        ch.close()
    return (drafter_sid(req), len(committed), OPEN_SEQ) if isinstance(msg, protocol.Ack) else None


def switchable(policy: str) -> bool:
    """A policy whose sessions may start mid-stream: chains (a tree round's state, or the
    oracle's reference of the whole output, is not)."""
    p = POLICIES.get(policy)
    return p is not None and not p.tree and p.name != "oracle-trigger"


def segment_tag(start: int) -> str:
    """The session id suffix of a stretch starting after `start` tokens ("" for the first)."""
    return f"~a{start}" if start else ""


def declare_metrics(service: str, policies: list[str]) -> None:
    """The choice and switch counters this dispatcher can move, at 0."""
    for mode, label in [("cloud-only", "cloud-only"), ("split", "split"),
                        *[("spec", p) for p in policies]]:
        for reason in auto_policy.REASONS[:5]:
            metrics.AUTO_CHOICES.labels(service, mode, label, reason)
    for a, b in (("spec", "cloud-only"), ("cloud-only", "spec")):
        for reason in auto_policy.REASONS[5:]:
            metrics.AUTO_SWITCHES.labels(service, a, b, reason)
