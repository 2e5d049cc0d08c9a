"""Multi-turn chat through the OpenAI-compatible gateway, with the cloud's prefix cache on and off.

    tandem bench chat [--conversations N] [--turns 2|6] [--modes cloud-only,spec,split]
                      [--answer-tokens N] [--quick] [--json PATH]

Every turn sends the whole conversation again, as OpenAI clients do. Conversations are real:
MT-Bench's two-turn questions (turn 2 carries turn 1 and its answer), or with `--turns 6` a longer
synthetic one made of three MT-Bench questions' turns in a row, for the growth curve.

Two stacks run side by side, alike but for the cache: `cache` as `tandem up` configures it, and
`no cache` with `--prefix-cache false` on every service that has the setting and the drafter's
context pool off (`--context-pool 0`). Both pinned as the
speculative bench pins its stack (edge services and the gateway on core 0, cloud services on core
1, one thread each: edge and cloud on their own cores), each with its own gateway. Each
conversation runs in each mode on both stacks back to back, the order alternating, so drift on a
shared machine hits both alike. Each conversation opens with a system message of its own (its
number and mode), so turn 1 finds nothing cached and turn 2 can reuse only turn 1. Greedy
decoding: the two stacks must give the same answers (`same_answers`), since the cache is exact.

Reported per (mode, turn): the median client-side time to first token (first streamed text) each
way, the ratio of mean TTFTs cache / no cache over the same conversations with a 95 % paired
bootstrap interval (bench/stats.py), and the fraction of the prompt the services reused
(`usage.prompt_tokens_details.cached_tokens / prompt_tokens`). Only the last turn's answer is cut
short (8 tokens): its TTFT is what is measured.

Goals (on this machine): turn-2 TTFT with the cache <= 0.35x without it in cloud-only and spec;
turn 6 of the synthetic conversation <= 0.2x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import stats, workloads
from bench.report import table, write_json
from bench.traffic import sse_events
from stack.launcher import SERVICES, Cluster

WAYS = ("cache", "no cache")
MODES = ("cloud-only", "spec", "split", "auto")
LAST_ANSWER_TOKENS = 8
GOALS = {2: 0.35, 6: 0.2}   # turn: the highest TTFT ratio cache / no cache that meets the goal


def conversations(turns: int, count: int) -> list[tuple[str, list[str]]]:
    """(name, user turns) for `count` conversations of `turns` user turns, from MT-Bench."""
    rows = workloads.mtbench_questions()
    per = turns // 2
    out = []
    for k in range(0, len(rows) - per + 1, per):
        group = rows[k:k + per]
        out.append(("+".join(f"mtbench/{r['question_id']}" for r in group),
                    [t for r in group for t in r["turns"][:2]]))
    return out[:count]


def cache_settings() -> dict[str, list[str]]:
    """`--prefix-cache false` for every service whose configuration has the setting, and
    `--context-pool 0` for the drafter (its pooled contexts are its cache of earlier turns)."""
    from stack.plan import service_settings
    out = {name: ["--prefix-cache", "false"] for name in SERVICES
           if hasattr(service_settings(name), "prefix_cache")}
    if hasattr(service_settings("drafter"), "context_pool"):
        out["drafter"] = ["--context-pool", "0"]
    return out


def make_stack(way: str, logdir: Path) -> Cluster:
    cores = sorted(os.sched_getaffinity(0))
    edge, cloud = [cores[0]], [cores[1 % len(cores)]]
    pin = {"drafter": edge, "prefix": edge, "dispatcher": edge, "verifier": cloud, "suffix": cloud}
    extra = {s: ["--threads", "1"] for s in ("verifier", "drafter", "prefix", "suffix")}
    if way == "no cache":
        for name, flags in cache_settings().items():
            extra[name] = extra.get(name, []) + flags
    return Cluster(SERVICES, ephemeral=True, logdir=logdir, extra=extra, pin=pin)


def chat_turn(http, base: str, messages: list[dict], mode: str, max_tokens: int) -> dict:
    """One streamed chat completion: TTFT (first text), the answer, and usage."""
    body = {"model": "tandem", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "mode": mode}
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    for event in sse_events(http, base, "chat/completions", body):
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
        usage = event.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{mode}: no text streamed (usage {usage})")
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": first - t0, "answer": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0)}


def run_conversation(http, base: str, turns: list[str], mode: str, answer_tokens: int,
                     opening: str = "") -> list[dict]:
    """The turns in order, each answer appended before the next; `opening` a system message
    that makes this conversation's prompt its own (no other conversation's cache matches it)."""
    messages, out = ([{"role": "system", "content": opening}] if opening else []), []
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        last = i == len(turns) - 1
        r = chat_turn(http, base, messages, mode, LAST_ANSWER_TOKENS if last else answer_tokens)
        messages.append({"role": "assistant", "content": r["answer"]})
        out.append(r)
    return out


def result_rows(samples: dict, modes: list[str], turns: int) -> list[dict]:
    rows = []
    for mode in modes:
        for t in range(turns):
            on = [conv[t] for conv in samples[mode, "cache"]]
            off = [conv[t] for conv in samples[mode, "no cache"]]
            a = [x["ttft_s"] * 1000 for x in on]
            b = [x["ttft_s"] * 1000 for x in off]
            ratio = statistics.fmean(a) / statistics.fmean(b)
            rows.append({
                "mode": mode, "turn": t + 1, "n": len(a),
                "prompt_tokens_mean": statistics.fmean(x["prompt_tokens"] for x in on),
                "ttft_ms_cache": statistics.median(a), "ttft_ms_no_cache": statistics.median(b),
                "ttft_ratio": ratio, "ttft_ratio_ci95": stats.ratio_ci(a, b),
                "cached_fraction": statistics.fmean(x["cached_tokens"] / max(1, x["prompt_tokens"])
                                                    for x in on),
                "cached_fraction_no_cache": statistics.fmean(
                    x["cached_tokens"] / max(1, x["prompt_tokens"]) for x in off),
                "same_answers": all(x["answer"] == y["answer"] for x, y in zip(on, off)),
            })
    return rows


def goals(rows: list[dict], turns: int) -> list[str]:
    out = []
    last = {r["mode"]: r for r in rows if r["turn"] == turns}
    bound = GOALS.get(turns)
    for mode in ("cloud-only", "spec"):
        r = last.get(mode)
        if r is None or bound is None:
            continue
        lo, hi = r["ttft_ratio_ci95"]
        out.append(f"{mode}: turn-{turns} TTFT with the cache {r['ttft_ratio']:.2f}x without it "
                   f"[{lo:.2f}, {hi:.2f}]: {'met' if r['ttft_ratio'] <= bound else 'NOT met'} "
                   f"(goal <= {bound}x)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench chat", description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=0, help="default 20 (quick 2)")
    ap.add_argument("--turns", type=int, default=2, choices=(2, 4, 6),
                    help="user turns per conversation: MT-Bench's 2, or several questions' in a row")
    ap.add_argument("--modes", default="", help=f"of {', '.join(MODES)} (default cloud-only,spec,"
                                                "split; quick cloud-only,spec)")
    ap.add_argument("--answer-tokens", type=int, default=0,
                    help="tokens per answer but the last turn's (default 96; quick 16)")
    ap.add_argument("--quick", action="store_true", help="a small run: it runs and reports (CI)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    modes = [m for m in (args.modes or ("cloud-only,spec" if args.quick else
                                        "cloud-only,spec,split")).split(",") if m]
    if set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(set(modes) - set(MODES))}; known: {', '.join(MODES)}")
    count = args.conversations or (2 if args.quick else 20)
    answer_tokens = args.answer_tokens or (16 if args.quick else 96)
    try:
        convs = conversations(args.turns, count)
    except workloads.WorkloadError as e:
        print(f"tandem bench chat: {e}", file=sys.stderr)
        return 2

    import httpx

    from stack.observability import start_gateway

    t0 = time.monotonic()
    logroot = Path(tempfile.mkdtemp(prefix="tandem-bench-chat-"))
    samples: dict[tuple[str, str], list[list[dict]]] = {(m, w): [] for m in modes for w in WAYS}
    with contextlib.ExitStack() as stack:
        bases = {}
        stacks = {w: make_stack(w, logroot / w.replace(" ", "-")) for w in WAYS}
        for cl in stacks.values():
            stack.callback(cl.stop_all)
            cl.start_all()
        for way, cl in stacks.items():
            cl.wait_ready(timeout=600)
            gateway, bases[way] = start_gateway(cl.endpoint("dispatcher"),
                                                logroot / f"api-{way.replace(' ', '-')}.log")
            os.sched_setaffinity(gateway.pid, {sorted(os.sched_getaffinity(0))[0]})
            stack.callback(gateway.wait, 10)
            stack.callback(gateway.terminate)
        http = stack.enter_context(httpx.Client(timeout=600))
        print(f"# bench chat: {len(convs)} conversations x {args.turns} turns x {modes} x "
              f"{len(WAYS)} stacks, {answer_tokens}-token answers; started in "
              f"{time.monotonic() - t0:.0f} s; no-cache flags {cache_settings()}", flush=True)
        for way in WAYS:   # first-call costs (oneDNN packing, llama.cpp graphs) left out
            for mode in modes:
                run_conversation(http, bases[way], ["Say hello."], mode, 4)
        for k, (name, turns) in enumerate(convs):
            for mode in modes:
                for way in (WAYS if k % 2 == 0 else WAYS[::-1]):
                    conv = run_conversation(http, bases[way], turns, mode, answer_tokens,
                                            opening=f"Conversation {k} in {mode}.")
                    samples[mode, way].append(conv)
                    print(f"  {name:28s} {mode:10s} {way:8s} TTFT ms "
                          + " ".join(f"{x['ttft_s'] * 1000:6.0f}" for x in conv)
                          + "  cached " + " ".join(f"{x['cached_tokens']}/{x['prompt_tokens']}"
                                                   for x in conv), flush=True)
    rows = result_rows(samples, modes, args.turns)
    print()
    print(table(rows, [("mode", "mode"), ("turn", "turn"), ("n", "n"),
                       ("prompt_tokens_mean", "prompt tokens"),
                       ("ttft_ms_cache", "TTFT ms cache"), ("ttft_ms_no_cache", "TTFT ms no cache"),
                       ("ttft_ratio", "cache / no cache"), ("ttft_ratio_ci95", "95% CI"),
                       ("cached_fraction", "cached"), ("same_answers", "same answers")]))
    lines = goals(rows, args.turns)
    for line in lines:
        print("# goal: " + line)
    print(f"# wall time {time.monotonic() - t0:.0f} s")
    write_json(args.json, "chat", "loopback", rows, turns=args.turns, modes=modes,
               conversations=[name for name, _ in convs], answer_tokens=answer_tokens,
               deployment="edge services and gateway on core 0, cloud services on core 1, "
                          "one thread each; loopback",
               goals=lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
