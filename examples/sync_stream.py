"""Synchronous client: stream tokens as they arrive, then read the request's typed stats.

    python examples/sync_stream.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import Client

with Client(ENDPOINT) as c:
    # generate() yields Chunks: `token_ids`, `text` (their decoded text) and `index` (the
    # position of the first token in the output)
    for chunk in c.generate("The three primary colours are", max_tokens=12):
        print(chunk.text, end="", flush=True)
    print()

    r = c.last_result                  # the whole Result once the stream ended normally
    s = r.stats                        # tandem.Stats: typed fields ...
    print(f"{s.generated_tokens} tokens ({r.finish_reason}), mode {s.mode}, "
          f"TTFT {s.ttft_s * 1000:.0f} ms, {s.tpt_s * 1000:.0f} ms/token")
    print("tpt_s, dict-style:", s["tpt_s"])   # ... and a read-only mapping of the wire dict

    # complete() waits for the whole result instead of streaming
    r = c.complete("Paris is the capital of", max_tokens=4)
    print(repr(r.text), r.token_ids)
