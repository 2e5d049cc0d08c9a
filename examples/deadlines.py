"""Deadlines and timeouts. `deadline_s` bounds one request end to end (the dispatcher enforces
it and answers DeadlineExceeded); `Client(timeout_s=...)` is the default deadline of every
request that names none. A client-side guard (deadline + 5 s) also catches a dispatcher that
never answers.

    python examples/deadlines.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import Client, DeadlineExceeded

with Client(ENDPOINT, timeout_s=60) as c:        # 60 s for any request without deadline_s
    r = c.complete("The sun rises in the", max_tokens=4, deadline_s=30)
    print(f"within the deadline: {r.text!r}")

    got = []
    try:
        # far too short for 64 tokens: the dispatcher gives up and says so
        for chunk in c.generate("Describe the history of Rome.", max_tokens=64, deadline_s=0.01):
            got += chunk.token_ids
    except DeadlineExceeded as e:
        print(f"DeadlineExceeded (code {e.code!r}) after {len(got)} streamed tokens: {e.message}")
    else:
        print("finished within 10 ms (a very fast machine)")
