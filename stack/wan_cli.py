"""`tandem link ...`: run the WAN emulator on one tcp:// link, or steer a running one.

    tandem link --listen 127.0.0.1:7000 --target 127.0.0.1:5555 --scenario s1 \\
                [--up-latency-ms 40] [--down-bandwidth-mbit 100] [--control 127.0.0.1:7100]
    tandem link set --control 127.0.0.1:7100 --direction up --latency-ms 100
    tandem link partition --control 127.0.0.1:7100 --seconds 3 [--mode cut]
    tandem link drop --control 127.0.0.1:7100
    tandem link state --control 127.0.0.1:7100
    tandem link scenarios

Point the service that dials out at --listen instead of its peer's address; the peer keeps its
bind. The run command serves until Ctrl-C (or SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import urllib.error
import urllib.request

from stack.wan import DIRECTIONS, JITTER_DISTS, PARTITION_MODES, SCENARIOS, LinkShape, \
    WanControl, WanProxy

CLIENT_COMMANDS = ("set", "partition", "drop", "state", "scenarios")

# LinkShape settings a command line may give (the actions have their own commands)
_SHAPE_TYPES = {"latency_ms": float, "jitter_ms": float, "jitter_dist": str,
                "bandwidth_mbit": float, "burst_bytes": int, "alpha_ms": float}


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _add_shape_flags(parser: argparse.ArgumentParser, prefix: str, what: str):
    for name, kind in _SHAPE_TYPES.items():
        flag = "--" + (prefix + name).replace("_", "-")
        extra = {"choices": JITTER_DISTS} if name == "jitter_dist" else {}
        parser.add_argument(flag, dest=prefix + name, type=kind, default=None,
                            help=f"{what} {name}", **extra)


def _shape_fields(args: argparse.Namespace, prefix: str) -> dict:
    return {name: getattr(args, prefix + name) for name in _SHAPE_TYPES
            if getattr(args, prefix + name) is not None}


# ------------------------------------------------------------------------------------ run

def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem link", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept on")
    p.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward to")
    p.add_argument("--scenario", type=str.lower, choices=sorted(SCENARIOS), default=None,
                   help="named link shape (flags below override it)")
    p.add_argument("--partition-mode", choices=PARTITION_MODES, default="hold",
                   help="hold: queue bytes through a partition; cut: close and refuse connections")
    p.add_argument("--control", type=_address, default=None,
                   help="HOST:PORT for the HTTP/JSON control API (loopback)")
    p.add_argument("--seed", type=int, default=None, help="seed of the jitter's random stream")
    for d in DIRECTIONS:
        _add_shape_flags(p, d + "_", d)
    return p


async def _serve(args: argparse.Namespace) -> int:
    scenario = SCENARIOS[args.scenario] if args.scenario else None
    shapes = {}
    for d in DIRECTIONS:
        base = getattr(scenario, d) if scenario else LinkShape()
        shapes[d] = dataclasses.replace(base, **_shape_fields(args, d + "_"))
    proxy = WanProxy(*args.listen, *args.target, shapes["up"], shapes["down"],
                     partition_mode=args.partition_mode, seed=args.seed)
    await proxy.start()
    control = await WanControl(proxy, *args.control).start() if args.control else None
    if scenario and scenario.schedule:
        proxy.play(scenario.schedule)
    print(f"tandem link {proxy.listen_host}:{proxy.port} -> {args.target[0]}:{args.target[1]}"
          f" scenario={args.scenario or 'none'}"
          f" control={f'{control.host}:{control.port}' if control else 'off'}", flush=True)
    for d in DIRECTIONS:
        print(f"  {d}: {json.dumps(getattr(proxy, d).state())}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if control:
            await control.stop()
        await proxy.stop()
        print(f"tandem link stopped: {json.dumps(proxy.stats())}", flush=True)
    return 0


def _run(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    try:
        import uvloop
        return uvloop.run(_serve(args))
    except ImportError:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


# --------------------------------------------------------------------------------- client

def _client_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"tandem link {command}")
    if command == "scenarios":
        return p
    p.add_argument("--control", type=_address, required=True, help="HOST:PORT of the control API")
    if command == "set":
        p.add_argument("--direction", choices=DIRECTIONS + ("both",), default="both")
        _add_shape_flags(p, "", "new")
    elif command == "partition":
        p.add_argument("--seconds", type=float, required=True, help="how long no bytes flow")
        p.add_argument("--mode", choices=PARTITION_MODES, default=None,
                       help="override the proxy's partition mode for this partition")
    return p


def request(control: tuple[str, int], method: str, path: str, body: dict | None = None,
            timeout: float = 5.0) -> tuple[int, dict]:
    """One call to a WanControl API: (HTTP status, JSON answer)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{control[0]}:{control[1]}{path}", data=data,
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _client(command: str, argv: list[str]) -> int:
    args = _client_parser(command).parse_args(argv)
    if command == "scenarios":
        for name, sc in SCENARIOS.items():
            print(f"{name}: {sc.note}")
        return 0
    if command == "set":
        fields = _shape_fields(args, "")
        if not fields:
            print("tandem link set: give at least one field to change", file=sys.stderr)
            return 2
        call = ("POST", "/set", {"direction": args.direction, **fields})
    elif command == "partition":
        call = ("POST", "/partition", {"seconds": args.seconds, "mode": args.mode})
    elif command == "drop":
        call = ("POST", "/drop", {})
    else:
        call = ("GET", "/state", None)
    try:
        status, answer = request(args.control, *call)
    except OSError as e:
        print(f"tandem link {command}: cannot reach {args.control[0]}:{args.control[1]}: {e}",
              file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0 if status == 200 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point for `tandem link ...`; argv excludes the words `tandem link`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in CLIENT_COMMANDS:
        return _client(argv[0], argv[1:])
    return _run(argv)


if __name__ == "__main__":
    sys.exit(main())
