"""NaN, infinite, zero and negative budgets, time limits and mesh sizes are refused, naming the value, by
`parallelize` (before anything else runs: no process group is needed to hear it) and by the CLI."""
from __future__ import annotations

import math

import pytest
import torch

from tests.codegen.harness import Classifier

import autopar
from autopar.cli import main
from autopar.errors import AutoparError, InvalidValueError
from tests.cli.plans import EXAMPLES


@pytest.mark.parametrize("kwargs, named", [
    ({"memory_budget": math.nan}, "memory_budget=nan"),
    ({"memory_budget": -1.0}, "memory_budget=-1.0"),
    ({"memory_budget": 0}, "memory_budget=0"),
    ({"memory_budget": math.inf}, "memory_budget=inf"),
    ({"time_limit_s": 0.0}, "time_limit_s=0.0"),
    ({"time_limit_s": math.nan}, "time_limit_s=nan"),
    ({"time_limit_s": -5}, "time_limit_s=-5"),
    ({"call_timeout_s": math.inf}, "call_timeout_s=inf"),
    ({"device_mesh": (2, 0)}, "device_mesh=(2, 0)"),
    ({"device_mesh": (-2, -1)}, "device_mesh=(-2, -1)"),
    ({"device_mesh": (2.0,)}, "device_mesh=(2.0,)"),
])
def test_values_out_of_range_are_refused_naming_them(kwargs, named):
    """Refused before anything else runs (no process group is needed to hear it)."""
    args = {"device_mesh": (2,), **kwargs}
    with pytest.raises(InvalidValueError) as refused:
        autopar.parallelize(Classifier(), (torch.randn(4, 8), torch.zeros(4, dtype=torch.long)), **args)
    assert str(refused.value).startswith(named)
    assert isinstance(refused.value, AutoparError) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize("argv, named", [
    (["--memory", "nan"], "cannot read 'nan' as a memory size"),
    (["--memory", "1e400"], "memory size '1e400' is not a finite number"),
    (["--memory", "-5GB"], "cannot read '-5GB' as a memory size"),
    (["--memory", "0"], "memory size '0' must be positive"),
    (["--time-limit", "nan"], "--time-limit=nan must be a finite number above zero"),
    (["--time-limit", "-3"], "--time-limit=-3.0 must be a finite number above zero"),
    (["--time-limit", "inf"], "--time-limit=inf must be a finite number above zero"),
    (["--gpus", "0"], "argument --gpus: 0 must be at least 1"),
    (["--mesh", "2x0"], "mesh shape '2x0' needs positive sizes"),
])
def test_the_cli_refuses_values_out_of_range_naming_them(capsys, argv, named):
    option, value = argv
    code = main(["plan", str(EXAMPLES / "mlp.py"), "--gpus", "2", f"{option}={value}"])
    assert code == 2
    assert named in capsys.readouterr().err
