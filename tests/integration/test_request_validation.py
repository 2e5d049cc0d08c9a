"""Every bad field of a GenerateRequest — the mode-specific ones (split `cut`, spec `policy`)
included — is refused before admission: InvalidRequest (bad_field), and the request is not
counted in tandem_requests_total (no outcome="error"), so dashboards' error rates count failed
requests, not malformed ones. A dispatcher alone suffices: nothing is admitted."""

from __future__ import annotations

import re
import urllib.request

import pytest

from stack.launcher import Cluster
from tandem import Client, InvalidRequest


@pytest.fixture(scope="module")
def dispatcher(model_paths, tmp_path_factory):
    c = Cluster(services=("dispatcher",), ephemeral=True,
                logdir=tmp_path_factory.mktemp("validation-logs"))
    c.start_all()
    try:
        c.wait_ready(timeout=120)
        yield c.procs["dispatcher"]
    finally:
        c.stop_all()


def requests_total(proc) -> float:
    text = urllib.request.urlopen(proc.url("/metrics"), timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^tandem_requests_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.parametrize("bad, match, field", [
    (dict(mode="split", cut=99), r"cut 99 outside \[1, 29\]", "cut"),
    (dict(mode="split", cut=30), r"cut 30 outside", "cut"),
    (dict(mode="spec", policy="nope"), r"unknown spec policy 'nope'", "policy"),
    (dict(mode="spec", policy="oracle-trigger", temperature=0.7),
     r"oracle-trigger policy needs greedy", "temperature"),
    (dict(mode="teleport"), r"unknown mode 'teleport'", "mode"),
    (dict(mode="cloud-only", max_tokens=0), r"max_tokens: expected `int` >= 1",   # the SDK's
     "max_tokens"),
    (dict(mode="cloud-only", max_tokens=10**6), r"max_tokens must be in \[1, ",   # the server's
     "max_tokens"),
])
def test_bad_fields_are_refused_before_admission(dispatcher, bad, match, field):
    before = requests_total(dispatcher)
    with Client(dispatcher.endpoint, timeout_s=20) as c:
        with pytest.raises(InvalidRequest, match=match) as e:
            c.complete("hello", **{"max_tokens": 2, **bad})
    assert e.value.code == "bad_field"
    assert e.value.field == field, e.value        # the argument to blame, by its SDK name
    assert requests_total(dispatcher) == before
