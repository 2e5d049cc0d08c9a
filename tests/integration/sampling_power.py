"""How often test_sampling_e2e's chi-square rejects a wrong distribution (its power), by
simulation: draws from transformers' own distribution at the test's position 0, perturbed by a
total variation of 0.05 in four ways (5 % of the mass moved from the most likely token to the 2nd,
or to the 10th; 5 % of uniform mass over the top 20 mixed in; the temperature moved until the
distribution is 0.05 away), tested against the right one as the test does, RUNS runs per cell.
`.venv/bin/python tests/integration/sampling_power.py` prints the rejection rates at p < P_MIN
for 1000, 2000 and 3000 draws, and the rate for the right distribution (false alarms)."""

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2])]
import test_sampling_e2e as t  # noqa: E402
from common import models  # noqa: E402

RUNS = 200
TV = 0.05


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = str(models.prepare_all().target)
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    ids = tok.encode(t.FLAT_PROMPT)

    def tv(a, b):
        return 0.5 * np.abs(a - b).sum()

    for name, kw in t.CONFIGS.items():
        p = t.transformers_probs(m, ids, **kw)
        order = np.argsort(-p)

        def moved(dst, p=p, order=order):
            q = p.copy()
            q[order[0]] -= TV
            q[dst] += TV
            return q
        lo, hi = t.TEMPERATURE, 2 * t.TEMPERATURE   # the temperature TV away, by bisection
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tv(t.transformers_probs(m, ids, temperature=mid, **kw), p) < TV \
                else (lo, mid)
        drawn_from = {"right": p, "top -> 2nd": moved(order[1]), "top -> 10th": moved(order[9]),
                      "+ uniform top 20": (1 - TV) * p + TV * np.isin(np.arange(len(p)), order[:20]) / 20,
                      f"T = {hi:.3f}": t.transformers_probs(m, ids, temperature=hi, **kw)}
        for n in (1000, 2000, 3000):
            cells = []
            for what, q in drawn_from.items():
                q = np.clip(q, 0, None) / np.clip(q, 0, None).sum()
                rejected = sum(t.chi_square(Counter(rng.choice(len(q), size=n, p=q).tolist()), p)[0]
                               < t.P_MIN for _ in range(RUNS))
                cells.append(f"{what} {rejected / RUNS:.2f} (TV {tv(q, p):.3f})")
            print(f"{name}, {n} draws: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
