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
TOP_K, TOP_P = (t.CONFIGS["t0.8-topk20-topp0.95"][k] for k in ("top_k", "top_p"))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = str(models.prepare_all().target)
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)

    def probs(ids, temperature=t.TEMPERATURE, top_k=TOP_K, top_p=TOP_P):
        return t.transformers_probs(m, ids, top_k, top_p, temperature)

    sure = tok.encode(t.SURE_PROMPT)
    first = int(np.argmax(probs(sure)))       # the near-certain first token the test conditions on
    for name, ids in (("position 0 (flat prompt)", tok.encode(t.FLAT_PROMPT)),
                      ("position 1 (sure prompt)", sure + [first])):
        right = probs(ids)
        drawn_from = {"right": right, "T=0.9": probs(ids, temperature=0.9),
                      "T=0.7": probs(ids, temperature=0.7), "no top-p": probs(ids, top_p=1.0),
                      "top-k 10": probs(ids, top_k=10)}
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
