"""The engine's scheduler: requests, slots, admission, preemption, compaction, decode buckets.

Pure host bookkeeping (no device work), one `Scheduler` per generate. The engine asks it what to run
(`admit`, `prefill_batch`, `reserve`, `compact`, `decode_batch`), runs it on the device and hands the
outputs back (`update_from_prefill`, `update_from_decode`), as vLLM's ``schedule()`` /
``update_from_output()`` split. The host is the single source of truth for what each slot holds.

- Admission: the queue's head takes the lowest free slot when its context and one decode chunk fit
  in free pages. A request coming back from swap preemption resumes decoding; the others are
  prefilled (in groups of ``prefill_batch``).
- Preemption: before each decode call every running slot holds pages for the tokens the coming
  chunk (and the one in flight) may add; when the pool runs out, the most recently admitted request
  is preempted: its pages are freed (after the engine may have copied them to host memory) and it
  goes back to the front of the queue. Its ``epoch`` moves, so a chunk in flight for it is ignored.
- Compaction and decode buckets: a decode call runs the smallest of ``EngineConfig.decode_rows``
  that holds every occupied slot; when the running requests fit a smaller bucket, those above it
  move down into free slots (the KV stays in its pages).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from fp8rl_jax.models import ModelConfig
from fp8rl_jax.rollout.base import FinishReason
from fp8rl_jax.rollout.config import EngineConfig
from fp8rl_jax.rollout.pages import PageTable
from fp8rl_jax.rollout.sampling import SamplingConfig, SlotSampling, truncates

FINISH_CODES = {1: FinishReason.STOP, 2: FinishReason.LENGTH, 3: FinishReason.MAX_LEN}  # the programs' codes
NO_STOP = -1  # padding of a row's stop ids


@dataclasses.dataclass
class Request:
    """One prompt being generated for, and what it has produced so far.

    Attributes:
      index: its position in the generate call (the output row).
      prompt: prompt token ids.
      sampling: its sampling settings.
      stop_ids: tokens that finish it (its stop tokens, and EOS unless ``ignore_eos``), sorted.
      generated, logprobs: sampled tokens and their logprobs so far.
      finish: why it finished (None while running).
      routing: MoE routing records, ``[n, L_moe, k]`` chunks in position order.
      routed: positions recorded so far (``0 .. routed - 1``).
      epoch: preemptions so far: a decode chunk dispatched before one has no say on this request.
      swapped: while preempted with swap, the engine's host copy of its KV and the tokens it holds.
    """

    index: int
    prompt: list[int]
    sampling: SamplingConfig
    stop_ids: tuple[int, ...]
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)
    routed: int = 0
    epoch: int = 0
    swapped: tuple | None = None

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    def append(self, tok: int, lp: float, code: int) -> None:
        """One sampled token with its logprob and finish code (0: not finished)."""
        self.generated.append(tok)
        self.logprobs.append(lp)
        if code:
            self.finish = FINISH_CODES[code]


def most_kv(prompt_len: int, max_tokens: int, max_seq_len: int, steps_per_call: int) -> int:
    """The KV slots a request may ever need: its whole sequence plus one decode chunk's overshoot."""
    return min(prompt_len + max_tokens, max_seq_len) + steps_per_call


def make_requests(prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                  model_config: ModelConfig, config: EngineConfig, max_seq_len: int, num_pages: int
                  ) -> list[Request]:
    """The requests of a generate call, checked: a ``ValueError`` names the first bad one (empty prompt,
    ids outside the vocabulary, a prompt or budget that cannot fit, a sampling that is not a
    `SamplingConfig`) before anything runs."""
    if isinstance(sampling, SamplingConfig):
        sampling = [sampling] * len(prompts)
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} sampling configs for {len(prompts)} prompts")
    V = model_config.vocab_size
    capacity = num_pages * config.page_size
    eos = tuple(model_config.eos_token_ids)
    requests = []
    for i, (prompt, s) in enumerate(zip(prompts, sampling)):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"request {i}: the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {V})")
        if len(prompt) >= max_seq_len:
            raise ValueError(f"request {i}: prompt of {len(prompt)} tokens leaves no room under "
                             f"max_seq_len {max_seq_len}")
        if not isinstance(s, SamplingConfig):
            raise ValueError(f"request {i}: sampling must be a SamplingConfig, got {type(s).__name__}")
        need = most_kv(len(prompt), s.max_tokens, max_seq_len, config.steps_per_call)
        if need > capacity:
            raise ValueError(f"request {i}: needs up to {need} KV slots but the pool holds {capacity} "
                             f"({num_pages} pages of {config.page_size})")
        stops = tuple(sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos))))
        requests.append(Request(i, prompt, s, stops))
    return requests


def row_arrays(reqs: Sequence[Request | None]) -> tuple[SlotSampling, np.ndarray, np.ndarray]:
    """A device call's per-row inputs: sampling settings, stop ids ``[rows, W]`` (padded with ``NO_STOP``,
    W a power of two >= 8: few distinct shapes, few compilations) and tokens left ``[rows]``; empty rows
    (None) are greedy with no stop id and no budget."""
    default = SamplingConfig(temperature=0.0)
    sampling = SlotSampling.from_configs([r.sampling if r is not None else default for r in reqs])
    most = max([len(r.stop_ids) for r in reqs if r is not None] + [1])
    width = max(8, 1 << (most - 1).bit_length())
    stops = np.full((len(reqs), width), NO_STOP, np.int32)
    remaining = np.zeros((len(reqs),), np.int32)
    for i, r in enumerate(reqs):
        if r is not None:
            stops[i, : len(r.stop_ids)] = r.stop_ids
            remaining[i] = r.sampling.max_tokens - len(r.generated)
    return sampling, stops, remaining


def any_truncates(reqs: Sequence[Request | None], vocab_size: int) -> bool:
    """Whether any request of a call truncates its draw (top-k / top-p): the programs compile this in
    (`fp8rl_jax.rollout.sampling.sample`'s ``truncation``) rather than branching on the device, where a
    conditional would hold the host's dispatch until the GPU reaches it, every decode step."""
    return any(r is not None and truncates(r.sampling, vocab_size) for r in reqs)


def prefill_bucket(n: int, buckets: Sequence[int]) -> int:
    """The padded length of a prefill of ``n`` tokens: the first bucket that holds it, else ``n``."""
    for b in buckets:
        if b >= n:
            return b
    return n


@dataclasses.dataclass
class PrefillBatch:
    """One prefill call: ``len(reqs)`` prompts (contexts, after a preemption) padded to ``prefill_batch``
    rows of a length bucket. ``slot_ids`` of padding rows are out of range (``max_slots``)."""

    slots: list[int]
    reqs: list[Request]
    slot_ids: np.ndarray  # [P] int32
    tokens: np.ndarray  # [P, T] int32
    num_new: np.ndarray  # [P] int32


@dataclasses.dataclass
class DecodeBatch:
    """One decode call over every slot, as the scheduler saw them when it was made.

    Attributes:
      reqs: per slot, its request (None: empty).
      epochs: the requests' preemption epochs at this call (0 for empty slots).
      last, active: per slot, the host's last token and whether it runs ([B] int32, bool).
      lengths, page_table: the scheduler's arrays (views: place them before the next scheduling step).
      src: per slot, the row of the previous call (still in flight) its request continues from, or -1:
        the device state of that call then replaces the host's (`fp8rl_jax.rollout.programs.continue_rows_jit`).
      rows: the decode bucket the call runs (``EngineConfig.decode_rows``).
      context: KV tokens the running rows read at the call's first step (the host's lengths lag a
        continuing row by the chunk in flight, counted as ``steps_per_call``).
    """

    reqs: list[Request | None]
    epochs: list[int]
    last: np.ndarray
    active: np.ndarray
    lengths: np.ndarray
    page_table: np.ndarray
    src: np.ndarray
    rows: int
    context: int

    @property
    def running(self) -> int:
        return int(self.active.sum())

    @property
    def continues(self) -> np.ndarray:
        """[B] bool: the slots that continue from the previous call's device state."""
        return self.src >= 0

    @property
    def moved(self) -> bool:
        """Whether a continuing request changed slots since the previous call (compaction)."""
        cont = self.continues
        return bool(cont.any()) and not (self.src == np.arange(len(self.reqs)))[cont].all()


class Scheduler:
    """Slots, pages and the queue of one generate (module note)."""

    def __init__(self, requests: Sequence[Request], config: EngineConfig, max_seq_len: int, num_pages: int,
                 max_pages: int):
        self.config = config
        self.max_seq_len = max_seq_len
        B = config.max_slots
        self.queue = collections.deque(requests)
        self.slots: list[Request | None] = [None] * B
        self.pages = PageTable(num_pages, B, max_pages, config.page_size)
        self.lengths = np.zeros((B,), np.int32)  # tokens in the cache per slot, as of the calls the host has read
        self.admitted: list[int] = []  # occupied slots, oldest admission first
        self.preemptions = 0
        self.routing_mismatches = 0

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def busy(self) -> bool:
        """Whether requests are waiting or running."""
        return bool(self.queue) or self.running > 0

    def release(self, slot: int) -> None:
        self.pages.release(slot)
        self.slots[slot] = None
        self.lengths[slot] = 0
        if slot in self.admitted:
            self.admitted.remove(slot)

    def release_finished(self) -> None:
        for slot, r in enumerate(self.slots):
            if r is not None and r.finish is not None:
                self.release(slot)

    def admit(self) -> list[tuple[int, Request]]:
        """Moves queued requests into free slots while their context and a decode chunk fit in free
        pages; returns ``(slot, request)`` in admission order. A swapped-out request's slot length is set
        to its cached tokens (the engine copies them back); the others are to be prefilled."""
        admitted = []
        while self.queue and None in self.slots:
            r = self.queue[0]
            slot = self.slots.index(None)
            if not self.pages.ensure(slot, len(r.prompt) + len(r.generated) + self.config.steps_per_call):
                self.release(slot)
                break
            self.queue.popleft()
            self.slots[slot] = r
            self.admitted.append(slot)
            if r.swapped is not None:
                self.lengths[slot] = r.swapped[1]
            admitted.append((slot, r))
        return admitted

    def prefill_batch(self, slots: Sequence[int]) -> PrefillBatch:
        """The prefill call of requests just admitted to ``slots`` (at most ``prefill_batch``), each at its
        whole context, padded to the context's length bucket."""
        P = self.config.prefill_batch
        reqs = [self.slots[s] for s in slots]
        ctx = [r.context for r in reqs]
        T = prefill_bucket(max(len(c) for c in ctx), self.config.prefill_buckets)
        tokens = np.zeros((P, T), np.int32)
        num_new = np.zeros((P,), np.int32)
        slot_ids = np.full((P,), self.config.max_slots, np.int32)
        for i, (s, c) in enumerate(zip(slots, ctx)):
            tokens[i, : len(c)] = c
            num_new[i] = len(c)
            slot_ids[i] = s
            self.lengths[s] = 0
        return PrefillBatch(list(slots), reqs, slot_ids, tokens, num_new)

    def update_from_prefill(self, batch: PrefillBatch, tok: np.ndarray, lp: np.ndarray, code: np.ndarray,
                            routing: np.ndarray | None) -> None:
        """A prefill's sampled token, logprob, finish code and (``record_routing``) experts per row."""
        for i, (s, r) in enumerate(zip(batch.slots, batch.reqs)):
            self.lengths[s] = batch.num_new[i]
            if routing is not None:
                self._record_prefill(r, routing[i, : batch.num_new[i]])
            r.append(int(tok[i]), float(lp[i]), int(code[i]))

    def _record_prefill(self, r: Request, experts: np.ndarray) -> None:
        """Records the prefill's choices [len(context), L_moe, k] for the positions not yet recorded;
        on a recompute, counts the already-recorded positions where it chose differently (the first
        recording is kept: it is what the logprobs sampled before the preemption saw)."""
        if r.routed:
            first = np.concatenate(r.routing, axis=0)
            self.routing_mismatches += int(np.any(first != experts[: r.routed], axis=(1, 2)).sum())
        r.routing.append(experts[r.routed :])
        r.routed = experts.shape[0]

    def reserve(self, ahead: int, preempt: Callable[[Request, list[int], int], None]) -> None:
        """Gives every running slot pages for ``ahead`` more tokens (capped by what its request may ever
        need), preempting the most recently admitted request while the pool is short. ``preempt(request,
        page_ids, tokens)`` is called before a victim's pages are freed (swap-out copies them)."""
        for slot in range(self.config.max_slots):
            r = self.slots[slot]
            while self.slots[slot] is not None and not self.pages.ensure(
                    slot, min(int(self.lengths[slot]) + ahead,
                              most_kv(len(r.prompt), r.sampling.max_tokens, self.max_seq_len,
                                      self.config.steps_per_call))):
                victim = self.admitted[-1]
                out = self.slots[victim]
                preempt(out, self.pages.pages[victim], int(self.lengths[victim]))
                self.release(victim)
                out.epoch += 1  # the chunk in flight computed on for it: dropped, recomputed later
                self.queue.appendleft(out)
                self.preemptions += 1

    def compact(self) -> int:
        """Moves requests from slots at or past the decode bucket their number needs into free slots below
        it, so a decode call runs that bucket; returns the moves. A request with a chunk in flight
        continues from that chunk's device state at its new row (`DecodeBatch.src`)."""
        occupied = [s for s, r in enumerate(self.slots) if r is not None]
        R = next(b for b in self.config.decode_rows if b >= len(occupied))
        if not occupied or occupied[-1] < R:
            return 0
        holes = [s for s in range(R) if self.slots[s] is None]
        moves = 0
        for src in (s for s in occupied if s >= R):
            dst = holes.pop(0)
            self.slots[dst], self.slots[src] = self.slots[src], None
            self.pages.move(src, dst)
            self.lengths[dst], self.lengths[src] = self.lengths[src], 0
            self.admitted[self.admitted.index(src)] = dst
            moves += 1
        return moves

    def decode_batch(self, previous: DecodeBatch | None) -> DecodeBatch:
        """The next decode call over every slot. A slot whose request ran in ``previous`` (a call whose
        tokens are not read yet; same request, not preempted since) continues from the state that call
        leaves on the device; the others start from the host's view (just prefilled, or idle)."""
        reqs = list(self.slots)
        last = np.array([r.last_token if r is not None else 0 for r in reqs], np.int32)
        active = np.array([r is not None for r in reqs])
        was = {} if previous is None else {id(r): s for s, r in enumerate(previous.reqs) if r is not None}
        src = np.array([was.get(id(r), -1) if r is not None else -1 for r in reqs], np.int32)
        src = np.where([s >= 0 and previous.epochs[s] == r.epoch for s, r in zip(src, reqs)], src, -1)
        top = max((s + 1 for s, r in enumerate(reqs) if r is not None), default=1)
        rows = next(b for b in self.config.decode_rows if b >= top)
        context = int(self.lengths[active].sum()) + int((src >= 0).sum()) * self.config.steps_per_call
        return DecodeBatch(reqs, [r.epoch if r is not None else 0 for r in reqs], last, active, self.lengths,
                           self.pages.table, src, rows, context)

    def update_from_decode(self, batch: DecodeBatch, toks: np.ndarray, lps: np.ndarray, codes: np.ndarray,
                           routing: np.ndarray | None) -> None:
        """A decode call's tokens, logprobs and finish codes ([B, steps]) and (``record_routing``) the
        experts of each token it fed, into the requests still in a slot and not preempted since the call
        was made (a preempted one is recomputed from its context later, and its sampling keys make the
        same tokens)."""
        steps = self.config.steps_per_call
        where = {id(r): s for s, r in enumerate(self.slots) if r is not None}  # `compact` may have moved one
        for s in range(self.config.max_slots):
            r = batch.reqs[s]
            if r is None or id(r) not in where or r.epoch != batch.epochs[s] or r.finish is not None:
                continue
            done = np.flatnonzero(codes[s])
            n_new = int(done[0]) + 1 if done.size else steps
            if routing is not None:  # step j fed the last context token, position len(context) - 1
                assert r.routed == len(r.prompt) + len(r.generated) - 1, (r.index, r.routed)
                r.routing.append(routing[s, :n_new])
                r.routed += n_new
            r.generated.extend(toks[s, :n_new].tolist())
            r.logprobs.extend(lps[s, :n_new].tolist())
            if done.size:
                r.finish = FINISH_CODES[int(codes[s, done[0]])]
            self.lengths[where[id(r)]] += n_new
