"""Plans of Hugging Face's GPT-2 (Conv1D: weights stored in x out) and examples/gpt2.py (nn.Linear: out x in), tiny,
on a 2x2 CPU mesh, for the report tests: `make_plans(d)` writes into d NAME-dp.json (the solver's plan) and
NAME-tp.json (the same with every MLP weight split over tp as Megatron does: c_fc by its outputs, c_proj by its
inputs) for NAME in `MODELS`."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from autopar.api import capture_copy, capture_device_for
from autopar.model_file import load_model_file
from autopar.profiler import profile
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.solver.plan_io import save_plan
from autopar.solver import fixed_plan
from autopar.solver.spec import Replicate, Shard, Spec, Strategy
from autopar.tracer import trace
from tests.cli.plans import EXAMPLES

MODELS = ("hf_gpt2", "gpt2")
MLP_WIDTH = 4 * 64  # the examples' tiny GPT-2: n_embd 64


def _megatron_mlp(traced, plan) -> dict:
    """The plan's strategies with each MLP weight split over tp on its dim of the MLP's width: c_fc's outputs,
    c_proj's inputs, whichever way the weight is stored."""
    choices = {d.node: d.strategy for d in plan.nodes if d.op != "output"}
    for node, fqn in traced.param_fqns.items():
        if fqn.endswith(("mlp.c_fc.weight", "mlp.c_proj.weight")):
            width_dim = tuple(traced.node(node).meta["val"].shape).index(MLP_WIDTH)
            choices[node] = Strategy((), (Spec((Replicate(), Shard(width_dim))),))
    return choices


def make_plans(d: Path) -> None:
    mesh = make_mesh(4, (2, 2), "cpu")
    for name in MODELS:
        model, sample = load_model_file(EXAMPLES / f"{name}.py", 4, 16, size="tiny")
        traced = trace(*capture_copy(model, sample, capture_device_for("cpu")))  # as `autopar plan --hardware cpu` traces
        prof = profile(traced)
        dp = solve(traced, prof, mesh, memory_budget_bytes=mesh.memory_bytes, baselines=True)
        tp = fixed_plan(traced, prof, mesh, _megatron_mlp(traced, dp), memory_budget_bytes=mesh.memory_bytes)
        save_plan(dp, d / f"{name}-dp.json")
        # the same mesh and budget: the same textbook plans; no model file recorded, so explain prices nothing
        save_plan(replace(tp, baselines=dp.baselines, source=None), d / f"{name}-tp.json")
