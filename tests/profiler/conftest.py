"""Shared fixture: each zoo model traced once per test session (tracing is the slow part)."""
from __future__ import annotations

import pytest

from autopar.tracer import trace
from tests.profiler.zoo import DYNAMIC, SEQ, load_example

_TRACES: dict[str, object] = {}


@pytest.fixture(scope="session")
def traced_zoo():
    def get(name: str):
        if name not in _TRACES:
            seq = 16 if "seq" in DYNAMIC[name] else SEQ  # a static sequence length is the one the tests run
            model, sample = load_example(name).build(2, seq, size="tiny", device="meta")
            _TRACES[name] = trace(model, sample, dynamic_dims=DYNAMIC[name])
        return _TRACES[name]

    return get
