"""The verifier's admission by queued prompt work (services/verifier/service.queue_wait_s): a
new session is refused `busy` when the prompt work ahead of it, and its own, would take longer
than max_queue_s at the measured prefill rate — so an admitted session is not left silent for
the dispatcher's stall timer behind a queue it cannot pass."""

from services.verifier.service import queue_wait_s


def test_a_queue_over_the_limit_refuses_with_the_wait_ahead():
    assert queue_wait_s(queued=9000, prompt=1000, rate=1000.0, max_s=5.0) == 9.0
    assert queue_wait_s(queued=3000, prompt=2500, rate=1000.0, max_s=5.0) == 3.0


def test_within_the_limit_an_empty_queue_or_no_rate_yet_admits():
    assert queue_wait_s(queued=3000, prompt=1000, rate=1000.0, max_s=5.0) is None
    assert queue_wait_s(queued=0, prompt=100_000, rate=1000.0, max_s=5.0) is None   # alone
    assert queue_wait_s(queued=100_000, prompt=1000, rate=0.0, max_s=5.0) is None   # unmeasured
