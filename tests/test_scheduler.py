"""The engine's scheduler and page table alone: host bookkeeping, no device program."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from configs.models import tiny_qwen3
from fp8rl_jax.rollout.base import FinishReason
from fp8rl_jax.rollout.config import EngineConfig
from fp8rl_jax.rollout.pages import PageTable
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.rollout.scheduler import Scheduler, make_requests, prefill_bucket, row_arrays

EC = EngineConfig(max_slots=4, page_size=4, num_pages=12, max_seq_len=64, steps_per_call=2, prefill_batch=2,
                  prefill_buckets=(8, 16, 64), decode_buckets=(1, 2), dtype="float32")


def _make(prompts, sampling):
    return make_requests(prompts, sampling, tiny_qwen3, EC, EC.max_seq_len, EC.num_pages)


def _requests(lengths):
    return _make([list(range(2, 2 + n)) for n in lengths], SamplingConfig(temperature=0.0, max_tokens=6,
                                                                          ignore_eos=True))


def _check_pages(sched: Scheduler, num_pages: int) -> None:
    """Every page is free or held by exactly one occupied slot, and each slot's table row lists its pages."""
    held = [p for s, ps in enumerate(sched.pages.pages) for p in ps]
    assert sorted(held + sched.pages.free) == list(range(num_pages))
    for s, ps in enumerate(sched.pages.pages):
        assert sched.slots[s] is not None or not ps
        assert sched.pages.table[s, : len(ps)].tolist() == ps


def test_page_table_hands_out_lowest_first_and_reuses_freed_pages():
    t = PageTable(num_pages=5, slots=2, max_pages=3, page_size=4)
    assert t.ensure(0, 9) and t.pages[0] == [0, 1, 2]  # ceil(9 / 4) pages
    assert t.ensure(0, 100) and t.pages[0] == [0, 1, 2]  # capped at max_pages
    assert not t.ensure(1, 12) and t.pages[1] == [3, 4] and t.free == []
    t.release(0)
    assert t.ensure(1, 12) and t.pages[1] == [3, 4, 0]
    t.move(1, 0)
    assert t.pages == [[3, 4, 0], []] and t.table[0].tolist() == [3, 4, 0]


def test_requests_are_validated_before_anything_runs():
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        _make([[3], []], SamplingConfig(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _make([[tiny_qwen3.vocab_size]], SamplingConfig(max_tokens=4))
    with pytest.raises(ValueError, match="needs up to 51 KV slots but the pool holds 48"):
        _make([[3] * 9], SamplingConfig(max_tokens=40))
    eos = _make([[3]], SamplingConfig(max_tokens=4, stop_token_ids=(7, 5)))[0]
    assert eos.stop_ids == tuple(sorted({5, 7, *tiny_qwen3.eos_token_ids}))


def test_row_arrays_pad_empty_rows_and_stop_ids():
    reqs = _requests([3, 5])
    reqs[1].stop_ids = tuple(range(9))
    reqs[1].generated = [4, 4]
    sampling, stops, remaining = row_arrays([reqs[0], None, reqs[1]])
    assert stops.shape == (3, 16) and stops[1].tolist() == [-1] * 16 and stops[2, :9].tolist() == list(range(9))
    assert remaining.tolist() == [6, 0, 4]
    assert np.asarray(sampling.temperature).tolist() == [0.0, 0.0, 0.0]
    assert prefill_bucket(9, EC.prefill_buckets) == 16 and prefill_bucket(65, EC.prefill_buckets) == 65


def test_admission_preemption_and_compaction():
    """Admission stops at the first request whose pages do not fit; preemption takes the newest request
    (which goes back to the queue's front with a new epoch); compaction moves the running requests into the
    lowest slots so that the decode call runs the smallest bucket holding them."""
    reqs = _requests([9, 6, 11, 3])
    sched = Scheduler(reqs, EC, EC.max_seq_len, EC.num_pages, max_pages=16)
    admitted = sched.admit()  # pages: ceil(11/4)=3, 2, ceil(13/4)=4, ceil(5/4)=2: 11 of 12
    assert [(s, r.index) for s, r in admitted] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    _check_pages(sched, EC.num_pages)
    batch = sched.prefill_batch([0, 1])
    assert batch.tokens.shape == (2, 16) and batch.num_new.tolist() == [9, 6] and batch.slot_ids.tolist() == [0, 1]
    sched.update_from_prefill(batch, np.array([5, 6]), np.array([-0.5, -0.25]), np.array([0, 0]), None)
    assert reqs[0].generated == [5] and sched.lengths[:2].tolist() == [9, 6]
    sched.update_from_prefill(sched.prefill_batch([2, 3]), np.array([7, 8]), np.zeros(2), np.array([0, 2]), None)
    assert reqs[3].finish is FinishReason.LENGTH
    sched.release_finished()
    assert sched.slots[3] is None and sched.admitted == [0, 1, 2]
    victims = []
    sched.reserve(8, lambda r, pages, tokens: victims.append((r.index, list(pages), tokens)))
    # slot 0 grows to min(9 + 8, 17) tokens: 5 pages; slot 1 to 14: 4 pages; with slot 2's 4 that is 13 of 12,
    # so slot 2 (the newest) goes, with its 11 cached tokens, and its pages serve slot 1
    assert victims == [(2, [5, 6, 7, 8], 11)]
    assert sched.queue[0] is reqs[2] and reqs[2].epoch == 1 and sched.preemptions == 1
    assert [len(p) for p in sched.pages.pages] == [5, 4, 0, 0]
    _check_pages(sched, EC.num_pages)
    assert sched.compact() == 0  # slots 0 and 1 already in bucket 2
    reqs[0].finish = FinishReason.STOP
    sched.release_finished()
    assert sched.decode_batch(None).rows == 2  # slot 1 is occupied
    assert sched.compact() == 1 and sched.slots[0] is reqs[1] and sched.admitted == [0]
    _check_pages(sched, EC.num_pages)
    batch = sched.decode_batch(None)
    assert batch.rows == 1 and batch.running == 1 and batch.lengths[0] == 6 and not batch.continues.any()


def test_decode_batch_continues_only_unpreempted_requests():
    """A request that ran in the previous (unread) call continues from its device state at the row it ran
    in, even after a move; a request preempted since does not, and that call's tokens do not reach it."""
    ec = dataclasses.replace(EC, num_pages=40)
    reqs = make_requests([[2, 3, 4]] * 3, SamplingConfig(temperature=0.0, max_tokens=6, ignore_eos=True),
                         tiny_qwen3, ec, ec.max_seq_len, ec.num_pages)
    sched = Scheduler(reqs, ec, ec.max_seq_len, ec.num_pages, max_pages=16)
    sched.admit()
    for s in (0, 1, 2):
        sched.update_from_prefill(sched.prefill_batch([s]), np.array([9]), np.zeros(1), np.array([0]), None)
    first = sched.decode_batch(None)
    assert first.rows == 4 and first.context == 9 and not first.moved
    reqs[2].epoch += 1  # preempted and readmitted since `first` was dispatched
    second = sched.decode_batch(first)
    assert second.src.tolist() == [0, 1, -1, -1] and not second.moved and second.context == 9 + 2 * 2
    toks = np.arange(4 * ec.steps_per_call).reshape(4, ec.steps_per_call)
    sched.update_from_decode(first, toks, np.zeros(toks.shape), np.zeros(toks.shape, np.int32), None)
    assert reqs[0].generated == [9, 0, 1] and reqs[1].generated == [9, 2, 3] and reqs[2].generated == [9]
    assert sched.lengths[:3].tolist() == [5, 5, 3]
    reqs[0].finish = FinishReason.STOP
    sched.release_finished()
    assert sched.compact() == 1 and sched.slots[0] is reqs[2]  # two running: bucket 2
    third = sched.decode_batch(second)
    assert third.src.tolist() == [2, 1, -1, -1] and third.moved and third.rows == 2
