"""A *side* is one implementation timed in the benchmark: a ktfp8 backend or a peer.

Every side is built for one layer's weights, a thread count and a largest token count, and is then
called as side(x, topk_ids, topk_weights) -> y with x bfloat16 [T, hidden] (the activation dtype
every side accepts), ids int64 and weights float32 [T, top_k]; y is any float array [T, hidden]."""


class PeerUnavailable(Exception):
    """This side cannot be installed, imported or run here; str(exc) says why (printed, not fatal)."""
