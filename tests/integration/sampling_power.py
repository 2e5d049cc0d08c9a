"""How often test_sampling_e2e's chi-square rejects a wrong distribution (its power), by
simulation: draws from a perturbed transformers distribution (another temperature, a warper
missing or changed), tested against the right one as the test does, 300 runs per cell.
`.venv/bin/python tests/integration/sampling_power.py`; prints the rejection rates at
p < P_MIN for 1000, 1200 and 2000 draws at the test's two positions."""

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2])]
import test_sampling_e2e as t  # noqa: E402
from common import models  # noqa: E402

RUNS = 300


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = str(models.prepare_all().target)
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)

    def probs(ids, temperature, top_k=0, top_p=1.0):
        t.TEMPERATURE, old = temperature, t.TEMPERATURE
        try:
            return t.transformers_probs(m, ids, top_k, top_p)
        finally:
            t.TEMPERATURE = old

    sure = tok.encode(t.SURE_PROMPT)
    first = int(np.argmax(probs(sure, 0.8)))
    for name, ids in (("position 0 (flat prompt)", tok.encode(t.FLAT_PROMPT)),
                      ("position 1 (sure prompt)", sure + [first])):
        right = probs(ids, 0.8, 20, 0.95)
        drawn_from = {"right": right, "T=0.9": probs(ids, 0.9, 20, 0.95),
                      "T=0.7": probs(ids, 0.7, 20, 0.95), "no top-p": probs(ids, 0.8, 20, 1.0),
                      "top-k 10": probs(ids, 0.8, 10, 0.95)}
        for n in (1000, 1200, 2000):
            cells = []
            for what, q in drawn_from.items():
                rejected = sum(
                    t.chi_square(Counter(rng.choice(len(q), size=n, p=q / q.sum()).tolist()),
                                 right)[0] < t.P_MIN for _ in range(RUNS))
                cells.append(f"{what} {rejected / RUNS:.2f}")
            print(f"{name}, {n} draws: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
