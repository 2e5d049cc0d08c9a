"""Asynchronous client: stream with `async for`, and run several requests concurrently on one
client (the dispatcher batches their forward passes).

    python examples/async_client.py [tcp://127.0.0.1:5550]
"""

import asyncio

from _endpoint import ENDPOINT

from tandem import AsyncClient


async def main() -> None:
    async with AsyncClient(ENDPOINT) as c:
        async for chunk in c.generate("Once upon a time", max_tokens=8):
            print(chunk.text, end="", flush=True)
        print()

        prompts = ["1, 2, 3,", "Monday, Tuesday,", "red, green,"]
        results = await asyncio.gather(*(c.complete(p, max_tokens=6) for p in prompts))
        for p, r in zip(prompts, results):
            print(f"{p!r} -> {r.text!r}  ({r.stats.generated_tokens} tokens, "
                  f"{r.stats.duration_s:.2f} s)")


asyncio.run(main())
