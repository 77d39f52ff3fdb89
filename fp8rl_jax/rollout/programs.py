"""The engine's jitted device programs (prefill, multi-step decode) and the runner that calls them.

The programs are module-level, with the model config, policy and length limit static: engines with the
same settings share compilations (the RL loop, tests and benchmarks build several). `ModelRunner` holds
an engine's static settings and input placement; profilers and tests call the programs through it (or
lower them with ``**runner.static``) exactly as the engine does.

- Prefill (`prefill_jit`): ``prefill_batch`` rows padded to a length bucket, written into their slots'
  pages through a view of the cache restricted to those slots; samples each row's next token.
- Decode (`decode_jit`): ``steps`` steps in one ``lax.fori_loop`` (dispatch paid once per call, not per
  token) on the first ``rows`` slots only (a decode bucket): its GEMMs, lm_head and sampling cost
  ``rows`` rows. A finished or empty slot writes nothing. It also returns the slots' end state (last
  token, active, tokens left), from which the next call can start before the host has read this one's
  tokens (`continue_rows_jit` merges that state with the host's rows).
- Sampling keys depend only on (request seed, token position), so batch composition, preemption and
  buckets never change a row's tokens.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from fp8rl_jax.models import ModelConfig, PagedKVCache, forward
from fp8rl_jax.models.qwen3 import forward_with_routing, moe_layers
from fp8rl_jax.rollout.sampling import Draw, row_keys, sample
from fp8rl_jax.rollout.scheduler import Request, any_truncates, row_arrays


def finish_code(tok, stops, remaining, lengths, max_seq_len: int):
    """1 stop token, 2 max_tokens reached, 3 no room for another token, else 0 (`scheduler.FINISH_CODES`)."""
    is_stop = jnp.any(tok[:, None] == stops, axis=1)
    return jnp.where(is_stop, 1, jnp.where(remaining <= 1, 2, jnp.where(lengths + 1 >= max_seq_len, 3, 0)))


def _forward(params, tokens, *, model_config, policy, cache, num_new, record_routing, logits_at=None):
    """The cached forward; ``(logits, cache, experts or None)``."""
    kw = dict(config=model_config, policy=policy, cache=cache, num_new=num_new, logits_at=logits_at)
    if record_routing:
        return forward_with_routing(params, tokens, **kw)
    logits, cache = forward(params, tokens, **kw)
    return logits, cache, None


_STATIC = ("model_config", "policy", "max_seq_len", "record_routing", "draw", "truncation")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(1,))
def prefill_jit(params, cache, slot_ids, tokens, num_new, sampling, stops, remaining, *, model_config, policy,
                max_seq_len, record_routing=False, draw=Draw.INVERSE_CDF, truncation=None):
    """Prefills rows ``slot_ids`` (out of range for padding rows) and samples their next token:
    ``(tokens [P], logprobs [P], finish codes [P], cache, experts [P, T, L_moe, k] or None)``."""
    view = cache.replace(page_table=jnp.take(cache.page_table, slot_ids, axis=0, mode="clip"),
                         lengths=jnp.zeros_like(slot_ids))
    logits, view, experts = _forward(params, tokens, model_config=model_config, policy=policy, cache=view,
                                     num_new=num_new, record_routing=record_routing,
                                     logits_at=jnp.maximum(num_new - 1, 0))
    last = logits[:, 0]
    tok, lp = sample(last, sampling, row_keys(sampling.seed, num_new), draw, truncation)
    code = finish_code(tok, stops, remaining, num_new, max_seq_len)
    cache = cache.replace(k_pages=view.k_pages, v_pages=view.v_pages,
                          lengths=cache.lengths.at[slot_ids].set(view.lengths, mode="drop"))
    return tok, lp, code, cache, experts


@jax.jit
def continue_rows_jit(cont, device, host, src=None):
    """The rows' decode state (tuples of [B] arrays: last token, active, tokens left, cache length): where
    ``cont``, the state the call in flight leaves on the device (at its row ``src`` unless None: compaction
    moved requests), else the host's. One compiled program (as eager ops these were ~10 programs compiled at
    a generate's first continued call), which `JaxEngine.warmup` compiles."""
    take = (lambda x: x) if src is None else (lambda x: jnp.take(x, src, axis=0))  # noqa: E731
    return tuple(jnp.where(cont, take(d), h) for d, h in zip(device, host))


def decode_steps(params, cache, last, active, sampling, stops, remaining, *, steps, model_config, policy,
                 max_seq_len, record_routing=False, draw=Draw.INVERSE_CDF, truncation=None):
    """``steps`` decode steps for every slot; finished or empty slots write nothing. Returns tokens,
    logprobs and finish codes [B, steps], the cache, (``record_routing``) the experts of the token each
    step fed in [B, steps, L_moe, k], and the slots' state after the call (last token, active, tokens left)."""
    B = last.shape[0]

    def step(j, carry):
        cache, last, active, remaining, out_tok, out_lp, out_code, out_routing = carry
        logits, cache, experts = _forward(params, last[:, None], model_config=model_config, policy=policy,
                                          cache=cache, num_new=active.astype(jnp.int32),
                                          record_routing=record_routing)
        tok, lp = sample(logits[:, 0], sampling, row_keys(sampling.seed, cache.lengths), draw, truncation)
        code = jnp.where(active, finish_code(tok, stops, remaining, cache.lengths, max_seq_len), 0)
        if record_routing:
            out_routing = out_routing.at[:, j].set(experts[:, 0])
        return (cache, jnp.where(active, tok, last), active & (code == 0), remaining - active,
                out_tok.at[:, j].set(tok), out_lp.at[:, j].set(lp), out_code.at[:, j].set(code), out_routing)

    zeros = jnp.zeros((B, steps), jnp.int32)
    out_routing = None
    if record_routing:
        L, k = len(moe_layers(model_config)), model_config.num_experts_per_tok
        out_routing = jnp.full((B, steps, L, k), -1, jnp.int32)
    carry = (cache, last, active, remaining, zeros, jnp.zeros((B, steps), jnp.float32), zeros, out_routing)
    cache, last, active, remaining, out_tok, out_lp, out_code, out_routing = jax.lax.fori_loop(0, steps, step, carry)
    return out_tok, out_lp, out_code, cache, out_routing, (last, active, remaining)


def decode_rows(params, cache, last, active, sampling, stops, remaining, *, rows=None, **kw):
    """`decode_steps` on the first ``rows`` slots only (None: all), the others untouched: their outputs
    are empty (token 0, logprob 0, no finish code, routing -1) and their state is returned as given. The
    slots past ``rows`` must be idle (``active`` False): they are not computed."""
    B = last.shape[0]
    if rows is None or rows >= B:
        return decode_steps(params, cache, last, active, sampling, stops, remaining, **kw)
    head = lambda x: x[:rows]  # noqa: E731
    view = cache.replace(page_table=cache.page_table[:rows], lengths=cache.lengths[:rows])
    toks, lps, codes, view, routing, state = decode_steps(
        params, view, head(last), head(active), jax.tree.map(head, sampling), head(stops), head(remaining), **kw)

    def pad(x, fill):
        return jnp.concatenate([x, jnp.full((B - rows, *x.shape[1:]), fill, x.dtype)])

    cache = cache.replace(k_pages=view.k_pages, v_pages=view.v_pages,
                          lengths=jax.lax.dynamic_update_slice(cache.lengths, view.lengths, (0,)))
    state = tuple(jnp.concatenate([new, old[rows:]]) for new, old in zip(state, (last, active, remaining)))
    return (pad(toks, 0), pad(lps, 0.0), pad(codes, 0), cache, None if routing is None else pad(routing, -1),
            state)


_DECODE_JIT = dict(static_argnames=("steps", "rows", *_STATIC), donate_argnums=(1,))
# XLA:GPU's own split-K heuristic, as it runs by default.
decode_xla_split_k_jit = jax.jit(decode_rows, **_DECODE_JIT)
# The program the engine runs. XLA:GPU splits the K of a GEMM whose M x N tiles fill few SMs (at 256 decode rows
# the BF16 o_proj, down_proj and fused q/k/v) into a batched GEMM plus a float32 reduction kernel, a round trip of
# the partial sums through HBM; forbidding it lets cuBLAS pick its own split-K inside one call.
decode_jit = jax.jit(decode_rows, **_DECODE_JIT, compiler_options={"xla_gpu_experimental_force_split_k": 1})


def decode_program():
    """The jitted decode program the engine runs: `decode_jit`, or XLA's split-K heuristic
    (`decode_xla_split_k_jit`) when ``FP8RL_XLA_SPLIT_K=1`` is in the environment (an A/B switch)."""
    return decode_xla_split_k_jit if os.environ.get("FP8RL_XLA_SPLIT_K", "0") == "1" else decode_jit


def place(tree: Any, mesh: jax.sharding.Mesh | None, device: jax.Device | None = None) -> Any:
    """Host values (NumPy or jnp arrays, pytrees of them) as the programs take them: committed to ``device``
    (default: the first device), or replicated over ``mesh``. jit's cache keys on an argument's placement and commitment; the
    programs' outputs (the cache, swap copies back) are committed, so inputs placed the same way keep the
    first call's signature and each program compiles once."""
    if mesh is None:
        return jax.device_put(tree, device or jax.devices()[0])
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


class ModelRunner:
    """An engine's program settings and input placement: calls `prefill_jit`, `decode_program()` and
    `continue_rows_jit` as the engine does (`static` holds their static arguments; ``policy`` may be replaced,
    e.g. to compare kernels)."""

    def __init__(self, model_config: ModelConfig, policy: Any, max_seq_len: int, *, record_routing: bool,
                 draw: Draw, mesh: jax.sharding.Mesh | None = None, device: jax.Device | None = None):
        self.model_config = model_config
        self.policy = policy
        self.max_seq_len = max_seq_len
        self.record_routing = record_routing
        self.draw = draw
        self.mesh = mesh
        self.device = device

    @property
    def static(self) -> dict:
        """The programs' static keyword arguments (all but ``truncation``, ``steps`` and ``rows``)."""
        return dict(model_config=self.model_config, policy=self.policy, max_seq_len=self.max_seq_len,
                    record_routing=self.record_routing, draw=self.draw)

    def put(self, tree: Any) -> Any:
        """``tree`` placed as the programs take their inputs (`place`)."""
        return place(tree, self.mesh, self.device)

    def row_inputs(self, reqs: Sequence[Request | None]) -> tuple:
        """A call's per-row ``(sampling, stops, remaining)``, placed (`scheduler.row_arrays`)."""
        return self.put(row_arrays(reqs))

    def truncation(self, reqs: Sequence[Request | None]) -> bool:
        """The ``truncation`` a call over ``reqs`` compiles in (`scheduler.any_truncates`)."""
        return any_truncates(reqs, self.model_config.vocab_size)

    def prefill(self, params: Any, cache: PagedKVCache, slot_ids, tokens, num_new, sampling, stops, remaining, *,
                truncation: bool | None) -> tuple:
        """`prefill_jit` with this runner's settings (the cache is donated)."""
        return prefill_jit(params, cache, slot_ids, tokens, num_new, sampling, stops, remaining, truncation=truncation,
                           **self.static)

    def decode(self, params: Any, cache: PagedKVCache, last, active, sampling, stops, remaining, *, steps: int,
               truncation: bool | None, rows: int | None = None) -> tuple:
        """`decode_program()` with this runner's settings (the cache is donated)."""
        return decode_program()(params, cache, last, active, sampling, stops, remaining, steps=steps,
                                truncation=truncation, rows=rows, **self.static)
