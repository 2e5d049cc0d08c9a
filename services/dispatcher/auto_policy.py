"""Choosing the mode of a `mode="auto"` request (DESIGN.md §10), as pure decisions: no I/O, no
clock. services/dispatcher/auto_mode.py feeds the figures of finished requests in (`Estimates`)
and asks `choose` at admission, passing the live link figures (`Link`); every rule here is
unit-tested without processes (tests/unit/test_auto_policy.py).

Candidates are cloud-only, speculative with a policy (pipesd by default), and split at an
allowed cut. For each, `predict` gives T (seconds per token of the decode, the first token's
prefill left out) and W (cloud compute seconds per token):

* cloud-only   T = t_dec, the verifier's decode step as measured on cloud-only requests;
               W = t_dec (one target forward per token).
* speculative  with acceptance a per draft token and k draft tokens per round (both measured on
               this policy's requests, kept across sessions), a round commits
               E = (1 − a^(k+1)) / (1 − a) tokens. Its time is the DP's pipeline time for k
               tokens (services/dispatcher/spec/dp_batching.py: drafting at γ, batches at α + β·s),
               plus the round trip and one verify forward t_ver ≈ t_dec (a forward over k + 1
               positions of a model this small costs about one decode step: it reads the same
               weights); with proactive drafting (pipesd) the next round's drafting overlaps
               the verification: round = max(k·γ, tail + RTT + t_ver), tail = pipeline − k·γ.
               T = round / E, times the policy's calibration: the EWMA of measured T over the
               model's T on the same figures, which absorbs what the model leaves out (here:
               the drafter and the verifier share the machine's cores). W = t_dec · measured
               forwards per token (1 / E before that figure exists).
* split at c   T = edge forward + RTT + cloud forward per token, both measured on split requests
               at that cut; W = the cloud forward per token. Chosen at the start only.

Objective. No target: the least T. A target `slo_s` (tpt_slo_ms per request, or the dispatcher's
auto_tpt_slo_ms): the least W among candidates that meet it, else the least T. A target is met
per request, not on average, so a candidate meets it when its predicted 95th percentile of a
request's T does (`Prediction.tpt_hi_s`): T times exp(1.645 σ), σ² the EWMA of the squared log
ratio of each request's measured T to what was predicted for it. A speculative policy's T varies
from prompt to prompt with its acceptance; a mode whose mean meets the target may still miss it
on a third of the requests.

Switching. A request served speculatively or cloud-only may switch between the two while it
runs (services/dispatcher/auto_mode.py does it without a new prefill). Every N tokens `recheck`
compares the stretch's own measured T (live: this prompt, this load) with the other mode's
prediction, and switches only for a clear gain: the other must be faster by the `hysteresis`
fraction (no target), or meet the target the current stretch misses, or, both meeting it, cost
that fraction less cloud work. Under a target, "meet" is judged on what is left of the request's
budget (`remaining_pace`): a stretch that fell behind must be made up by the rest; a lead is
kept (the target is never loosened mid-request). A stretch lasts N tokens at least, so the
figures it is judged by are its own and no request flaps faster than every N tokens. A link that
moves under a running request (its heartbeat round trip past `link_move` of the one the stretch
was last judged on, `link_moved`) is rechecked at once, a stretch of MIN_STRETCH_TOKENS tokens
or more: a speculative stretch is then judged by its prediction on the new link, not by the
pace it kept on the old one (`pace_on_new_link`). Each move is judged once, so switches stay
as rare as the link's moves, which heartbeats see at most every few seconds.

Cold start. Before cloud-only has a measured t_dec, there is nothing to compare with: cloud-only
is chosen (on this machine it has the earliest first token and is never slower per token). A
speculative policy that was never measured cannot be predicted, so it is tried: every
`explore_every`-th auto request goes to an unmeasured candidate (reason "explore"), and from its
figures on it is predicted like the rest. Once all are measured, that request goes to the
candidate measured longest ago, so a mode that stopped being chosen is measured again (its
figures would otherwise stay those of another load) — under a target, only among candidates
predicted to meet it: a request with a target is not spent on a mode predicted to miss it (such
a mode's prediction still follows the live link, the drafter's speed and the cloud's decode
step; what it leaves stale is its acceptance and calibration). Split is never explored (chosen at the
start only, and it pays a round trip per token): it is a candidate once split requests at that
cut measured it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.dispatcher.spec.dp_batching import plan_batches_with_time

# why a candidate was chosen: the values of the `reason` metrics label
COLD_START = "cold-start"          # nothing measured yet: cloud-only
EXPLORE = "explore"                # an unmeasured candidate tried, so it gets estimated
FASTEST = "fastest"                # no target: the least predicted T
LEAST_CLOUD = "slo-least-cloud"    # the least cloud work among candidates meeting the target
SLO_UNMET = "slo-unmet-fastest"    # no candidate meets the target: the least predicted T
SWITCH_FASTER = "switch-faster"          # live: the other mode is predicted faster
SWITCH_LESS_CLOUD = "switch-less-cloud"  # live: both meet the target, the other with less work
SWITCH_MEET_SLO = "switch-meet-slo"      # live: this mode misses the target, the other meets it
SWITCH_DRAFTER_READY = "drafter-ready"   # the first tokens came from the cloud while it prefilled
REASONS = (COLD_START, EXPLORE, FASTEST, LEAST_CLOUD, SLO_UNMET, SWITCH_FASTER,
           SWITCH_LESS_CLOUD, SWITCH_MEET_SLO, SWITCH_DRAFTER_READY)
CLOUD_FIRST = "cloud-first"   # why a speculative request's first stretch is cloud-only
# one-sided 95 %: under a target a candidate meets it when its predicted 95th percentile of a
# request's T does (the target is met per request)
SLO_QUANTILE_Z = 1.645
# a spread needs more requests than a mean: its EWMA weighs each request this much
SPREAD_EWMA = 0.1


@dataclass(frozen=True)
class Candidate:
    mode: str               # "cloud-only" | "spec" | "split"
    policy: str = ""        # spec: the policy
    cut: int = 0            # split: the cut layer

    @property
    def label(self) -> str:
        """The metrics' policy label: the spec policy, else the mode's name."""
        return self.policy if self.mode == "spec" else self.mode

    def __str__(self) -> str:
        return {"spec": f"spec/{self.policy}", "split": f"split@{self.cut}"}.get(self.mode, self.mode)


CLOUD_ONLY = Candidate("cloud-only")


@dataclass(frozen=True)
class Link:
    """The live figures of the edge-cloud link and the drafter, when a choice is made."""
    rtt_s: float = 0.0      # heartbeat round trip to the verifier
    alpha_s: float = 0.0    # per-batch transmission cost (link_model.LinkModel)
    beta_s: float = 0.0     # per-token transmission cost
    gamma_s: float = 0.0    # drafter seconds per token (link_model.DraftSpeed)


@dataclass
class SpecFigures:
    """One speculative policy's measurements, EWMAs over its finished requests."""
    acceptance: float           # accepted / drafted tokens
    draft_len: float            # draft tokens per round
    forwards_per_token: float   # verifier forwards per emitted token
    calibration: float | None = None   # measured T / the model's T; None: not measured yet
    proactive: bool = True


@dataclass
class SplitFigures:
    edge_s: float    # edge (prefix) forward per token
    cloud_s: float   # cloud (suffix) forward per token


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    tpt_s: float          # T: seconds per token
    cloud_s: float        # W: cloud compute seconds per token
    tpt_hi_s: float       # T's predicted 95th percentile over requests (>= tpt_s)

    def meets(self, slo_s: float) -> bool:
        return self.tpt_hi_s <= slo_s


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    reason: str                                  # one of REASONS
    predictions: tuple[Prediction, ...] = ()     # what was compared (empty on a cold start)

    def describe(self) -> dict:
        """For Done.stats: what was chosen, why, and the predictions compared."""
        return {"chosen": str(self.candidate), "reason": self.reason,
                "predictions": [{"candidate": str(p.candidate), "tpt_s": p.tpt_s,
                                 "tpt_p95_s": p.tpt_hi_s, "cloud_s_per_token": p.cloud_s}
                                for p in self.predictions]}


def _ewma(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


def tokens_per_round(acceptance: float, k: float) -> float:
    """E = (1 − a^(k+1)) / (1 − a): expected tokens a round of k drafts commits (Leviathan et
    al.; at most k + 1)."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1.0)) / (1.0 - a)


def spec_round_s(k: float, link: Link, verify_s: float, proactive: bool) -> float:
    """One round of k draft tokens: the DP's pipeline time (drafting and batches delivered),
    the round trip and the verify forward; with proactive drafting, drafting overlaps the rest."""
    n = max(1, round(k))
    pipeline = plan_batches_with_time(n, link.gamma_s, link.alpha_s, link.beta_s)[1]
    drafting = n * link.gamma_s
    if proactive:
        return max(drafting, pipeline - drafting + link.rtt_s + verify_s)
    return pipeline + link.rtt_s + verify_s


def spec_model_tpt(f: SpecFigures, link: Link, t_dec: float) -> float:
    """The uncalibrated model's T of a speculative policy."""
    return spec_round_s(f.draft_len, link, t_dec, f.proactive) / tokens_per_round(
        f.acceptance, f.draft_len)


MIN_STRETCH_TOKENS = 4   # a stretch shorter than this is too short to time: it teaches nothing


@dataclass(frozen=True)
class Stretch:
    """What one stretch of a finished request teaches: its candidate, its seconds per token, and
    for a speculative stretch its acceptance, draft length and verifier forwards per token."""
    candidate: Candidate
    tpt_s: float
    acceptance: float | None = None
    draft_len: float | None = None
    forwards_per_token: float | None = None


def stretches(stats: dict) -> list[Stretch]:
    """The stretches a finished request's stats (Done.stats) teach from, each timed on its own:
    a request that switched teaches each mode it ran, so a request that tried a mode and left it
    still measures it. The first stretch's first token (the prefill) is not its pace, and is left
    out. Speculative stretches of a request that lost its drafter or ran degraded, and stretches
    under MIN_STRETCH_TOKENS, teach nothing; a split stretch's figures are its forwards."""
    segments = stats.get("segments") or ()
    ttft = stats.get("ttft_s")
    spoiled = bool(stats.get("drafter_lost") or stats.get("degraded"))
    out = []
    for i, seg in enumerate(segments):
        n, seconds = seg.get("tokens") or 0, seg.get("seconds")
        if n < MIN_STRETCH_TOKENS or seconds is None or (i == 0 and ttft is None):
            continue
        if i == 0:
            n, seconds = n - 1, max(0.0, seconds - ttft)
        if seg["mode"] == "cloud-only":
            out.append(Stretch(CLOUD_ONLY, seconds / n))
        elif seg["mode"] == "spec":
            # a stretch of auto's carries its own figures; a request run as spec, the request's
            fig = seg if "acceptance_rate" in seg else stats
            if spoiled or not fig.get("rounds") or fig.get("acceptance_rate") is None:
                continue
            out.append(Stretch(Candidate("spec", policy=seg["policy"]), seconds / n,
                               fig["acceptance_rate"], fig["mean_draft_length"],
                               fig.get("cloud_forwards_per_token") or 1.0))
    return out


@dataclass
class Estimates:
    """What this dispatcher measured, kept across sessions; fed by finished requests."""
    ewma: float = 0.3
    t_dec: float | None = None                           # cloud-only decode step, seconds
    spec: dict[str, SpecFigures] = field(default_factory=dict)
    split: dict[int, SplitFigures] = field(default_factory=dict)
    observed: int = 0                                    # observations so far, of any candidate
    last: dict[Candidate, int] = field(default_factory=dict)   # `observed` at its last one
    # σ²: EWMA of (log measured T / T predicted for it)², per candidate; none before its
    # second request (split's T is not a request's own pace: it has none)
    spread: dict[Candidate, float] = field(default_factory=dict)

    def _seen(self, c: Candidate) -> None:
        self.observed += 1
        self.last[c] = self.observed

    def _residual(self, c: Candidate, measured: float, predicted: float) -> None:
        if measured > 0 and predicted > 0:
            r2 = math.log(measured / predicted) ** 2
            self.spread[c] = _ewma(self.spread.get(c), r2, SPREAD_EWMA)

    def observe_cloud(self, decode_s_per_token: float) -> None:
        if self.t_dec is not None:
            self._residual(CLOUD_ONLY, decode_s_per_token, self.t_dec)
        self.t_dec = _ewma(self.t_dec, decode_s_per_token, self.ewma)
        self._seen(CLOUD_ONLY)

    def observe_spec(self, policy: str, link: Link, *, acceptance: float, draft_len: float,
                     forwards_per_token: float, decode_s_per_token: float,
                     proactive: bool) -> None:
        """A finished speculative request. Its calibration needs t_dec (before that, the
        model's figures are kept and the calibration starts with the first request after)."""
        w = self.ewma
        c = Candidate("spec", policy=policy)
        self._seen(c)
        f = self.spec.get(policy)
        if f is not None and f.calibration is not None and self.t_dec is not None:
            # what was predicted for this request: its figures before it
            self._residual(c, decode_s_per_token, f.calibration * spec_model_tpt(f, link, self.t_dec))
        if f is None:
            f = self.spec[policy] = SpecFigures(acceptance, draft_len, forwards_per_token,
                                                proactive=proactive)
        else:
            f.acceptance = _ewma(f.acceptance, acceptance, w)
            f.draft_len = _ewma(f.draft_len, draft_len, w)
            f.forwards_per_token = _ewma(f.forwards_per_token, forwards_per_token, w)
        if self.t_dec is not None and decode_s_per_token > 0:
            model = spec_model_tpt(f, link, self.t_dec)
            if model > 0:
                f.calibration = _ewma(f.calibration, decode_s_per_token / model, w)

    def observe_split(self, cut: int, edge_s: float, cloud_s: float) -> None:
        self._seen(Candidate("split", cut=cut))
        f = self.split.get(cut)
        if f is None:
            self.split[cut] = SplitFigures(edge_s, cloud_s)
        else:
            f.edge_s = _ewma(f.edge_s, edge_s, self.ewma)
            f.cloud_s = _ewma(f.cloud_s, cloud_s, self.ewma)

    def measured(self, c: Candidate) -> bool:
        if c.mode == "spec":
            return c.policy in self.spec
        if c.mode == "split":
            return c.cut in self.split
        return self.t_dec is not None


def predict(c: Candidate, e: Estimates, link: Link) -> Prediction | None:
    """T and W of a candidate from the estimates; None when it cannot be predicted yet."""
    if e.t_dec is None:
        return None
    hi = math.exp(SLO_QUANTILE_Z * math.sqrt(e.spread.get(c, 0.0)))
    if c.mode == "cloud-only":
        return Prediction(c, e.t_dec, e.t_dec, e.t_dec * hi)
    if c.mode == "spec":
        f = e.spec.get(c.policy)
        if f is None:
            return None
        calibration = 1.0 if f.calibration is None else f.calibration
        t = calibration * spec_model_tpt(f, link, e.t_dec)
        return Prediction(c, t, e.t_dec * f.forwards_per_token, t * hi)
    f = e.split.get(c.cut)
    if f is None:
        return None
    t = f.edge_s + link.rtt_s + f.cloud_s
    return Prediction(c, t, f.cloud_s, t)


def choose(candidates: list[Candidate], e: Estimates, link: Link, slo_s: float | None = None,
           explore: bool = False) -> Choice:
    """The candidate to serve a request with. `candidates` are those available now (cloud-only
    always among them); `explore` says this request may try an unmeasured speculative one, or
    else the cloud-only or speculative candidate measured longest ago."""
    if CLOUD_ONLY not in candidates:
        raise ValueError("cloud-only must be a candidate: it is the fallback of every rule")
    if explore:
        for c in candidates:
            if c.mode == "spec" and not e.measured(c):
                return Choice(c, EXPLORE)
        if e.t_dec is not None:
            preds = {p.candidate: p for p in (predict(c, e, link) for c in candidates)
                     if p is not None}
            # a request with a target is not spent on re-measuring a candidate predicted to
            # miss it: its target outranks the freshness of the estimates
            pool = [c for c in candidates if c.mode != "split"
                    and (slo_s is None or c not in preds or preds[c].meets(slo_s))]
            if pool:
                stalest = min(pool, key=lambda c: e.last.get(c, 0))
                return Choice(stalest, EXPLORE, tuple(preds.values()))
    if e.t_dec is None:
        return Choice(CLOUD_ONLY, COLD_START)
    preds = tuple(p for p in (predict(c, e, link) for c in candidates) if p is not None)
    fastest = min(preds, key=lambda p: p.tpt_s)
    if slo_s is None:
        return Choice(fastest.candidate, FASTEST, preds)
    meeting = [p for p in preds if p.meets(slo_s)]
    if not meeting:
        return Choice(fastest.candidate, SLO_UNMET, preds)
    best = min(meeting, key=lambda p: (p.cloud_s, p.tpt_s))
    return Choice(best.candidate, LEAST_CLOUD, preds)


@dataclass(frozen=True)
class Stay:
    pass


@dataclass(frozen=True)
class Switch:
    to: Candidate
    reason: str     # SWITCH_FASTER | SWITCH_LESS_CLOUD | SWITCH_MEET_SLO


STAY = Stay()


def remaining_pace(slo_s: float, spent_s: float, tokens: int, left: int) -> float:
    """The seconds per token the rest of a request may take for its whole decode to keep
    `slo_s` per token: `tokens` decoded in `spent_s` (its first token left out, as in T), at
    most `left` still to come. 0 when the budget is already spent. Never more than `slo_s`: a
    request that fell behind must make it up, but a lead is kept, not spent on a cheaper mode,
    whose next stretch scatters further around its prediction than a whole request does."""
    if left <= 0:
        return slo_s
    return min(slo_s, max(0.0, (slo_s * (tokens + left) - spent_s) / left))


# round-trip moves under this are jitter, not a new link (a LAN's round trip is under 1 ms)
LINK_MOVE_FLOOR_S = 0.005


def link_moved(judged_rtt_s: float, rtt_s: float, threshold: float) -> bool:
    """The round trip moved past `threshold` (a fraction of `judged_rtt_s`, the one the running
    stretch was last judged on) and past LINK_MOVE_FLOOR_S: the link changed under the request."""
    if not (threshold > 0 and math.isfinite(judged_rtt_s) and math.isfinite(rtt_s)):
        return False
    return abs(rtt_s - judged_rtt_s) > max(LINK_MOVE_FLOOR_S, threshold * judged_rtt_s)


def pace_on_new_link(current: Candidate, live_tpt_s: float, e: Estimates, link: Link) -> float:
    """What the running stretch is judged by once the link moved. Speculation's measured pace
    belongs to the link that is gone (it pays a round trip per round): its prediction on the new
    link. Cloud-only's does not depend on the link (tokens stream): its own measured pace, or
    its prediction if it has none yet."""
    if current.mode == "spec" or not live_tpt_s > 0:
        p = predict(current, e, link)
        if p is not None:
            return p.tpt_s
    return live_tpt_s


def recheck(current: Candidate, other: Candidate, live_tpt_s: float, e: Estimates, link: Link,
            slo_s: float | None = None, hysteresis: float = 0.2) -> Stay | Switch:
    """Mid-request: keep serving as `current` (measured at `live_tpt_s` per token over this
    stretch) or switch to `other` (predicted from the estimates). Under a target, `slo_s` is the
    pace the rest of the request must keep (`remaining_pace`)."""
    p = predict(other, e, link)
    if p is None or not live_tpt_s > 0:
        return STAY
    margin = 1.0 - hysteresis
    if slo_s is None:
        return Switch(other, SWITCH_FASTER) if p.tpt_s < live_tpt_s * margin else STAY
    meets, other_meets = live_tpt_s <= slo_s, p.meets(slo_s)
    if not meets and other_meets:
        return Switch(other, SWITCH_MEET_SLO)
    if not meets:
        return Switch(other, SWITCH_FASTER) if p.tpt_s < live_tpt_s * margin else STAY
    cur = predict(current, e, link)
    if other_meets and cur is not None and p.cloud_s < cur.cloud_s * margin:
        return Switch(other, SWITCH_LESS_CLOUD)
    return STAY
