"""What the speculative sessions of one dispatcher share (`Edge`), and the metrics a session's
round machine reports through its hooks (`MetricHooks`)."""

from __future__ import annotations

import logging
import threading

from common import metrics
from services.dispatcher.spec.bo_tuner import BOConfig, BOTuner
from services.dispatcher.spec.dp_batching import BatchPlanner
from services.dispatcher.spec.learned_trigger import AcceptanceModel
from services.dispatcher.spec.link_model import DraftSpeed, DraftSpeedConfig, LinkModel, LinkModelConfig
from services.dispatcher.spec.nav_trigger import DraftWindow
from services.dispatcher.spec.session import Hooks
from services.dispatcher.spec.tree_policy import TreePolicy, TreePolicyConfig

log = logging.getLogger("tandem.dispatcher.spec")
SERVICE = "dispatcher"


class Edge:
    """What every speculative session of this dispatcher shares: one link and one drafter
    (α, β, γ), and per policy the scheduling window N̂ and the BO tuner."""

    def __init__(self, cfg):
        self.link = LinkModel(LinkModelConfig(alpha_seed=cfg.spec.alpha_s, beta_seed=cfg.spec.beta_s))
        self.speed = DraftSpeed(DraftSpeedConfig(gamma_seed=cfg.spec.gamma_s))
        self.windows: dict[str, DraftWindow] = {}
        self.tuners: dict[str, BOTuner] = {}
        self.trees: dict[str, TreePolicy] = {}
        self.models: dict[str, AcceptanceModel] = {}
        self.tuner_lock = threading.Lock()   # record() runs on a worker thread (GP fits)
        self.cfg = cfg

    def window(self, policy: str) -> DraftWindow:
        return self.windows.setdefault(policy, DraftWindow())

    def tree(self, policy: str) -> TreePolicy:
        """The tree policy's measurements (acceptance per depth and rank, verify-cost and
        drafter-cost curves, TPT), shared by its sessions."""
        if policy not in self.trees:
            c = self.cfg.spec
            self.trees[policy] = TreePolicy(TreePolicyConfig(
                max_nodes=c.tree_nodes, max_depth=c.tree_depth, max_width=c.tree_width,
                cost_scale=c.tree_cost_scale, node_cost_seed_s=c.tree_node_cost_s))
        return self.trees[policy]

    def acceptance_model(self, policy: str) -> AcceptanceModel:
        """pipesd-learned's online acceptance model, shared by the policy's sessions."""
        if policy not in self.models:
            self.models[policy] = AcceptanceModel()
        return self.models[policy]

    def tuner(self, policy: str) -> BOTuner:
        if policy not in self.tuners:
            self.tuners[policy] = BOTuner(BOConfig(default_r1=self.cfg.spec.r1,
                                                   default_r2=self.cfg.spec.r2,
                                                   min_tokens=self.cfg.spec.bo_window_tokens))
        return self.tuners[policy]


class MetricHooks(Hooks):
    def __init__(self, policy: str, e: Edge):
        self.policy = policy
        self.edge = e

    def nav(self, reason: str) -> None:
        metrics.NAV_TRIGGERS.labels(SERVICE, self.policy, reason).inc()

    def batch(self, size: int) -> None:
        metrics.SPEC_BATCH_SIZE.labels(SERVICE, self.policy).observe(size)

    def replan(self, planner: BatchPlanner) -> None:
        metrics.DP_REPLANS.labels(SERVICE, planner.reason).inc()
        for name, value in (("window", planner.window), ("alpha", planner.alpha),
                            ("beta", planner.beta), ("gamma", planner.gamma)):
            metrics.POLICY_PARAM.labels(SERVICE, self.policy, name).set(value)
        log.debug("DP plan (%s): %s", self.policy, planner.describe())

    def round(self, draft_tokens: int, accepted: int, early: bool,
              nodes_per_depth: list[int] | None = None) -> None:
        metrics.SPEC_DRAFTS.labels(SERVICE, self.policy).inc()
        metrics.SPEC_DRAFT_TOKENS.labels(SERVICE, self.policy).inc(draft_tokens)
        metrics.SPEC_ACCEPTED.labels(SERVICE, self.policy).inc(accepted)
        metrics.SPEC_DRAFT_LEN.labels(SERVICE, self.policy).observe(draft_tokens)
        for i in range(min(accepted, 16)):
            metrics.SPEC_ACCEPTED_POS.labels(SERVICE, self.policy, str(i) if i < 15 else "15+").inc()
        if accepted > 16:
            metrics.SPEC_ACCEPTED_POS.labels(SERVICE, self.policy, "15+").inc(accepted - 16)
        metrics.observe_round(SERVICE, self.policy, accepted,
                              nodes_per_depth or [1] * draft_tokens)   # None: a chain

    def proactive(self, outcome: str, tokens: int) -> None:
        metrics.PROACTIVE.labels(SERVICE, outcome).inc(tokens)
