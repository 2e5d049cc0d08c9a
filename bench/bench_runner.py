"""LayerRangeRunner against transformers on the same threads, ragged batching, k-token verify.

    python -m bench.bench_runner [--reps N] [--steps N] [--context N] [--threads N] [--gemm]
                                 [--target DIR|GGUF|NAME] [--quick] [--no-limits] [--json PATH]
                                 [--products auto|panel|onednn|torch]

On cores shared with other busy processes, OpenMP's default spin-waiting makes every parallel
region wait on descheduled threads (5-10x slower steps measured at load 7 on 2 cores); set
OMP_WAIT_POLICY=PASSIVE there. The line above the table shows the load average and the policy.

Each rep runs every case once, interleaved, so drift in machine load hits all cases alike;
the table gives the median over reps with the spread (min-max), and ratios are taken per rep
(paired) before the median.

  decode        ms per token, one session decoding `steps` tokens after a `context`-token
                prompt: transformers' own forward with DynamicCache vs the runner (goal <= 1.05x)
  batch x8      one ragged step of 8 sessions (contexts context .. context+21), one new token
                each, vs the runner's 1-session decode: tokens/s ratio (goal >= 6x)
  verify k=8    one forward of the last committed token and 8 draft tokens, logits for all 9
                (what the verifier feeds a round of 8 drafts: services/verifier/spec.py), then
                rollback, vs decoding 1 token: time ratio (goal <= 1.2x)
  decode oneDNN the same decode with oneDNN's prepacked products (gemm="onednn", the runner's
                products before the panel kernel), when the runner runs the panel kernel
  prefill 512   one 512-token prompt into an empty cache (logits for the last token)
  --gemm        every product of a decode step, and the LM-head product (49152x576) alone, by
                method and row count: why the runner has its own kernel (common/runner.py)

The limits, measured in the same interleaved reps (bench/runner_limits.py):
  read          the machine's read bandwidth (the fastest of torch.mv, a sum and the panel
                kernel over an fp32 buffer the size of the model's weights); floor = the bytes
                a decode step streams / that bandwidth
  FMA peak      the machine's fp32 FMA throughput (register-only FMA chains on every thread);
                the 8-row (batch x8) and 9-row (verify k=8) floors and the tree and chain floors are the
                larger of bandwidth floor and products' FLOP / peak: nothing is faster here
  llama.cpp     the same weights as an ALL_F32 GGUF (llama.cpp's quantize of the source GGUF,
                made once next to the target), `steps` tokens after a `context`-token prompt,
                and a 512-token prompt evaluation, on the same threads
Ratios (per rep, then the median): runner/floor, runner/llama.cpp decode (goals <= 1.2, <= 1.1),
prefill runner/llama.cpp (goal <= 1.2), batch x8 tokens/s vs x1 (>= 6), verify k=8 vs decode
(<= 1.2). `--no-limits` leaves the limits out (a target with no source GGUF has no anchor).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import runner_limits
from bench.report import summary, table, write_json
from common.models import models_dir, resolve_target
from common import cpu_kernels as kernels
from common.runner import PACK_ROWS, LayerRangeRunner, Segment


def _ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def decode_cases(runner, hf, ctx: int, steps: int):
    """Closures, each returning one measurement in ms (state is rebuilt inside, untimed)."""
    from transformers import DynamicCache

    L = runner.num_layers
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, runner.vocab_size, (ctx + 32,), generator=gen)
    toks = prompt[ctx:]

    def hf_decode() -> float:
        cache = DynamicCache(config=hf.config)
        with torch.inference_mode():
            hf(prompt[None, :ctx], cache=cache, use_cache=True)
            return _ms(lambda: [hf(toks[None, i: i + 1], cache=cache, use_cache=True)
                                for i in range(steps)]) / steps

    kv1 = runner.new_kv()
    runner.forward([Segment(kv1, prompt[:ctx])], 0, L)

    def runner_decode() -> float:
        kv1.truncate(ctx)
        return _ms(lambda: [runner.forward([Segment(kv1, toks[i: i + 1])], 0, L)
                            for i in range(steps)]) / steps

    kv8 = [runner.new_kv() for _ in range(8)]
    for j, kv in enumerate(kv8):
        runner.forward([Segment(kv, prompt[: ctx + 3 * j])], 0, L)

    def batch8() -> float:
        for j, kv in enumerate(kv8):
            kv.truncate(ctx + 3 * j)
        return _ms(lambda: [runner.forward([Segment(kv, toks[i: i + 1]) for kv in kv8], 0, L)
                            for i in range(steps)]) / steps

    def verify8() -> float:
        def run():
            for i in range(steps):
                runner.forward([Segment(kv1, toks[i: i + 9], "all")], 0, L)
                kv1.truncate(ctx)
        kv1.truncate(ctx)
        return _ms(run) / steps

    prompt512 = torch.randint(100, runner.vocab_size, (PREFILL_TOKENS,), generator=gen)
    kvp = runner.new_kv()

    def prefill() -> float:
        kvp.truncate(0)
        return _ms(lambda: runner.forward([Segment(kvp, prompt512)], 0, L))

    return {"hf_decode": hf_decode, "runner_decode": runner_decode, "batch8": batch8,
            "verify8": verify8, "runner_prefill": prefill}


PREFILL_TOKENS = 512


def source_gguf(target: Path) -> str | None:
    """The GGUF a prepared target was dequantised from (its tandem.json), else None."""
    meta = target / "tandem.json"
    if not meta.is_file():
        return None
    src = json.loads(meta.read_text()).get("source_gguf")
    if src is None:
        return None
    if os.path.isfile(src):
        return src
    # the models directory moved since (another checkout, a mounted volume): look beside the target
    beside = target.parent / Path(src).name
    return str(beside) if beside.is_file() else None


TREE_PARENTS = [x for d in range(8) for x in [d * 4 - 4 if d else -1] * 4]   # 8 deep, 4 wide


def tree_vs_chain(runner, ctx: int, steps: int, reps: int, limits: dict | None = None,
                  step_bytes: int = 0) -> tuple[list[dict], dict]:
    """Rows and samples of "tree 32 vs chain 8" (the tree runner goal): the verifier's forward for
    a 32-node token tree (depth 8: a main path and 3 siblings at each depth; the root's token +
    32 nodes with tree attention, logits for all, then the accepted path kept by
    SessionKV.move_rows) vs for an 8-token chain (the root's token + 8, then truncate), time
    ratio per rep (goal <= 1.3x). A 32-token chain (the root's token + 32) is the control: the
    same rows without the tree mask, so "tree 32 vs chain 32" is what tree attention itself
    costs and the rest is the cost of the rows. The cases alternate within each rep.

    `limits` ("read_bw", "fma_peak" closures, bench/runner_limits.py), sampled in the same reps,
    add each case's roofline floor and "tree 32 vs chain 8, at their floors": the ratio no
    implementation can beat on this machine while its chain runs at the chain's floor."""
    from common import tree

    L = runner.num_layers
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, runner.vocab_size, (ctx + 33,), generator=gen)
    kv = runner.new_kv()
    runner.forward([Segment(kv, prompt[:ctx])], 0, L)
    positions, ancestors = tree.attention(TREE_PARENTS)
    keep = [ctx + 1 + i for i in tree.main_path(TREE_PARENTS)[:4]]

    def chain(k: int):
        """Verify a chain of k drafts (k + 1 rows with the last committed token)."""
        def timed() -> float:
            def run():
                for _ in range(steps):
                    runner.forward([Segment(kv, prompt[ctx: ctx + k + 1], "all")], 0, L)
                    kv.truncate(ctx)
            return _ms(run) / steps
        return timed

    def tree32() -> float:
        def run():
            for _ in range(steps):
                runner.forward([Segment(kv, prompt[ctx: ctx + 33], "all", positions, ancestors)],
                               0, L)
                kv.move_rows(keep, ctx + 1)
                kv.truncate(ctx)
        return _ms(run) / steps

    cases = {"chain8": chain(8), "tree32": tree32, "chain32": chain(32), **(limits or {})}
    for f in cases.values():   # warm-up
        f()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for k, f in cases.items():
            samples[k].append(f())
    rows = []
    for name, key in (("runner verify chain 8", "chain8"), ("runner verify tree 32", "tree32"),
                      ("runner verify chain 32 (control)", "chain32")):
        x = summary(samples[key])
        rows.append({"case": name, "median": x["median"], "min": x["min"], "max": x["max"],
                     "unit": "ms/call", "goal": ""})
    x = summary([t / c for c, t in zip(samples["chain8"], samples["tree32"])])
    rows.append({"case": "verify tree 32 vs chain 8", "median": x["median"], "min": x["min"],
                 "max": x["max"], "unit": "ratio", "goal": "<= 1.3"})
    x = summary([t / c for c, t in zip(samples["chain32"], samples["tree32"])])
    rows.append({"case": "verify tree 32 vs chain 32", "median": x["median"], "min": x["min"],
                 "max": x["max"], "unit": "ratio", "goal": ""})
    if "read_bw" in samples and "fma_peak" in samples:
        def floor(n):   # the root's token + n nodes, logits for all
            return runner_limits.roofline_ms(step_bytes,
                                             runner_limits.product_flops(runner, n + 1, n + 1),
                                             samples["read_bw"], samples["fma_peak"])
        samples["floor_chain8"], samples["floor_tree32"] = floor(8), floor(32)
        for name, xs, unit in (
                ("floor, 9 rows (chain 8)", samples["floor_chain8"], "ms/call"),
                ("floor, 33 rows (tree 32)", samples["floor_tree32"], "ms/call"),
                ("verify tree 32 / its floor",
                 [t / f for t, f in zip(samples["tree32"], samples["floor_tree32"])], "ratio"),
                ("tree 32 vs chain 8, at their floors",
                 [t / c for c, t in zip(samples["floor_chain8"], samples["floor_tree32"])],
                 "ratio")):
            x = summary(xs)
            rows.append({"case": name, "median": x["median"], "min": x["min"], "max": x["max"],
                         "unit": unit, "goal": ""})
    return rows, samples


def gemm_table(reps: int) -> list[dict]:
    """LM head x @ W.T by method; numpy (OpenBLAS) last, its spinning threads disturb OpenMP."""

    F = torch.nn.functional
    V, H = 49152, 576
    W = torch.randn(V, H)
    packed = torch.ops.mkldnn._reorder_linear_weight(W, PACK_ROWS)
    Wt = W.t().contiguous().numpy()
    panel = kernels.pack(W) if kernels.unavailable() is None else None
    methods = {
        "F.linear (MKL)": lambda x: F.linear(x, W),
        "mm(W, x.T) (MKL, swapped)": lambda x: torch.mm(W, x.t()),
        "oneDNN, plain weight": lambda x: torch.ops.mkldnn._linear_pointwise(x, W, None, "none", [], ""),
        f"oneDNN, prepacked ({PACK_ROWS} rows)":
            lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "numpy x @ W.T (OpenBLAS)": lambda x: x.numpy() @ Wt,
    }
    if panel is not None:
        methods = {"panel kernel (common/cpu_kernels.py)": lambda x: kernels.linear(x, panel), **methods}
    rows = []
    for name, f in methods.items():
        row = {"method": name}
        for m in (1, 2, 8, 64):
            x = torch.randn(m, H)
            f(x)
            row[f"{m} rows ms"] = statistics.median(_ms(lambda: f(x)) for _ in range(reps))  # noqa: B023 - called within this iteration
        rows.append(row)
    return rows


def step_products_table(runner, reps: int) -> list[dict]:
    """Every product of one decode step (each layer's q|k|v, o, gate|up, down and the LM head:
    the bytes a step streams) by method, 1, 2, 4, 6 and 8 rows (6 is the panel kernel's widest
    tile, 8 takes a second pass), interleaved rep by rep: ms and the GB/s of weights read.
    Random weights of the runner's shapes, one copy per layout."""
    F = torch.nn.functional
    H, nh, nkv, hd = runner.hidden_size, runner.n_heads, runner.kv_heads, runner.head_dim
    inter = runner.config.intermediate_size
    shapes = [((nh + 2 * nkv) * hd, H), (H, nh * hd), (2 * inter, H), (H, inter)]
    shapes = shapes * runner.num_layers + [(runner.vocab_size, H)]
    gen = torch.Generator().manual_seed(2)
    plain = [torch.randn(*s, generator=gen) for s in shapes]
    nbytes = sum(w.numel() * 4 for w in plain)
    layouts = {"MKL F.linear": (plain, F.linear)}
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in plain]
        layouts[f"oneDNN prepacked ({PACK_ROWS} rows)"] = (
            packed, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    if kernels.unavailable() is None:
        layouts["panel kernel (common/cpu_kernels.py)"] = ([kernels.pack(w) for w in plain],
                                                           kernels.linear)
    rows = []
    for m in (1, 2, 4, 6, 8):
        xs = {k: torch.randn(m, k, generator=gen) for k in {s[1] for s in shapes}}
        xin = [xs[s[1]] for s in shapes]
        cases = {name: (lambda ws=ws, f=f, xin=xin: [f(x, w) for x, w in zip(xin, ws)])
                 for name, (ws, f) in layouts.items()}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for f in cases.values():
            f()
        for _ in range(reps):
            for k, f in cases.items():
                times[k].append(_ms(f))
        for k, ts in times.items():
            med = statistics.median(ts)
            rows.append({"rows": m, "method": k, "ms": med, "GB/s": nbytes / med / 1e6,
                         "GFLOP/s": 2 * m * nbytes / 4 / med / 1e6})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_runner", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32, help="decode tokens (or verify calls) per "
                    "rep, for the runner, transformers and llama.cpp alike")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before decoding")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--target", default=None, help="HF target dir, a GGUF (dequantised once) or a "
                    "named model such as gemma3-270m (default: the bundled SmolLM2)")
    ap.add_argument("--gemm", action="store_true",
                    help="also time the products by method: a decode step's and the LM head's")
    ap.add_argument("--products", choices=("auto", "panel", "onednn", "torch"), default="auto",
                    help="the runner's matrix products (LayerRangeRunner's gemm)")
    ap.add_argument("--no-limits", action="store_true", help="leave out the GEMV bandwidth "
                    "floor and the llama.cpp F32 anchor")
    ap.add_argument("--quick", action="store_true", help="3 reps, 8 steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps = 3, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    from transformers import AutoModelForCausalLM

    path = resolve_target(args.target)
    runner = LayerRangeRunner(path, gemm=args.products)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cases = decode_cases(runner, hf, args.context, args.steps)
    if runner.gemm == "panel":   # the products it replaced, in the same reps
        onednn = LayerRangeRunner(path, gemm="onednn")
        cases["runner_decode_onednn"] = decode_cases(onednn, hf, args.context,
                                                     args.steps)["runner_decode"]
    step_bytes = runner_limits.weight_bytes(runner)
    limits = {"weight_bytes": step_bytes}
    if not args.no_limits:
        src = source_gguf(path)
        if src is None:
            print(f"no llama.cpp anchor: {path} has no source GGUF (tandem.json)")
        else:
            f32 = runner_limits.f32_gguf(Path(src), models_dir() / (Path(src).stem + ".ALL_F32.gguf"))
            limits["llama_gguf"] = str(f32)
            cases.update(runner_limits.llama_cases(f32, threads, args.context, args.steps,
                                                   PREFILL_TOKENS, runner.vocab_size))
        cases["read_bw"] = runner_limits.read_bandwidth_case(step_bytes)
        peak = runner_limits.fma_peak_case(threads)
        if peak is not None:
            cases["fma_peak"] = peak
    load0 = os.getloadavg()[0]
    for f in cases.values():  # warm-up
        f()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.reps):
        for k, f in cases.items():
            samples[k].append(f())
    load1 = os.getloadavg()[0]

    def per_rep(f, *keys):
        """f applied rep by rep to the named cases' paired samples (None if one is absent)."""
        if not all(k in samples for k in keys):
            return None
        return [f(*xs) for xs in zip(*(samples[k] for k in keys))]

    if "read_bw" in samples:
        samples["floor"] = [step_bytes / bw * 1e3 for bw in samples["read_bw"]]  # ms per token
    if "fma_peak" in samples:   # the roofline: stream the weights and do the FLOP (ms)
        def floor(rows, logit_rows):
            return runner_limits.roofline_ms(step_bytes,
                                             runner_limits.product_flops(runner, rows, logit_rows),
                                             samples["read_bw"], samples["fma_peak"])
        samples["floor1"], samples["floor8"], samples["floor9"] = \
            floor(1, 1), floor(8, 8), floor(9, 9)
    ratios = {
        "decode runner/transformers": (per_rep(lambda h, r: r / h, "hf_decode", "runner_decode"),
                                       "<= 1.05"),
        "decode panel kernel/oneDNN": (per_rep(lambda r, p: r / p, "runner_decode",
                                               "runner_decode_onednn"), ""),
        "decode runner/floor": (per_rep(lambda r, f: r / f, "runner_decode", "floor"), "<= 1.2"),
        "decode runner/llama.cpp": (per_rep(lambda r, c: r / c, "runner_decode", "llama_decode"),
                                    "<= 1.1"),
        "decode llama.cpp/floor": (per_rep(lambda c, f: c / f, "llama_decode", "floor"), ""),
        "batch x8 tokens/s vs x1": (per_rep(lambda r, b: 8 * r / b, "runner_decode", "batch8"),
                                    ">= 6"),
        "verify k=8 time vs decode 1": (per_rep(lambda r, v: v / r, "runner_decode", "verify8"),
                                        "<= 1.2"),
        "batch x8 / 8-row floor": (per_rep(lambda b, f: b / f, "batch8", "floor8"), ""),
        "verify k=8 / 9-row floor": (per_rep(lambda v, f: v / f, "verify8", "floor9"), ""),
        "verify k=8 vs decode 1, at their floors": (
            per_rep(lambda f9, f1: f9 / f1, "floor9", "floor1"), ""),
        f"prefill {PREFILL_TOKENS} runner/llama.cpp": (
            per_rep(lambda r, c: r / c, "runner_prefill", "llama_prompt"), "<= 1.2"),
    }
    rows = []
    for name, key, unit in (("transformers decode", "hf_decode", "ms/token"),
                            ("runner decode", "runner_decode", "ms/token"),
                            ("runner decode, oneDNN products", "runner_decode_onednn", "ms/token"),
                            ("llama.cpp F32 decode", "llama_decode", "ms/token"),
                            ("bandwidth floor", "floor", "ms/token"),
                            ("read bandwidth (best reader)", "read_bw", "GB/s"),
                            ("fp32 FMA peak", "fma_peak", "GFLOP/s"),
                            ("8-row floor (bandwidth or FMA)", "floor8", "ms/step (8 rows)"),
                            ("runner batch x8 decode", "batch8", "ms/step (8 tokens)"),
                            ("9-row floor (bandwidth or FMA)", "floor9", "ms/call (9 rows)"),
                            ("runner verify k=8", "verify8", "ms/call (9 rows)"),
                            (f"runner prefill {PREFILL_TOKENS}", "runner_prefill", "ms"),
                            (f"llama.cpp F32 prompt {PREFILL_TOKENS}", "llama_prompt", "ms")):
        if key not in samples:
            continue
        xs = [x / 1e9 for x in samples[key]] if key in ("read_bw", "fma_peak") else samples[key]
        s = summary(xs)
        rows.append({"case": name, "median": s["median"], "min": s["min"], "max": s["max"],
                     "unit": unit, "goal": ""})
    for name, (xs, goal) in ratios.items():
        if xs is None:
            continue
        s = summary(xs)
        rows.append({"case": name, "median": s["median"], "min": s["min"], "max": s["max"],
                     "unit": "ratio", "goal": goal})
    print(f"LayerRangeRunner vs transformers and its limits: {threads} threads, context "
          f"{args.context}, {args.steps} steps/rep, {args.reps} reps, weights "
          f"{step_bytes / 1e6:.0f} MB/step, products {runner.gemm}, "
          f"load average {load0:.1f} -> {load1:.1f}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(table(rows, [("case", "case"), ("median", "median"), ("min", "min"), ("max", "max"),
                       ("unit", "unit"), ("goal", "goal")]))
    gemm = []
    products = []
    if args.gemm:
        products = step_products_table(runner, max(args.reps, 5))
        print(f"\nall products of one decode step ({step_bytes / 1e6:.0f} MB of weights), median "
              f"over {max(args.reps, 5)} interleaved reps, {threads} threads")
        print(table(products, [(k, k) for k in products[0]]))
        gemm = gemm_table(max(args.reps, 5))
        print(f"\nLM head 49152x576, median ms over {max(args.reps, 5)} reps, {threads} threads")
        print(table(gemm, [(k, k) for k in gemm[0]]))
    tree_limits = {k: cases[k] for k in ("read_bw", "fma_peak") if k in cases}
    tree_rows, samples["tree_vs_chain"] = tree_vs_chain(runner, args.context, args.steps,
                                                        args.reps, tree_limits, step_bytes)
    print(f"\ntoken tree verify: {args.steps} calls/rep, {args.reps} reps")
    print(table(tree_rows, [("case", "case"), ("median", "median"), ("min", "min"),
                            ("max", "max"), ("unit", "unit"), ("goal", "goal")]))
    rows += tree_rows
    write_json(args.json, "runner", f"context{args.context}", rows, gemm=gemm,
               samples=samples, threads=threads, limits=limits,
               products=runner.gemm, step_products=products)
    return 0


if __name__ == "__main__":
    sys.exit(main())
