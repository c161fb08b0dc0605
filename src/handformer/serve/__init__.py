"""Serving many requests at once: continuous batching over a paged KV cache.

* ``blocks`` — the block manager: fixed-size KV blocks from one pool, a table per request.
* ``paged`` — the pool's tensors and the cache one forward call reads them through.
* ``request`` / ``scheduler`` — a request's state; who runs in the next step (admission,
  chunked prefill, preemption).
* ``engine`` — runs the model on the plan and samples, in a thread of its own.
* ``process`` — that engine in a process of its own, and the server's handle on it: a pipe
  for requests and outputs, so the HTTP side never shares the engine's GIL.
* ``detokenize`` / ``metrics`` — text released to clients; what ``/metrics`` shows.
* ``protocol`` / ``asgi`` / ``app`` — the OpenAI-compatible HTTP API (FastAPI): request
  bodies, the ASGI plumbing (errors, guard, event streams), the routes — apart from the engine.
"""
