"""Regenerate docs/reliability.md: run the reliability tests, then render the figures they wrote.

    python -m bench.reliability_report            # default suite (~5 min on 2 cores)
    python -m bench.reliability_report --slow     # + the full chaos sweep, 300-example fuzz, atheris
    python -m bench.reliability_report --render   # only re-render from the last run's figures

The tests (tests/integration/: test_chaos.py, test_partitions.py, test_faults.py, test_load.py,
test_fuzz.py, test_security.py, test_replicas_process.py, test_resume_process.py)
write one JSON per section into $TANDEM_RELIABILITY_DIR; this script points that at its own
directory (run/reliability-report/), clears it, runs pytest, and writes the page from what the
tests measured — no figure on the page is typed by hand. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.report import machine
from common.models import repo_root

TESTS = ["tests/integration/test_chaos.py", "tests/integration/test_partitions.py",
         "tests/integration/test_faults.py", "tests/integration/test_load.py",
         "tests/integration/test_fuzz.py", "tests/integration/test_security.py",
         "tests/integration/test_replicas_process.py",
         "tests/integration/test_resume_process.py"]
SECTIONS = ("chaos", "partitions", "faults", "load", "fuzz", "security", "replicas")


def run_tests(out: Path, slow: bool) -> tuple[int, dict]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    junit = out / "junit.xml"
    env = {**os.environ, "TANDEM_RELIABILITY_DIR": str(out)}
    cmd = [sys.executable, "-m", "pytest", *TESTS, "-q", f"--junitxml={junit}"]
    if slow:
        env["TANDEM_FUZZ_EXAMPLES"] = env.get("TANDEM_FUZZ_EXAMPLES", "300")
    else:
        cmd += ["-m", "not slow"]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=repo_root(), env=env)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    if junit.exists():
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += float(suite.get(k, 0)) if k == "time" else int(suite.get(k, 0))
    (out / "run.json").write_text(json.dumps({"rc": rc, "slow": slow, "counts": counts,
                                              "machine": machine()}, indent=2))
    return rc, counts


def load(out: Path) -> dict:
    data = {}
    for name in (*SECTIONS, "run"):
        path = out / f"{name}.json"
        data[name] = json.loads(path.read_text()) if path.exists() else {}
    return data


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) if v else "–"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return out


def _reasons(rs: list[str]) -> str:
    if not rs:
        return "–"
    counts: dict[str, int] = {}
    for r in rs:
        counts[r] = counts.get(r, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items()))


def render_replicas(reps: dict) -> list[str]:
    """Replicated cloud services: rolling restart under load, supervision, bounded waits."""
    if not reps:
        return []
    L = ["## Replicas, rolling restarts and supervision (tests/integration/test_replicas_process.py)", ""]
    v = reps.get("rolling restart of every cloud replica under load")
    if v:
        paired = any("replicas" in r for r in v["restarts"])
        L += [f"{v['replicas']}. Every cloud replica "
              + ("got SIGTERM, a verifier and a suffix at a time" if paired else
                 "in turn got SIGTERM") + " — it drains (not "
              f"ready, no new session, drain_s = {v['drain_s']} s for open ones, the rest "
              f"handed back), exits, and is started again — while the load ran: "
              f"{v['requests']} requests, {v['done']} done, {v['errors']} errors, "
              f"{v['tokens']} tokens, {v['tokens_lost']} lost, {v['tokens_duplicated']} "
              f"duplicated, {v['equal_to_transformers']} outputs equal to transformers' "
              f"generate; {v['handed_back']} sessions handed back by draining replicas, "
              f"{v['sessions_replayed']} requests replayed "
              f"({_fmt(v['recovery_reasons'])}).", ""]
        L += _table(["replica", "SIGTERM to exit s", "restart to ready s"],
                    [[r.get("replica") or " + ".join(r["replicas"]), r["drain_and_exit_s"],
                      r["restart_to_ready_s"]]
                     for r in v["restarts"]])
        rows = [[role, b["samples_both_admitting"], b["max_gap"], b["samples_gap_ge_2"],
                 b["steady_samples"], b["steady_max_gap"], b["steady_samples_gap_ge_2"]]
                for role, b in v["balance"].items()]
        L += ["", "Placement (least outstanding work, services/dispatcher/placement.py): each "
              "replica's `tandem_sessions` sampled every 0.25 s under load, the gap between two "
              "replicas that were both admitting; *steady* leaves out each restart's window "
              "(from SIGTERM until every request sent before the replica was back has ended: "
              "the sessions placed on the other replica meanwhile turn over"
              + (f"; those ends came {_fmt(v['quiet_after_ready_s'])} s after ready, a request "
                 f"took {v['request_s_median']} s at the median"
                 if "quiet_after_ready_s" in v else "") + "):", ""]
        L += _table(["role", "samples", "max gap", "gap ≥ 2", "steady samples",
                     "steady max gap", "steady gap ≥ 2"], rows)
        L.append("")
    for name in ("kill -9 of the verifier under supervision", "verifier down for good mid-request"):
        v = reps.get(name)
        if v:
            text = "; ".join(f"{k.replace('_', ' ')}: {_fmt(x)}" for k, x in v.items()
                             if k != "recorded")
            L += [f"* {name}: {text}."]
    L.append("")
    return L


def render(d: dict) -> str:
    chaos, faults, load_, fuzz, sec, run = (d[k] for k in ("chaos", "faults", "load", "fuzz",
                                                           "security", "run"))
    m = run.get("machine") or machine()
    counts = run.get("counts", {})
    L: list[str] = ["# Reliability and security", ""]
    L += ["Generated by `python -m bench.reliability_report"
          + (" --slow" if run.get("slow") else "") + "` from the figures the tests below "
          "measured; rerun it to regenerate this page (`--slow` adds the full chaos sweep, "
          "300 hypothesis examples per property and a bounded atheris run).", ""]
    if counts:
        ok = counts["failures"] == 0 and counts["errors"] == 0
        L += [f"Test run: {counts['tests']} tests, {counts['failures']} failures, "
              f"{counts['errors']} errors, {counts['skipped']} skipped, "
              f"{counts['time']:.0f} s — {'all passed' if ok else '**FAILURES: see below**'}. "
              f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, Python "
              f"{m.get('python', '?')}, {m.get('date', '')}.", ""]

    # --- summary
    link = [v for v in chaos.values() if v.get("kind") in ("shape", "fault")]
    # a fault counts as survived only when its test showed it took effect (a replay, a live
    # connection dropped, a silence as long as the partition, a session that lost its drafter);
    # a figure without that evidence (e.g. a drop that hit no message, from an older run) does not
    injected = [v for v in chaos.values() if v.get("kind") == "fault"] + list(faults.values())
    n_faults = sum(1 for v in injected if v.get("took_effect"))
    no_effect = len(injected) - n_faults
    replays = sum(v.get("recoveries", 0) for v in link)
    proc_recovered = sum(v.get("sessions_recovered", 0) for v in faults.values())
    lost = (sum(v.get("tokens_lost", 0) for v in link)
            + sum(v.get("tokens_lost", 0) for v in faults.values()))
    dup = (sum(v.get("tokens_duplicated", 0) for v in link)
           + sum(v.get("tokens_duplicated", 0) for v in faults.values()))
    tokens = (sum(v.get("tokens_received", 0) for v in link)
              + sum(v.get("tokens", 0) for v in faults.values()))
    fz = fuzz.get("hypothesis through sockets", {})
    inputs = sum((fz.get("replies_per_service") or {}).values())
    sustained = [v for k, v in load_.items() if k.startswith("sustained")]
    L += ["## Summary", ""]
    L += _table(["figure", "value"], [
        ["link conditions run (shapes + faults)", len(link)],
        ["faults injected and survived (link + process)", n_faults],
        *([["faults injected with no evidence they took effect (not counted above)", no_effect]]
          if no_effect else []),
        ["session replays after link faults", replays],
        ["sessions recovered after process kills", proc_recovered],
        ["tokens streamed under faults / lost / duplicated", f"{tokens} / {lost} / {dup}"],
        ["malformed messages answered (hypothesis, all services)", inputs],
        ["requests served under sustained load",
         sum(v.get("requests_ok", 0) for v in sustained)],
        ["errors under load other than `busy`", sum(v.get("errors", 0) for v in sustained)],
    ])
    L.append("")

    # --- chaos
    L += ["## WAN chaos (tests/integration/test_chaos.py)", "",
          "The dispatcher reaches the verifier (cloud-only, spec) and the suffix (split) through "
          "the WAN emulator (stack/wan.py); two greedy sessions run per condition. *recover* = "
          "fault injected to the next token at "
          "the client; *longest gap* = longest silence between two tokens. Replays (reasons: "
          "`down` = heartbeats stopped, `gap` = a token index jumped, `stall` = silence with "
          "time left) rebuild the session from its committed tokens "
          "(services/dispatcher/recovery.py). Every output equals transformers' "
          "generate(do_sample=False), token for token.", ""]
    rows = []
    for name, v in chaos.items():
        if v.get("kind") not in ("shape", "fault"):
            continue
        rows.append([name, v.get("tokens_received"), v.get("tokens_lost"),
                     v.get("tokens_duplicated"), v.get("recoveries"),
                     _reasons(v.get("recovery_reasons", [])), v.get("time_to_recover_s"),
                     v.get("longest_gap_s")])
    L += _table(["condition", "tokens", "lost", "dup", "replays", "reasons", "recover s",
                 "longest gap s"], rows)
    for v in chaos.values():
        if v.get("kind") == "deadline":
            L += ["", f"Deadline: a request with a {v['deadline_s']} s deadline during a 6 s "
                  f"cut partition was answered `{v['error']}` after {v['answered_after_s']} s "
                  f"({v['tokens_before_error']} tokens before it); the next request after the "
                  f"link healed was served exactly."]
    L.append("")

    # --- partitions and degraded mode
    parts = d.get("partitions") or {}
    if parts:
        L += ["## Partitions and degraded mode (tests/integration/test_partitions.py)", ""]
        for name, v in parts.items():
            k = v.get("kind")
            if k == "wait":
                L.append(f"* {name}: the request waited for its verifier and finished with "
                         f"{v['tokens']} tokens identical to the reference, {v['tokens_lost']} "
                         f"lost, in {v['wall_s']} s (replays: {_reasons(v['recovery_reasons'])}).")
            elif k == "deadline":
                L.append(f"* {name}: answered `{v['error']}` after {v['answered_after_s']} s "
                         f"({v['tokens_before_error']} tokens before it), not `unavailable`.")
            elif k == "degraded":
                L.append(f"* {name}: {v['exact_before']} target tokens, then "
                         f"{v['degraded_tokens']} drafter tokens marked degraded, then "
                         f"verification resumed at index {v['resumed_at']}; the "
                         f"{v['resumed_checked']} tokens checked after it are the target's own "
                         f"continuation. No token lost or repeated.")
            elif k == "orphans":
                L.append(f"* {name}: {v['sessions']} sessions (cloud-only, spec) dropped by the "
                         f"verifier and drafter {v['dropped_after_s']} s after the kill "
                         f"(peer_idle_timeout_s = {v['idle_timeout_s']}).")
        L.append("")

    # --- faults
    L += ["## Process faults (tests/integration/test_faults.py)", "",
          "SIGKILL mid-generation, then restart. Sessions are replayed from their committed "
          "tokens on the restarted (or another) replica and finish with the reference output.", ""]
    rows = []
    for name, v in faults.items():
        extra = ""
        if "client_error" in v:
            extra = (f"client got {v['client_error']} after {v['error_after_s']} s; "
                     f"resubmitted: {v['resubmitted_tokens']} tokens, exact")
        elif "ready_to_next_token_s" in v:
            extra = (f"SDK and gateway streams resumed, exact; restart to ready "
                     f"{v['kill_to_ready_s']} s, ready to the next token "
                     f"{v['ready_to_next_token_s']} s")
        elif v.get("final_replicas") and any(v["final_replicas"]):
            extra = "finished on: " + _reasons([r for r in v["final_replicas"] if r])
        rows.append([name, v.get("sessions"), v.get("sessions_recovered", "–"),
                     v.get("tokens_lost"), v.get("tokens_duplicated", 0),
                     v.get("time_to_recover_s"), extra])
    L += _table(["fault", "sessions", "recovered", "lost", "dup", "recover s", "notes"], rows)
    L.append("")

    L += render_replicas(d.get("replicas") or {})

    # --- load
    L += ["## Load (tests/integration/test_load.py)", ""]
    for name, v in load_.items():
        if name.startswith("burst"):
            L += [f"Burst of {v['requests']} requests at once against `max_sessions` = "
                  f"{v['max_sessions']}: {v['admitted']} admitted (all exact), {v['busy']} "
                  f"answered `busy` (median {v['busy_answer_p50_s'] * 1000:.0f} ms, max "
                  f"{v['busy_answer_max_s'] * 1000:.0f} ms) — nothing queued without bound.", ""]
    rows = [[name, v["clients"], v["seconds"], v["requests_ok"], v["busy"], v["errors"],
             v["tokens"], v["latency_p50_s"], v["latency_p99_s"], v["rss_after_warmup_mb"],
             v["rss_end_mb"]]
            for name, v in load_.items() if name.startswith("sustained")]
    L += _table(["run", "clients", "s", "ok", "busy", "errors", "tokens", "p50 s", "p99 s",
                 "peak RSS 30-50 % MB", "peak RSS last 15 % MB"], rows)
    rows = [[name, mode, x["requests"], x["latency_p50_s"], x["latency_p99_s"], x["ttft_p50_s"],
             x["ttft_p99_s"]]
            for name, v in load_.items() if name.startswith("sustained")
            for mode, x in v.get("per_mode", {}).items()]
    if rows:
        L += ["", "Per mode:", ""]
        L += _table(["run", "mode", "requests", "p50 s", "p99 s", "TTFT p50 s", "TTFT p99 s"],
                    rows)
    L += ["", "Latency is request send to last token, at the client; closed-loop clients spread "
          "evenly over the modes, prompts of 3–10 tokens, 6–16 new tokens, model services on "
          "one thread each, all on one 2-core machine. Every result is checked against the "
          "reference. Memory: each service's peak RSS over the last 15 % of the run must stay within "
          "64 MB of its peak over 30–50 % of the run (after warm-up); a leak keeps raising the "
          "peak.", ""]

    # --- fuzz
    L += ["## Bad input (tests/integration/test_fuzz.py, fuzz/)", ""]
    if fz:
        L += [f"Hypothesis, {fz['examples_per_property']} examples per property × "
              f"{fz['properties']} properties (garbage frames, random msgpack headers, real "
              "message types with random values) sent to every service over ZMQ. Replies by "
              "kind (an Error's stable code, or a normal reply); `internal` (a handler that "
              "raised) never occurred:", ""]
        rows = [[svc, sum(c.values()), _fmt(dict(sorted(c.items(), key=lambda x: -x[1])))]
                for svc, c in (fz.get("replies_by_kind") or {}).items()]
        L += _table(["service", "replies", "by kind"], rows)
        L.append("")
    raw = {k: v for k, v in fuzz.items() if k.startswith("raw TCP")}
    if raw:
        L += ["Raw TCP peers on the ZMQ ports: every one is dropped by the service, which "
              "answers other clients meanwhile (seconds until the connection was closed):", ""]
        kinds = list(next(iter(raw.values()))["dropped_after_s"])
        L += _table(["service", *kinds], [[k.removeprefix("raw TCP peers on "),
                                           *[v["dropped_after_s"].get(x) for x in kinds]]
                                          for k, v in raw.items()])
        L.append("")
    if "oversize frames" in fuzz:
        v = fuzz["oversize frames"]
        L += [f"Oversize frames (limit {v['limit_bytes']} bytes): just over the limit -> "
              f"{v['just_over']}; four times the limit -> {v['four_times']}.", ""]
    if "HTTP bad clients" in fuzz:
        v = fuzz["HTTP bad clients"]
        L += [f"HTTP ports: {', '.join(v.get('bad_requests', []))}; "
              f"{v['slow_clients_per_service']} slow clients per service, all dropped (within "
              f"{max(v.get('slow_dropped_within_s', {'?': 0}).values())} s of connecting); "
              "/healthz answered throughout.", ""]
    if "background session during fuzzing" in fuzz:
        v = fuzz["background session during fuzzing"]
        L += [f"A real {v['tokens']}-token session ran through all of it: exact, "
              f"{v['tokens_lost']} lost, {v['tokens_duplicated']} duplicated; no session was "
              "left open on any service afterwards.", ""]
    sem = fuzz.get("semantic: poisoned values, then an exact request")
    if sem:
        L += [f"Semantic fuzzing: well-formed messages with one value poisoned (NaN, ±inf, "
              f"-0.0, negative and huge integers, empty and oversize lists, unknown, empty and "
              f"reused session ids; {sem['constrained_cases_in_types']} cases read from the "
              f"protocol types), each followed by a normal request through the mode that "
              f"uses the service, checked token for token against transformers. Examples per "
              f"service: {_fmt(sem['poisoned_examples_per_service'])}; exact after each: "
              f"{sem['exact_after_each']}; `internal` replies: {sem['internal_errors']}. "
              f"Poisoned SDK arguments (temperature, top_p, top_k, max_tokens, deadline_s, "
              f"seed, cut), by outcome: {_fmt(sem['sdk_arguments'])}. One poisoned session's "
              "fault inside a batch (forward or sampling) ends only that session: "
              "tests/unit/test_containment.py.", ""]
    for name, v in fuzz.items():
        if name.startswith("atheris"):
            L += [f"{name}: {v['runs']} inputs in {v['seconds']} s, findings: "
                  f"{v['findings']}.", ""]
    L += ["Findings fixed on the way: a msgpack header whose `type` is a map crashed the "
          "decoder's error classification and, through it, the service's receive loop "
          "(common/protocol.py, common/runtime.py); bytes that are not a ZMTP greeting were "
          "held open forever as a ZMTP 1.0 peer (now refused: the ROUTER sets a ZAP domain); a "
          "CloudGenerate reusing the id and seq of an open speculative session was silently "
          "ignored (now `session_exists`); a NaN temperature passed every range check and "
          "killed the verifier's engine loop, wedging cloud-only for everyone while /readyz "
          "said ready (now refused by the types, a session's fault is contained, and readiness "
          "follows the loop's heartbeat).", ""]

    # --- security
    L += ["## Security (tests/integration/test_security.py)", ""]
    rows = []
    v = sec.get("CURVE dispatcher->verifier")
    if v:
        rows.append(["CURVE on dispatcher -> verifier", f"cloud-only generation through it equals "
                     f"transformers; {v['wire_bytes']} bytes crossed a TCP tap on the link, none "
                     "of the protocol's clear-text markers among them"])
    v = sec.get("CURVE rejects unknown peers")
    if v:
        rows.append(["CURVE rejects unknown peers", "; ".join(
            f"{k}: {n} replies" for k, n in v["replies"].items())
            + f"; messages that reached a handler: {v['reached_handler']}; the allowed key from a "
              "raw socket is answered"])
    v = sec.get("CURVE client -> dispatcher (SDK)")
    if v:
        rows.append(["CURVE on client (SDK) -> dispatcher", f"allowlisted key pair: "
                     f"{v['allowed_key']}; unknown key: {v['unknown_key']}; plaintext client: "
                     f"{v['plaintext']}; their requests that reached a handler: "
                     f"{v['reached_handler']}"])
    v = sec.get("ports bound to loopback")
    if v:
        rows.append(["ports bound to loopback", f"HTTP {v['http']}; ZMQ {v['zmq']}; checked on "
                     f"running {', '.join(v['services_checked'])} via /proc/net/tcp"])
    v = sec.get("per-client limits")
    if v:
        rows.append(["per-client limits", f"client_max_sessions {v['client_max_sessions']}, "
                     f"client_max_tokens {v['client_max_tokens']}: a request alone over the "
                     f"tokens -> `{v['over_tokens']}`; a second request in flight -> "
                     f"`{v['over_sessions']}`; another client meanwhile: {v['other_client']}; the "
                     f"first client after its request ended: {v['after_release']}"])
    L += _table(["check", "result"], rows)
    L += ["", "CURVE: `tandem keys create verifier dispatcher --allow dispatcher` writes the key "
          "pairs (zmq.auth); the verifier binds with `--curve-secret-key keys/verifier.key_secret "
          "--curve-allow-dir keys/allowed` and ZAP (zmq.auth's asyncio authenticator) admits "
          "only allowlisted client keys, before any message reaches a handler; the dispatcher "
          "dials with `--curve-client-key keys/dispatcher.key_secret --curve-server-keys "
          "verifier=keys/verifier.key`. The client-facing socket works the same way: the "
          "dispatcher binds with `--curve-secret-key keys/dispatcher.key_secret "
          "--curve-allow-dir keys/clients` and the SDK connects with "
          "`Client(endpoint, curve_server_key='keys/dispatcher.key', "
          "curve_client_key='keys/app.key_secret')` (`tandem generate --curve-server-key ... "
          "--curve-client-key ...`). Per-client limits: `--client-max-sessions`, "
          "`--client-max-tokens` on the dispatcher (a client is its CURVE key when the "
          "dispatcher authenticates clients, else its ZMQ identity).", ""]
    return "\n".join(L).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slow", action="store_true", help="also run the tests marked slow")
    ap.add_argument("--render", action="store_true", help="only render existing figures")
    ap.add_argument("--results", default=str(repo_root() / "run" / "reliability-report"),
                    help="figures directory (its own, so other pytest runs cannot mix in)")
    ap.add_argument("--out", default=str(repo_root() / "docs" / "reliability.md"))
    args = ap.parse_args(argv)
    out = Path(args.results)
    rc = 0
    if not args.render:
        rc, counts = run_tests(out, args.slow)
        print(f"pytest: {counts}", flush=True)
    Path(args.out).write_text(render(load(out)))
    print(f"wrote {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
