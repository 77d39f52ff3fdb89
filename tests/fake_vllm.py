"""A stand-in for the ``vllm`` package, for CPU tests of ``VLLMGenerator``'s wiring (which calls
reach vLLM, in which order, with which settings), never of vLLM itself (the GPU test runs the real
one). ``install(monkeypatch)`` puts it in ``sys.modules`` and replaces the torch-only helpers.

The model it "loads" has the parameter names ``vllm_names.vllm_table`` gives for the folder's
config (so ``VLLMGenerator``'s name check passes only if the table is complete) and an attention
module per layer holding K/V scales. ``generate`` answers with tokens derived from the prompt and
the current weights' version (so a test sees an update take effect) and records the K/V scales
it ran with.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np

__version__ = "0.26.0"


class _Scale:
    def __init__(self) -> None:
        self.v = 1.0  # vLLM's default when the checkpoint has no KV scales

    def fill_(self, x: float) -> None:
        self.v = float(x)

    def reshape(self, *_: Any) -> list[float]:
        return [self.v]


class _Attention:
    def __init__(self) -> None:
        self._k_scale, self._v_scale = _Scale(), _Scale()
        self._k_scale_cpu, self._v_scale_cpu = _Scale(), _Scale()
        self.calculate_kv_scales = False


class _Model:
    def __init__(self, names: list[str], num_layers: int) -> None:
        self.names = names
        self.attn = [_Attention() for _ in range(num_layers)]

    def named_parameters(self):
        return [(n, None) for n in self.names]

    def named_modules(self):
        return [(f"model.layers.{i}.self_attn.attn", a) for i, a in enumerate(self.attn)]


class Logprob:
    def __init__(self, logprob: float) -> None:
        self.logprob = logprob


class SamplingParams:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class LLM:
    instances: list["LLM"] = []

    def __init__(self, **kw: Any) -> None:
        from fp8rl_jax.checkpoint import load_config
        from fp8rl_jax.rollout.vllm_names import abstract_quantized_params, vllm_table

        self.kwargs = kw
        config, raw = load_config(kw["model"])
        quantized = "quantization_config" in raw
        params = abstract_quantized_params(config, None) if not quantized else abstract_quantized_params(config)
        self.model = _Model([t.name for t in vllm_table(config, params)], config.num_layers)
        self.version = 0  # weight updates so far
        self.calls: list[tuple] = []
        self.asleep = False
        LLM.instances.append(self)

    def apply_model(self, fn):
        return [fn(self.model)]

    def collective_rpc(self, method: str, kwargs: dict | None = None):
        if method == "reload_weights":
            names = [n for n, _ in kwargs["weights_iterator"]]
            self.version += 1
            self.calls.append(("reload", len(names)))
        return [None]

    def sleep(self, level: int) -> None:
        self.asleep = True
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep = False
        self.calls.append(("wake", tuple(tags or ())))

    def generate(self, prompts: list[dict], params: list[SamplingParams], use_tqdm: bool = False):
        assert not self.asleep, "generate while asleep"
        scales = [(a._k_scale.v, a._v_scale.v) for a in self.model.attn]
        self.calls.append(("generate", len(prompts), scales))
        outs = []
        for p, sp in zip(prompts, params):
            ids = p["prompt_token_ids"]
            toks = [(sum(ids) + 7 * self.version + j) % 50 + 3 for j in range(sp.max_tokens)]
            c = types.SimpleNamespace(token_ids=toks, logprobs=[{t: Logprob(-1.0)} for t in toks],
                                      finish_reason="length")
            outs.append(types.SimpleNamespace(outputs=[c]))
        return outs


def install(monkeypatch) -> types.ModuleType:
    """This module as ``vllm`` (0.26.0); DLPack views and torch synchronization become no-ops."""
    from fp8rl_jax.rollout import vllm_backend as vb

    module = sys.modules[__name__]
    LLM.instances.clear()
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(vb, "to_torch_tensor", lambda a: np.asarray(a))
    monkeypatch.setattr(vb, "_torch_synchronize", lambda: None)
    for key in vb.REQUIRED_ENV:
        monkeypatch.setenv(key, vb.REQUIRED_ENV[key])  # unset again after the test
    return module
