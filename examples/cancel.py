"""Cancelling a request: stop iterating (break), close the stream explicitly, or cancel the
asyncio task. Each sends a Cancel to the dispatcher, which stops generating at once and frees
the request's slots; the client stays usable.

    python examples/cancel.py [tcp://127.0.0.1:5550]
"""

import asyncio

from _endpoint import ENDPOINT

from tandem import AsyncClient, Client

with Client(ENDPOINT) as c:
    # 1. break out of the loop: the generator is closed, the request cancelled
    got = []
    for chunk in c.generate("Write a long story about a lighthouse keeper.", max_tokens=200,
                            stop_at_eos=False):
        got += chunk.token_ids
        if len(got) >= 3:
            break
    print(f"break after {len(got)} tokens")

    # 2. keep the stream object and close it explicitly (from anywhere in your code)
    stream = c.generate("List every prime number.", max_tokens=200, stop_at_eos=False)
    first = next(stream)
    stream.close()                 # cancels on the server
    print(f"closed after the first chunk: {first.text!r}")

    # the client is still fine
    print("still usable:", repr(c.complete("Hello", max_tokens=3).text))


async def cancel_task() -> None:
    async with AsyncClient(ENDPOINT) as c:
        # 3. cancel the task that awaits the request (or: `await stream.aclose()`)
        task = asyncio.create_task(c.complete("Tell me everything about the sea.", max_tokens=200,
                                               stop_at_eos=False))
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            print("asyncio task cancelled; the request was cancelled on the server")
        r = await c.complete("Hello", max_tokens=3)
        print("still usable:", repr(r.text))


asyncio.run(cancel_task())
