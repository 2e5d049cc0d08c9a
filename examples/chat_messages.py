"""A conversation through the target's chat template (`messages=`), each stream with its own
result, and the client's retry setting.

    python examples/chat_messages.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import Client

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "Name another one."},
]

with Client(ENDPOINT, max_retries=3) as c:     # busy / unavailable before a token: 3 retries
    stream = c.generate(messages=CONVERSATION, max_tokens=16)
    for chunk in stream:
        print(chunk.text, end="", flush=True)
    print()
    r = stream.result                          # this stream's own Result
    print(f"{r.finish_reason}: {r.stats.prompt_tokens} prompt tokens (after the chat template), "
          f"{len(r.token_ids)} generated, sent {stream.attempts} time(s)")

    # two streams at once (both requests in flight after their first chunk): each keeps its
    # own result, where c.last_result would only hold whichever finished last
    a = c.generate(messages=[{"role": "user", "content": "Say yes."}], max_tokens=4)
    b = c.generate(messages=[{"role": "user", "content": "Say no."}], max_tokens=4)
    next(a, None), next(b, None)
    list(a), list(b)
    print(repr(a.result.text), repr(b.result.text))
