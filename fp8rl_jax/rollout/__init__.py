"""Rollout: the generator interface and the built-in JAX engine (paged KV, continuous batching).

The engine (``engine.JaxEngine``) is a facade over its parts: ``scheduler`` (requests, slots,
preemption, decode buckets; host only), ``pages`` (the host page table), ``kv_pool`` (the device KV
pool, sleep/wake, swap space), ``weights`` (weight updates: check, fuse, quantize, reshard) and
``programs`` (the jitted prefill/decode programs and the ``ModelRunner`` that calls them). On several
devices ``replicas.EngineReplicas`` runs one engine per device group as one generator.
"""
