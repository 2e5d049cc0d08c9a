"""Errors are typed (tandem.errors), each with the wire's stable `code` and the server's
`message`: InvalidRequest, Busy, DeadlineExceeded, Cancelled, Unavailable, ServerError — all
subclasses of TandemError. Busy and Unavailable before the first token are retried by the
client itself (exponential backoff with jitter, `max_retries=2` by default, as openai-python);
what reaches the caller has already been retried.

    python examples/error_handling.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import (Busy, Client, DeadlineExceeded, InvalidRequest, TandemError,
                    Unavailable)

with Client(ENDPOINT) as c:
    for bad in (dict(max_tokens=0), dict(mode="telepathy"), dict(top_p=0.0)):
        try:
            c.complete("Hello", **bad)
        except InvalidRequest as e:            # malformed or out of range: fix the request
            print(f"{bad}: InvalidRequest code={e.code!r}: {e.message}")

    try:
        c.complete("Hello", max_tokens=4)
    except Busy:                               # still over capacity after the retries
        print("busy, retry later")
    except Unavailable as e:                   # a service the mode needs is down
        print(f"unavailable: {e.message}")
    except TandemError as e:                   # anything else from the server
        print(f"failed: {e}")
    else:
        print("a good request succeeds")

# Nothing listens here: the request cannot be sent, and the client says so after
# connect_timeout_s (default 10 s) with Unavailable ("no dispatcher reachable at ..."); without
# max_retries=0 it would first try twice more, 0.5 s and 1 s apart.
with Client("tcp://127.0.0.1:9", connect_timeout_s=1, max_retries=0) as dead:
    try:
        dead.complete("Hello", max_tokens=4)
    except Unavailable as e:
        print(f"dispatcher down: {e.message}")

# A request that outlives its deadline ends with DeadlineExceeded (tokens streamed so far stay).
with Client(ENDPOINT) as c:
    try:
        c.complete("Hello", max_tokens=2000, stop_at_eos=False, deadline_s=0.5)
    except DeadlineExceeded as e:
        print(f"deadline: {e.message}")
