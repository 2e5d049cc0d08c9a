"""API keys without a cluster: loading and checking them (api/auth.py), the repeatable
`--api-key`, the gateway's 401 answers (Starlette's test client, no dispatcher), and the
dispatcher side of "a key is a client" (common/security.client_id with an end client)."""

from __future__ import annotations

import pytest
import zmq
from starlette.testclient import TestClient

from api import auth
from api.app import create_app
from api.config import ApiConfig
from api.service import merge_repeated
from common import protocol, security
from common.protocol import ProtocolError

KEY_A, KEY_B, KEY_C = "sk-alpha-0123456789", "sk-bravo-0123456789", "sk-charlie-0123456789"


def test_load_keys_from_setting_and_file(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text(f"# team keys\n{KEY_C}\n\n  {KEY_A}  \n")
    assert auth.load_keys(f"{KEY_A},{KEY_B}", str(f)) == [KEY_A, KEY_B, KEY_C]
    assert auth.load_keys("", "") == []
    with pytest.raises(auth.KeysError, match="too easy"):
        auth.load_keys("short", "")
    with pytest.raises(auth.KeysError, match="line 2"):
        (tmp_path / "bad.txt").write_text(f"{KEY_A}\nhas space inside\n")
        auth.load_keys("", str(tmp_path / "bad.txt"))
    with pytest.raises(auth.KeysError, match="holds no key"):
        (tmp_path / "empty.txt").write_text("# nothing\n")
        auth.load_keys("", str(tmp_path / "empty.txt"))
    with pytest.raises(auth.KeysError, match="missing.txt"):
        auth.load_keys("", str(tmp_path / "missing.txt"))


def test_identity_matches_only_the_exact_key():
    keys = auth.Keys([KEY_A, KEY_B])
    assert keys.enabled and not auth.Keys([]).enabled
    assert keys.identity(f"Bearer {KEY_A}") == auth.fingerprint(KEY_A)
    assert keys.identity(f"bearer {KEY_B}") == auth.fingerprint(KEY_B)
    assert auth.fingerprint(KEY_A) != auth.fingerprint(KEY_B)
    assert KEY_A not in auth.fingerprint(KEY_A)
    for bad in (None, "", KEY_A, f"Basic {KEY_A}", f"Bearer {KEY_A[:-1]}", f"Bearer {KEY_A}x",
                "Bearer ", f"Bearer {KEY_C}", "Bearer \udcff"):
        assert keys.identity(bad) is None, bad


def test_api_key_flag_repeats():
    assert merge_repeated(["--port", "1", "--api-key", "a", "--api-key=b"], "--api-key") == \
        ["--port", "1", "--api-key", "a,b"]
    assert merge_repeated(["--port", "1"], "--api-key") == ["--port", "1"]
    for bad in (["--api-key", ""], ["--api-key"], ["--api-key=", "--api-key", "x"]):
        with pytest.raises(SystemExit, match="needs a key"):
            merge_repeated(bad, "--api-key")


def test_gateway_answers_401_in_openai_shape_and_leaves_health_open(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text(KEY_C + "\n")
    # no lifespan: the gateway is not started (no model, no dispatcher), which is enough to see
    # that the key is checked before anything else
    app = create_app(ApiConfig(api_key=KEY_A, api_keys_file=str(f)))
    client = TestClient(app)   # not as a context manager: the lifespan (start) does not run
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")):
        r = client.request(method, path, json={"model": "tandem", "prompt": "a"})
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        err = r.json()["error"]
        assert err["code"] == "missing_api_key" and err["type"] == "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"}
        r = client.request(method, path, json={}, headers={"Authorization": "Bearer sk-wrong-1234"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "sk-wrong" not in r.text   # the key is never echoed
    for path in ("/healthz", "/metrics"):
        assert client.get(path).status_code == 200, path
    assert client.get("/readyz").status_code in (200, 503)   # open: answers, no 401
    # a valid key passes the check (the gateway is not started: 503, not 401)
    for key in (KEY_A, KEY_C):
        r = client.post("/v1/completions", json={}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503, r.text


def test_bad_keys_setting_fails_at_start():
    with pytest.raises(auth.KeysError):
        create_app(ApiConfig(api_key="abc"))


def _frames(user: str | None):
    """A received message's frames; with `user`, as ZMQ gives them over CURVE (the first
    frame's User-Id is the sender's public key)."""
    f = zmq.Frame(b"x")
    if user is None:
        return [f]

    class Authenticated(zmq.Frame):
        def get(self, name):
            return user if name == "User-Id" else super().get(name)
    return [Authenticated(b"x")]


def test_client_id_end_clients_plaintext_and_curve():
    ident = b"\x01\x02"
    assert security.client_id(ident, _frames(None)) == "id:0102"
    # plaintext: any sender may split itself into end clients, each counted apart
    assert security.client_id(ident, _frames(None), "apikey-1") == "id:0102/apikey-1"
    # CURVE: only a key in client_delegates may name end clients
    gw = "G" * 40
    assert security.client_id(ident, _frames(gw)) == f"key:{gw}"
    assert security.client_id(ident, _frames(gw), "apikey-1", frozenset({gw})) == \
        f"key:{gw}/apikey-1"
    with pytest.raises(ProtocolError) as e:
        security.client_id(ident, _frames("H" * 40), "apikey-1", frozenset({gw}))
    assert e.value.code == protocol.BAD_FIELD and e.value.field == "client"


def test_load_delegates_reads_public_keys(tmp_path):
    pub, _ = security.create_keys(tmp_path, "gateway")
    assert security.load_delegates(f" {pub} ,") == {security.public_key_z85(pub)}
    assert security.load_delegates("") == frozenset()


def test_quota_counts_each_end_client_apart():
    q = security.ClientQuota(max_sessions=1)
    q.admit("id:01/apikey-a", 10)
    q.admit("id:01/apikey-b", 10)
    with pytest.raises(ProtocolError) as e:
        q.admit("id:01/apikey-a", 10)
    assert e.value.code == protocol.BUSY
