"""The report tests' plans (`plans.make_plans`), made once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.report.plans import make_plans


@pytest.fixture(scope="session")
def plans(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("report_plans")
    make_plans(d)
    return d
