"""Split mode (DySCo): the edge runs decoder layers [0, cut), the cloud the rest. `cut` picks
the layer per request (0 = the dispatcher's split_cut); the stats say where the time went.

    python examples/split_options.py [tcp://127.0.0.1:5550]
"""

from _endpoint import ENDPOINT

from tandem import Client

with Client(ENDPOINT) as c:
    for cut in (4, 20):
        r = c.complete("Water boils at", mode="split", cut=cut, max_tokens=6)
        s = r.stats
        print(f"cut {s.cut:2d}: {r.text!r}  edge {s.edge_forward_s * 1000:.0f} ms, "
              f"cloud {s.cloud_forward_s * 1000:.0f} ms, queue {s.cloud_queue_s * 1000:.0f} ms, "
              f"wire+overhead {s.wire_s * 1000:.0f} ms")
