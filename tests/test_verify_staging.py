"""The verification graphs' host staging (`VerifyGraphs.stage`): a step's token ids, positions, KV
slots, context lengths, state slots and block tables packed into the persistent host buffer,
padded to the captured size, against values computed here per request; and the one upload that
carries an MTP step's other host ints (`to_device_many`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lamina.sampling_params import SamplingParams
from lamina.step_plan import ScheduledChunk
from lamina.worker.verify_graphs import VerifyGraphs

BLOCK = 4
QUERIES = 3


class _NoStateModel:
    def state_modules(self):
        return []


def _graphs(max_batch: int = 8) -> VerifyGraphs:
    return VerifyGraphs(_NoStateModel(), device=torch.device("cpu"), max_batch=max_batch, num_speculative_tokens=2,
                        block_size=BLOCK, max_blocks_per_seq=6, spare_state_slot=77)


def _chunk(i: int, start: int, blocks: list[int]) -> ScheduledChunk:
    return ScheduledChunk(f"r{i}", [10 * i + q for q in range(QUERIES)], start, blocks, state_slot=i + 3, sample=True,
                          sampling_params=SamplingParams(), num_output_tokens=1, num_draft_tokens=QUERIES - 1)


def test_stage_packs_each_request_and_pads_the_rest():
    graphs = _graphs()
    # ragged contexts: a step inside one block, one across a boundary, a fresh request (no state)
    chunks = [_chunk(0, 5, [9, 4]), _chunk(1, 3, [2, 8]), _chunk(2, 0, [5]), _chunk(3, 10, [1, 6, 11, 12])]
    graphs.stage(chunks, QUERIES, size=6)
    host = graphs.host_np
    rows = 6 * QUERIES
    tokens = graphs._token_field(host, "token_ids", rows).reshape(6, QUERIES)
    positions = graphs._token_field(host, "positions", rows).reshape(6, QUERIES)
    slots = graphs._token_field(host, "slot_mapping", rows).reshape(6, QUERIES)
    tables = graphs._tables(host, 6)
    for row, c in enumerate(chunks):
        assert tokens[row].tolist() == c.token_ids
        pos = list(range(c.start_position, c.start_position + QUERIES))
        assert positions[row].tolist() == pos
        assert slots[row].tolist() == [c.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        assert tables[row, : len(c.block_table)].tolist() == c.block_table
    assert graphs._request_field(host, "seq_lens", 6).tolist() == [8, 6, 3, 13, QUERIES, QUERIES]
    assert graphs._request_field(host, "state_slots", 6).tolist() == [3, 4, 5, 6, -1, -1]
    assert graphs._request_field(host, "keep", 6).tolist() == [1, 1, 0, 1, 0, 0]
    assert (slots[4:] == -1).all() and (tokens[4:] == 0).all() and (tables[4:] == 0).all()  # padding: no KV write


def test_stage_after_a_larger_step_leaves_no_stale_rows():
    graphs = _graphs()
    graphs.stage([_chunk(i, 4 + i, [i + 1, i + 9, i + 17]) for i in range(6)], QUERIES, size=8)
    graphs.stage([_chunk(0, 1, [3])], QUERIES, size=2)
    host = graphs.host_np
    assert graphs._request_field(host, "state_slots", 2).tolist() == [3, -1]
    assert graphs._token_field(host, "slot_mapping", 2 * QUERIES).tolist() == [13, 14, 15, -1, -1, -1]


def test_stage_refuses_a_position_past_the_request_blocks():
    graphs = _graphs()
    with pytest.raises(RuntimeError, match=r"request 'r1': position 6 lies past its 1 KV blocks of 4"):
        graphs.stage([_chunk(0, 0, [1]), _chunk(1, 4, [2])], QUERIES, size=2)


def test_stage_refuses_a_request_of_another_length():
    ragged = _chunk(1, 4, [2, 3])
    ragged.token_ids = ragged.token_ids[:2]
    with pytest.raises(ValueError, match=r"request 'r1': 2 tokens in a step of 3 a request"):
        _graphs().stage([_chunk(0, 0, [1]), ragged], QUERIES, size=2)


def test_to_device_many_gives_aligned_views_of_one_upload():
    from lamina.host_to_device import to_device_many

    lists = ([3, 1, 4], [], [1, 5], [9, 2, 6, 5, 3])
    tensors = to_device_many("cpu", *lists)
    assert [t.tolist() for t in tensors] == [list(v) for v in lists]
    assert all(t.dtype == torch.long for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one upload
    assert all(t.storage_offset() % 2 == 0 for t in tensors)  # each starts 16 bytes aligned
