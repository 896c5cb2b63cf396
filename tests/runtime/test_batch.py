"""The plan-independent input convention: contiguous dim-0 slices in rank order, a clear error when uneven."""
from __future__ import annotations

import pytest
import torch

from autopar.runtime.batch import BatchError, batch_slice, fed_spec
from autopar.solver.spec import Spec


def test_slices_are_contiguous_rows_in_rank_order_and_cover_the_batch():
    ids = torch.arange(8 * 3).view(8, 3)
    batch = {"input_ids": ids, "labels": ids + 100, "scale": torch.tensor(2.0), "table": torch.zeros(5, 3), "flag": True}
    parts = [batch_slice(batch, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    assert torch.equal(parts[1]["labels"], ids[2:4] + 100)
    # not batched (no dim 0, or dim 0 is not the batch): fed whole on every rank
    assert all(p["scale"] is batch["scale"] and p["table"] is batch["table"] and p["flag"] for p in parts)


def test_fed_spec_is_the_batch_dim_split_on_every_mesh_axis():
    assert fed_spec(0, 2) == Spec.parse("S(0)S(0)")
    assert fed_spec(1, 2) == Spec.parse("S(1)S(1)")
    assert fed_spec(None, 2) == Spec.parse("RR")


def test_uneven_batch_names_sizes_and_fix():
    with pytest.raises(BatchError, match=r"batch size 6 .* world size 4.*divisible by 4 .*input_layout='replicate'"):
        batch_slice(torch.zeros(6, 2), 0, 4)
