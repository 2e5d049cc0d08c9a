"""The `tandem` command line.

    tandem up [--detach] [--replicas verifier=2,suffix=2]
                                start all services locally on the bundled model, stream a demo;
                                a service that dies is restarted with backoff
    tandem down                 stop what `up --detach` started
    tandem status [--json]      each service: name, endpoint, pid, health
    tandem serve SERVICE ...    run one service in the foreground (what compose runs);
                                `tandem serve api`: the OpenAI-compatible HTTP gateway
    tandem generate PROMPT ...  one request through the SDK [--json]
    tandem up --model NAME | --target PATH [--drafter GGUF]   serve another model (docs/models.md)
    tandem models list|prepare [NAME]|check --target PATH [--drafter GGUF]|show  [--json]
    tandem link ...             the WAN emulator (stack/wan_cli.py)
    tandem keys ...             CURVE key pairs for the edge-cloud links (stack/keys.py)
    tandem bench ...            benchmarks (bench/)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

SERVICE_NAMES = ("dispatcher", "verifier", "drafter", "prefix", "suffix")
DEMO_PROMPT = "Explain in two sentences why speculative decoding is lossless."


def _available_services() -> list[str]:
    from stack.launcher import GATEWAY, SERVICES
    root = Path(__file__).resolve().parent.parent
    found = [s for s in SERVICES if (root / "services" / s / "service.py").is_file()]
    if "dispatcher" in found and (root / "api" / "service.py").is_file():
        found.append(GATEWAY)   # the OpenAI-compatible gateway, in front of the dispatcher
    return found


def cmd_models(args) -> int:
    from common import models
    if args.action == "list":
        rows = [{"name": m.name, "description": m.description, "prepared": m.prepared(),
                 "target": str(models.models_dir() / m.target_dir),
                 "drafter": str(models.models_dir() / m.drafter_file)}
                for m in models.NAMED.values()]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                print(f"{r['name']:14s} {'prepared' if r['prepared'] else 'not prepared':13s} "
                      f"{r['description']}")
        return 0
    if args.action == "prepare":
        try:
            name = args.name or models.DEFAULT_MODEL
            if name == "bundled" or name in models.NAMED:
                paths = models.prepare_all(name)
            else:   # your own model (compose passes TANDEM_TARGET): a GGUF is dequantised once
                paths = models.ModelPaths(models.resolve_target(name), None, None)
            if paths.drafter is not None:
                models.check_tokenizers(paths.target, paths.drafter)
        except models.ModelError as e:
            return _fail(args, "model", str(e))
        if args.json:
            print(json.dumps({"target": str(paths.target), "drafter": str(paths.drafter or ""),
                              "drafter_ideal": str(paths.drafter_ideal or "")}))
        else:
            print(f"target : {paths.target}")
            if paths.drafter is not None:
                print(f"drafter: {paths.drafter}\ndrafter (near-ideal): {paths.drafter_ideal}")
        return 0
    if args.action == "check":
        try:
            target = models.resolve_target(args.target or args.name)
            drafter = models.resolve_drafter(args.drafter) if args.drafter else None
            report = models.check_pair(target, drafter)
        except models.ModelError as e:
            return _fail(args, "model", str(e))
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"target   : {target}\narch     : {report['family']} "
                  f"({report['model_type']}, {report['layers']} layers): supported")
            if drafter is not None:
                print(f"drafter  : {drafter}\ntokenizer: {report['tokenizer']}")
        return 0
    p = models.default_paths()
    rows = [{"name": name, "path": str(path), "ok": path.exists()}
            for name, path in (("target", p.target), ("drafter", p.drafter),
                               ("drafter_ideal", p.drafter_ideal))]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:14s} {'ok     ' if r['ok'] else 'missing'} {r['path']}")
    return 0


def _select_model(args) -> tuple[Path, Path | None]:
    """The target directory and drafter GGUF `up` serves, prepared when needed: --model NAME, or
    --target PATH [--drafter GGUF], or the same from TANDEM_TARGET / TANDEM_DRAFTER_DRAFTER, or
    the bundled model. A named target brings its own drafter; a GGUF target without a drafter
    gets a Q4_0 re-quantisation of itself; an HF directory without one runs without a drafter
    (no spec mode). Raises ModelError."""
    from common import models

    if args.model and args.target:
        raise models.ModelError("--model and --target are exclusive: a named model brings its "
                                "own target and drafter")
    target = args.model or args.target or os.environ.get("TANDEM_TARGET", "")
    drafter = args.drafter or os.environ.get("TANDEM_DRAFTER_DRAFTER", "")
    if not target or target == "bundled" or target in models.NAMED:
        paths = models.prepare_all(target or models.DEFAULT_MODEL)
        return paths.target, models.resolve_drafter(drafter) if drafter else paths.drafter
    source = Path(target).expanduser()
    target_dir = models.resolve_target(target)   # dequantises a GGUF once
    if drafter:
        return target_dir, models.resolve_drafter(drafter)
    if source.suffix == ".gguf":
        return target_dir, models.prepare_drafter(
            source, models.models_dir() / f"{source.stem}-draft-q4_0.gguf")
    return target_dir, None


def _fail(args, code: str, message: str, hint: str = "", field: str = "") -> int:
    """A helpful error, not a traceback: `error: ...` (and a hint) on stderr; with --json also
    {"error": {"code", "message", "field"}} on stdout, for scripts. Exit status 1."""
    print(f"error: {message}" + (f"\n  {hint}" if hint else ""), file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": {"code": code, "message": message, "field": field}}))
    return 1


def cmd_up(args) -> int:
    from common import models
    from stack.launcher import (Cluster, Supervisor, parse_replicas, planned,
                                 run_dir, supervise_detached)

    existing = Cluster.from_state()
    if existing and any(p.alive() for p in existing.procs.values()):
        print("tandem is already running (`tandem status`, `tandem down`)", file=sys.stderr)
        return 1
    try:
        target, drafter = _select_model(args)
        models.check_pair(target, drafter)
    except models.ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        replicas = parse_replicas(args.replicas)
    except ValueError as e:
        return _fail(args, "config", str(e))
    services = [s for s in _available_services() if drafter is not None or s != "drafter"]
    if drafter is None and args.mode == "spec":
        print("error: spec mode needs a drafter: pass --drafter GGUF", file=sys.stderr)
        return 1
    # every service reads its model from these (common/config.py: TANDEM_<SERVICE>_<FIELD>
    # wins over TANDEM_<FIELD>; the dispatcher's own `drafter` field is an endpoint)
    model_env = {"TANDEM_TARGET": str(target),
                 "TANDEM_DRAFTER_DRAFTER": str(drafter) if drafter is not None else None}
    try:
        cluster = planned(services, env=model_env, replicas=replicas)
    except (ValueError, SystemExit) as e:   # an override naming a core that is not usable
        return _fail(args, "config", str(e),
                     "check TANDEM_<SERVICE>_CPUS / TANDEM_<SERVICE>_THREADS")
    busy = [f"{p.name} {where}" for p in cluster.procs.values()
            for where, host, port in (
                (p.endpoint, *p.endpoint.split("://", 1)[-1].rsplit(":", 1)),
                (f"http://127.0.0.1:{p.http_port}", "127.0.0.1", p.http_port))
            if _port_taken(host, int(port))]
    if busy:
        print(f"error: ports already in use: {', '.join(busy)}\n  is another Tandem running? "
              f"`tandem status` / `tandem down`, or stop the process that holds them "
              f"(`ss -ltnp`)", file=sys.stderr)
        return 1
    print(f"serving {target}" + (f" with drafter {drafter}" if drafter else " (no drafter)"),
          flush=True)
    print(f"starting {', '.join(cluster.procs)} (logs in {run_dir()})", flush=True)
    print(cluster.describe(), flush=True)
    # SIGTERM stops the services like Ctrl-C does, from the first spawn on: a signal that came
    # before this handler (say, right after "serving until Ctrl-C") killed `up` and left them all
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    detached = False
    try:
        cluster.start_all()
        cluster.save_state()
        t = time.monotonic()
        cluster.wait_ready(timeout=args.timeout)
        print(f"all services ready in {time.monotonic() - t:.1f} s", flush=True)
        for p in cluster.procs.values():
            print(f"  {p.name:10s} {p.endpoint:24s} pid {p.pid:<7d} http://127.0.0.1:{p.http_port}/metrics")
        if "api" in cluster.procs:
            print(f"  OpenAI-compatible API: {cluster.endpoint('api')}/v1 (docs/api.md)",
                  flush=True)
        _demo(cluster.endpoint("dispatcher"), args.mode, chat=_has_chat_template(target))
        if args.detach:
            detached = True
            pid = supervise_detached(cluster.save_state())
            print(f"running in the background, supervised (pid {pid}: a service that dies is "
                  f"restarted); `tandem down` stops it")
            return 0
        print("serving until Ctrl-C (a service that dies is restarted) ...", flush=True)
        Supervisor(cluster, log=lambda m: print(m, file=sys.stderr, flush=True),
                   state=run_dir() / "state.json").run()
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    except Exception as e:  # noqa: BLE001
        print(f"start-up failed: {e}", file=sys.stderr)
        return 1
    finally:
        if not detached:
            # a second Ctrl-C / SIGTERM while stopping must not cut stop_all short and leave
            # services running with nobody to stop them
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            cluster.stop_all()
            (run_dir() / "state.json").unlink(missing_ok=True)


def _port_taken(host: str, port: int) -> bool:
    """Something listens on host:port (a bind test: SO_REUSEADDR, like ZMQ's and asyncio's
    listeners, so a port left in TIME_WAIT by a stopped Tandem does not count)."""
    import socket
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening(endpoint: str, timeout: float = 2.0) -> bool | None:
    """Whether a TCP endpoint accepts connections (None: not a tcp:// endpoint, unknown)."""
    import socket
    if not endpoint.startswith("tcp://"):
        return None
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _has_chat_template(target: Path) -> bool:
    """Whether the target's tokenizer carries a chat template (base models such as Gemma 3
    270M do not: the demo then sends a plain prompt)."""
    if (target / "chat_template.jinja").is_file():
        return True
    cfg = target / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def _demo(endpoint: str, mode: str, warmup: int = 2, chat: bool = True) -> None:
    """Warm up first (first-call costs: oneDNN weight packing, llama.cpp graph allocation,
    the drafter's first context), then stream the demo and print steady-state figures."""
    from tandem import Client
    print(f"\ndemo ({mode}): {DEMO_PROMPT}\n", flush=True)
    with Client(endpoint) as c:
        for _ in range(warmup):
            c.complete(DEMO_PROMPT, mode=mode, chat=chat, max_tokens=16)
        for chunk in c.generate(DEMO_PROMPT, mode=mode, chat=chat, max_tokens=64):
            print(chunk.text, end="", flush=True)
        print()
        print(_stats_line(c.last_result.stats) + f" (after {warmup} warm-up requests)",
              flush=True)


def _stats_line(stats: dict) -> str:
    parts = [f"mode={stats.get('mode')}"]
    if stats.get("mode") == "spec":
        parts.append(f"policy={stats.get('policy')}")
    if stats.get("auto"):
        parts.append(f"auto={stats['auto']['reason']}")
    parts.append(f"tokens={stats.get('generated_tokens')}")
    for key, label in (("ttft_s", "ttft"), ("tpt_s", "tpt")):
        if stats.get(key) is not None:
            parts.append(f"{label}={stats[key] * 1000:.1f}ms")
    if stats.get("acceptance_rate") is not None:
        parts.append(f"acceptance={stats['acceptance_rate']:.2f}")
    if stats.get("cloud_forwards_per_token") is not None:
        parts.append(f"cloud_forwards/token={stats['cloud_forwards_per_token']:.2f}")
    return "[stats] " + " ".join(parts)


def cmd_down(args) -> int:
    from stack.launcher import Cluster, run_dir, stop_supervisor
    stop_supervisor()   # first, so that it does not restart what we stop
    c = Cluster.from_state()
    if c is None:
        print("nothing to stop (no run/state.json)")
        return 0
    for p in reversed(list(c.procs.values())):
        if p.alive():
            print(f"stopping {p.name} (pid {p.pid})")
            c.stop(p.name)
    (run_dir() / "state.json").unlink(missing_ok=True)
    return 0


def cmd_status(args) -> int:
    from stack.launcher import Cluster
    c = Cluster.from_state()
    rows = []
    if c is not None:
        for p in c.procs.values():
            ready, why = p.readiness()   # /readyz follows the service's loops, not only HTTP
            health = "ready" if ready else ("down" if why == "down" else "unready")
            rows.append({"name": p.name, "endpoint": p.endpoint, "pid": p.pid,
                         "http": f"http://127.0.0.1:{p.http_port}", "health": health,
                         "readiness": why, "role": p.role or p.name, "restarts": p.restarts,
                         "threads": p.threads, "cpus": p.cpus})
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("tandem is not running (start it with `tandem up`)")
    else:
        from common.resources import format_cpus
        for r in rows:
            share = (f"{r['threads'] or '-':>2} threads on cores {format_cpus(r['cpus']) or 'all':6s}")
            restarts = f" restarted {r['restarts']}x" if r["restarts"] else ""
            print(f"{r['name']:10s} {r['endpoint']:24s} pid {r['pid']:<7d} {r['health']:7s} "
                  f"{share} {r['http']}{restarts}")
            if r["health"] == "unready":
                print(f"{'':10s} not ready: {r['readiness']}")
    return 0 if rows and all(r["health"] == "ready" for r in rows) else 1


def cmd_serve(args, rest) -> int:
    if args.service == "api":   # the HTTP gateway: no model, one asyncio thread, no plan to take
        importlib.import_module("api.service").main(rest)
        return 0
    if args.service not in SERVICE_NAMES:
        print(f"unknown service {args.service!r}; one of {', '.join(SERVICE_NAMES)}, api",
              file=sys.stderr)
        return 2
    if not any(a in ("-h", "--help") for a in rest):
        rest = _plan_serve(args.service, rest)
    module = importlib.import_module(f"services.{args.service}.service")
    module.main(rest)
    return 0


def _plan_serve(service: str, rest: list[str]) -> list[str]:
    """`tandem serve SERVICE` (what each container runs) takes its share of the cores it can use
    (its cpuset and CPU quota) as if its half (edge: dispatcher, drafter, prefix; cloud:
    verifier, suffix) ran beside it, as it does in a deployment: threads, affinity and how idle
    threads wait, before torch or llama.cpp start a thread.  Its own threads / cpus settings win."""
    from common import resources
    from stack.plan import service_settings
    cfg = service_settings(service, rest)
    gpu = [service] if str(getattr(cfg, "device", "cpu")).startswith("cuda") else []
    try:
        pinned = {service: resources.parse_cpus(cfg.cpus)} if cfg.cpus else {}
        cores = resources.usable_cpus()
        if pinned:   # named cores count, not the quota's cut of them
            cores = sorted(os.sched_getaffinity(0))
        share = resources.plan(cores, resources.half(service), gpu=gpu,
                               threads={service: cfg.threads}, pinned=pinned)[service]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for k, v in share.env.items():
        os.environ.setdefault(k, v)
    # pinned only when told: under a CPU quota the plan only counts cores (every container
    # pinning itself to "the first k" would pile them all onto the same ones)
    if pinned:
        os.sched_setaffinity(0, share.cpus)
    where = resources.format_cpus(os.sched_getaffinity(0))
    print(f"[resources] {service}: {share.threads} thread(s) on cores {where}"
          f", {share.wait} wait ({share.note})", file=sys.stderr,
          flush=True)
    return [*rest, "--threads", str(share.threads)]


def cmd_generate(args) -> int:
    from tandem import Client, TandemError
    kw = dict(mode=args.mode, max_tokens=args.max_tokens, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, policy=args.policy,
              cut=args.cut, chat=args.chat, deadline_s=args.deadline,
              sampling_coupling=args.sampling_coupling, tpt_slo_ms=args.tpt_slo_ms)
    if _listening(args.endpoint) is False:   # ZMQ would queue the request and wait for minutes
        return _fail(args, "unavailable", f"no dispatcher at {args.endpoint} (connection refused)",
                     "start Tandem with `tandem up --detach` (`tandem status` shows what runs), "
                     "or point --endpoint / TANDEM_ENDPOINT at a running dispatcher")
    try:
        with Client(args.endpoint, curve_server_key=args.curve_server_key or None,
                    curve_client_key=args.curve_client_key or None) as c:
            if args.json:
                r = c.complete(args.prompt, **kw)
                print(json.dumps({"mode": r.stats.mode, "requested_mode": args.mode,
                                  "segments": list(r.stats.segments), "token_ids": r.token_ids,
                                  "text": r.text, "finish_reason": r.finish_reason,
                                  "stats": dict(r.stats)}))
            else:
                for chunk in c.generate(args.prompt, **kw):
                    print(chunk.text, end="", flush=True)
                print()
                print(_stats_line(c.last_result.stats), file=sys.stderr)
    except (TandemError, ValueError) as e:   # ValueError: a CURVE key file that will not load
        code = getattr(e, "code", "bad_key")
        hint = {"unavailable": "`tandem status` shows which service is down",
                "deadline": "no answer in time: is the dispatcher running and healthy? "
                            "(`tandem status`)" if "no answer" in str(e) else "",
                "busy": "the dispatcher is at capacity; retry later"}.get(code, "")
        return _fail(args, code, getattr(e, "message", str(e)), hint, getattr(e, "field", ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="tandem", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from tandem import __version__
    ap.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start all services locally and stream a demo")
    up.add_argument("--detach", action="store_true", help="return after the demo")
    up.add_argument("--mode", default=os.environ.get("TANDEM_DEMO_MODE", "auto"),
                    help="demo mode: spec | split | cloud-only | auto")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    up.add_argument("--model", default="", help="a named model (`tandem models list`): "
                    "smollm2-135m (default) or gemma3-270m; prepared on first use")
    up.add_argument("--target", default="", help="your own target: a Hugging Face directory or "
                    "a GGUF (dequantised once into models/); docs/models.md")
    up.add_argument("--drafter", default="", help="the drafter GGUF for --target (must share its "
                    "tokenizer); for a GGUF target, default: a Q4_0 re-quantisation of it")
    up.add_argument("--replicas", default=os.environ.get("TANDEM_REPLICAS", ""),
                    help="processes per cloud service, e.g. verifier=2,suffix=2 (the dispatcher "
                         "places sessions across them by least outstanding work)")
    sub.add_parser("down", help="stop the services started by `up --detach`")
    st = sub.add_parser("status", help="health of the local services")
    st.add_argument("--json", action="store_true")
    # no -h of its own: `tandem serve SERVICE --help` is the service's, listing its settings
    sv = sub.add_parser("serve", help="run one service in the foreground", add_help=False)
    sv.add_argument("service", choices=(*SERVICE_NAMES, "api"))
    g = sub.add_parser("generate", help="one request through the SDK")
    g.add_argument("prompt")
    g.add_argument("--endpoint", default=os.environ.get("TANDEM_ENDPOINT", "tcp://127.0.0.1:5550"))
    g.add_argument("--curve-server-key", default=os.environ.get("TANDEM_CURVE_SERVER_KEY", ""),
                   help="the dispatcher's public key (NAME.key) when it runs CURVE")
    g.add_argument("--curve-client-key", default=os.environ.get("TANDEM_CURVE_CLIENT_KEY", ""),
                   help="this client's key pair (NAME.key_secret), allowlisted by the dispatcher")
    g.add_argument("--mode", default="auto", help="auto (the dispatcher chooses) | spec | split | "
                                                  "cloud-only")
    g.add_argument("--tpt-slo-ms", type=float, default=0.0,
                   help="auto: target time per token (ms); the least cloud work meeting it is "
                        "chosen (default: the dispatcher's, none = the fastest)")
    g.add_argument("--policy", default="", help="spec policy (default pipesd)")
    g.add_argument("--cut", type=int, default=0, help="split cut layer (0 = server default)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--sampling-coupling", choices=["gumbel", "rejection"], default=None,
                   help="gumbel: the same seed gives the same text in every mode and policy "
                        "(default: the dispatcher's setting)")
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--deadline", type=float, default=None, help="seconds")
    g.add_argument("--json", action="store_true",
                   help='print {"mode","requested_mode","segments","token_ids","text","stats"}')
    m = sub.add_parser("models", help="list, prepare, check or show models (docs/models.md)")
    m.add_argument("action", choices=["list", "prepare", "check", "show"])
    m.add_argument("name", nargs="?", default="", help="prepare: a named model (default "
                   "smollm2-135m), a GGUF to dequantise or an HF directory; check: the target")
    m.add_argument("--target", default="", help="check: an HF directory, a GGUF or a name")
    m.add_argument("--drafter", default="", help="check: a drafter GGUF (or a name)")
    m.add_argument("--json", action="store_true", help="machine-readable paths (and status)")
    sub.add_parser("link", help="WAN emulator (see `tandem link --help`)", add_help=False)
    sub.add_parser("bench", help="benchmarks (see `tandem bench --help`)", add_help=False)
    sub.add_parser("keys", help="CURVE key pairs (see `tandem keys --help`)", add_help=False)

    if argv and argv[:2] in (["serve", "-h"], ["serve", "--help"]):
        sv.print_help()
        return 0
    if argv and argv[0] in ("link", "bench", "keys"):
        module = {"link": "stack.wan_cli", "bench": "bench.cli", "keys": "stack.keys"}[argv[0]]
        return importlib.import_module(module).main(argv[1:]) or 0
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "serve":
        return cmd_serve(args, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "up":
        if args.mode == "auto":   # the dispatcher chooses, among what this install can run
            root = Path(__file__).resolve().parent.parent / "services" / "dispatcher"
            ready = ("drafter" in _available_services() and (root / "spec" / "mode.py").is_file()
                     and (args.drafter or not args.target or args.target.endswith(".gguf")))
            args.mode = "auto" if ready else "cloud-only"
        return cmd_up(args)
    return {"down": cmd_down, "status": cmd_status, "generate": cmd_generate,
            "models": cmd_models}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
