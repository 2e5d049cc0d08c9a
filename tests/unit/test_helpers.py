"""The helpers in tests/conftest.py, so that the tests built on them fail when they should.

compare_tokens, the comparison every losslessness test goes through, against a fake reference
model whose greedy output is known: it fails where it should (a wrong token that is no tie, a
short or empty output, a wrong token after a tie) and passes a near-tie only by checking on,
against the reference regenerated from the system's own prefix. need_tool: a missing tool fails
under CI=true and skips locally, with the install hint either way."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import NEAR_TIE, compare_tokens, need_tool

V = 16
TIE_AFTER = (1, 2, 3)      # after this context the top two logits (5 and 6) are within 1e-6


def logits_after(ids) -> torch.Tensor:
    """A deterministic toy model: the next token is (last + 1) mod V, except after TIE_AFTER,
    where 5 and 6 are (nearly) tied; after a 6 it continues from 6 like anywhere else."""
    x = torch.zeros(V)
    if tuple(ids[-3:]) == TIE_AFTER:
        x[5], x[6] = 10.0, 10.0 - 1e-6
    else:
        x[(ids[-1] + 1) % V] = 10.0
        x[(ids[-1] + 2) % V] = 9.0      # a clear second: margin 1, no tie
    return x


def regenerate(ids, k: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(k):
        t = int(logits_after(ids).argmax())
        ids.append(t)
        out.append(t)
    return out


def check(got, want, **kw) -> list[str]:
    ties: list[str] = []
    compare_tokens([0, 1, 2], got, want, "toy", logits_after=logits_after, regenerate=regenerate,
                   ties=ties, **kw)
    return ties


PROMPT = [0, 1, 2]
WANT = regenerate(PROMPT, 6)           # 3, then the tie (5), then 6, 7, 8, 9


def test_the_toy_reference():
    assert WANT == [3, 5, 6, 7, 8, 9]


def test_equal_output_passes():
    assert check(WANT, WANT) == []


@pytest.mark.parametrize("got", [[], WANT[:3], WANT + [10]])
def test_a_short_empty_or_long_output_fails(got):
    with pytest.raises(AssertionError, match="tokens vs reference"):
        check(got, WANT)


def test_a_wrong_token_that_is_no_tie_fails():
    with pytest.raises(AssertionError, match="no tie"):
        check([3, 5, 6, 9, 8, 9], WANT)


def test_after_a_near_tie_the_comparison_goes_on_from_the_systems_prefix():
    # the system took 6 at the tie: its own continuation from there is 7, 8, 9, 10
    got = [3, 6] + regenerate(PROMPT + [3, 6], 4)
    assert got == [3, 6, 7, 8, 9, 10]
    ties = check(got, WANT)
    assert len(ties) == 1 and "near-tie at token 1" in ties[0]


def test_a_wrong_token_after_a_near_tie_still_fails():
    with pytest.raises(AssertionError, match="token 4 differs"):
        check([3, 6, 7, 8, 12, 10], WANT)
    with pytest.raises(AssertionError, match="tokens vs reference"):
        check([3, 6, 7], WANT)        # stopping early after the tie is caught too


def test_the_tie_is_judged_by_the_systems_token_not_the_runner_up():
    """Only a token within NEAR_TIE of the top counts; 0 is far below it after the tie context."""
    assert float(logits_after(PROMPT + [3]).max() - logits_after(PROMPT + [3])[0]) >= NEAR_TIE
    with pytest.raises(AssertionError, match="no tie"):
        check([3, 0, 1, 2, 3, 4], WANT)


def test_the_requested_length_bounds_the_regenerated_reference():
    # a 5-token request: after the tie the regenerated reference is 5 tokens long in all
    assert len(check([3, 6, 7, 8, 9], WANT[:5], n=5)) == 1
    with pytest.raises(AssertionError, match="tokens vs reference"):
        check([3, 6, 7, 8, 9, 10], WANT[:5], n=5)


def test_a_tie_onto_eos_ends_the_reference_there():
    """With EOS stopping (eos_id), a system that tied into EOS stops there, as the reference
    regenerated from that prefix would."""
    assert len(check([3, 6], WANT, eos_id=6)) == 1
    with pytest.raises(AssertionError, match="tokens vs reference"):
        check([3, 6, 7], WANT, eos_id=6)


# ------------------------------------------------------------------- a missing tool under CI

@pytest.mark.parametrize("ci,outcome", [("true", pytest.fail.Exception),
                                        ("", pytest.skip.Exception),
                                        ("false", pytest.skip.Exception)])
def test_a_missing_tool_fails_under_ci_and_skips_locally(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"frobnicator not installed \(apt-get install frobnicator\)"):
        need_tool("frobnicator", "apt-get install frobnicator")
