"""End clients over CURVE (the API gateway's per-key limits when the gateway reaches the
dispatcher over an authenticated link): a real dispatcher with CURVE, a per-client limit of one
request in flight, and no cloud (a cloud-only request is admitted, then holds its slot while it
waits for a verifier that never comes, until its deadline).

* the gateway's key, listed in `--client-delegates`, may name end clients: each end client has
  its own limit (a second request of end client A is busy while B is admitted);
* another allowlisted key naming an end client is refused (`bad_field`, field `client`): it
  could otherwise escape its own limit by inventing names;
* without an end client, a key is one client as before.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from stack.launcher import Cluster, free_port
from tandem import AsyncClient, Busy, DeadlineExceeded, InvalidRequest, Unavailable


def _keys(*args) -> None:
    subprocess.run([sys.executable, "-m", "stack.cli", "keys", *args], check=True,
                   capture_output=True, text=True, timeout=60)


def test_end_clients_over_curve_only_from_delegates(model_paths, tmp_path):
    d = tmp_path / "keys"
    _keys("create", "dispatcher", "gateway", "app", "--dir", str(d), "--allow", "gateway", "app")
    dead = f"tcp://127.0.0.1:{free_port()}"
    c = Cluster(services=("dispatcher",), ephemeral=True, logdir=tmp_path / "logs",
                extra={"dispatcher": [
                    "--curve-secret-key", d / "dispatcher.key_secret",
                    "--curve-allow-dir", d / "allowed", "--client-delegates", d / "gateway.key",
                    "--client-max-sessions", "1", "--verifier", dead, "--drafter", dead,
                    "--prefix", dead, "--suffix", dead]})

    def client(name: str) -> AsyncClient:
        return AsyncClient(c.endpoint("dispatcher"), curve_server_key=d / "dispatcher.key",
                           curve_client_key=d / f"{name}.key_secret", max_retries=0)

    async def outcome(cl: AsyncClient, **kw) -> str:
        try:
            await cl.complete("hi", max_tokens=2, **kw)
        except Busy:
            return "busy"
        except InvalidRequest as e:
            return f"invalid:{e.field}"
        except (DeadlineExceeded, Unavailable):
            return "admitted"    # it got in, then waited for the absent verifier
        return "served?"

    async def body():
        async with client("gateway") as gw, client("app") as app:
            # end client A holds its one slot (waiting for the verifier, until its deadline)
            hold = asyncio.ensure_future(outcome(gw, end_client="apikey-a", deadline_s=4))
            await asyncio.sleep(1.0)
            second_a = await outcome(gw, end_client="apikey-a", deadline_s=1)
            other_b = await outcome(gw, end_client="apikey-b", deadline_s=1)
            named_by_app = await outcome(app, end_client="apikey-a", deadline_s=1)
            app_itself = await outcome(app, deadline_s=1)
            return await hold, second_a, other_b, named_by_app, app_itself

    c.start_all()
    try:
        c.wait_ready(timeout=240)
        got = asyncio.run(body())
    finally:
        c.stop_all()
    assert got == ("admitted", "busy", "admitted", "invalid:client", "admitted"), got


def test_client_delegates_must_be_public_key_files(model_paths, tmp_path):
    r = subprocess.run([sys.executable, "-m", "services.dispatcher.service",
                        "--bind", "tcp://127.0.0.1:0", "--http-port", "0",
                        "--client-delegates", str(tmp_path / "missing.key")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "client_delegates" in r.stderr and "missing.key" in r.stderr
    assert "Traceback" not in r.stderr       # a configuration error, said in one line


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
