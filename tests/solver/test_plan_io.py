"""Plan files: JSON round trip, format errors naming the field, fingerprint, mismatch check."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.errors import PlanFormatError, PlanMismatchError
from autopar.solver.plan import BaselineResult, MemoryBreakdown, PlanSource, TimeBreakdown
from autopar.solver.plan_io import check_plan, fingerprint, load_mesh, load_plan, mesh_to_json, plan_from_json, plan_to_json, save_plan
from autopar.solver.spec import Replicate, Shard, Spec, Strategy
from autopar.tracer import trace

from tests.cli.plans import hand_plan, two_axis_mesh


class TwoLinear(nn.Module):
    def __init__(self, head: bool = False, width: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(width, 16)
        self.fc2 = nn.Linear(16, width)
        self.lm_head = nn.Linear(width, 4, bias=False) if head else None

    def forward(self, x):
        y = self.fc2(torch.relu(self.fc1(x)))
        return (self.lm_head(y) if self.lm_head is not None else y).square().mean()


def _traced(head: bool = False, batch: int = 4, width: int = 8):
    with torch.device("meta"):
        return trace(TwoLinear(head, width), torch.randn(batch, width, device="meta"))


@pytest.fixture(scope="module")
def traced():
    return _traced()


@pytest.fixture(scope="module")
def plan(traced):
    p = hand_plan(traced, two_axis_mesh(), column=("fc1.weight", "fc1.bias"), zero=("fc2.weight",), recompute_module="fc1",
                  budget_bytes=40e9, source=PlanSource("examples/mlp.py", "", 2, None, "tiny", "adamw"))
    base = (BaselineResult("pure DP", TimeBreakdown(0.2, 0.1, 0.0, 0.05), MemoryBreakdown(2e9, 2e9, 4e9, 6e9, 0.0, 40e9), True),
            BaselineResult("Megatron TP+DP", None, None, False))
    # a node with a non-tensor input (None spec) must survive the trip too
    odd = replace(p.nodes[-2], strategy=Strategy((None, Spec((Shard(1), Replicate()))), p.nodes[-2].strategy.output_specs))
    return replace(p, baselines=base, nodes=p.nodes[:-2] + (odd,) + p.nodes[-1:])


def test_round_trip_is_equal(plan, tmp_path):
    assert plan_from_json(plan_to_json(plan)) == plan
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded == plan
    assert [p.zero for p in loaded.params] == [False, False, True, False]  # fc2.weight is the one ZeRO-stored
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["schema_version"] == 1
    assert raw["params"][0] == {"fqn": "fc1.weight", "node": raw["params"][0]["node"], "use": "RS(0)", "storage": "RS(0)", "layout": "out_in",
                                 "tier": "device"}


def test_host_tier_round_trips_and_older_files_load_on_the_device(plan):
    offloaded = replace(plan, params=tuple(replace(p, tier="host") for p in plan.params[:2]) + plan.params[2:],
                        memory=replace(plan.memory, host_params_bytes=1e9, host_grads_bytes=1e9, host_optimizer_bytes=2e9),
                        time=replace(plan.time, offload_s=0.5))
    loaded = plan_from_json(plan_to_json(offloaded))
    assert loaded == offloaded and loaded.offloaded() == ("fc1.weight", "fc1.bias")
    assert loaded.memory.host_bytes == 4e9 and loaded.time.total_s == pytest.approx(plan.time.total_s + 0.5)
    obj = json.loads(plan_to_json(offloaded))
    for p in obj["params"]:
        del p["tier"]
    for key in ("host_params_bytes", "host_grads_bytes", "host_optimizer_bytes"):
        del obj["memory"][key]
    del obj["time"]["offload_s"]
    old = plan_from_json(json.dumps(obj))
    assert old.offloaded() == () and old.memory.host_bytes == 0 and old.time == plan.time


def test_a_plan_saved_before_the_optimizer_step_was_priced_loads_with_none_of_it(plan):
    obj = json.loads(plan_to_json(plan))
    del obj["baselines"][0]["time"]["update_s"]
    assert plan_from_json(json.dumps(obj)).baselines[0].time == TimeBreakdown(0.2, 0.1, 0.0, 0.0)


def _corrupt(plan, edit) -> str:
    obj = json.loads(plan_to_json(plan))
    edit(obj)
    return json.dumps(obj)


@pytest.mark.parametrize("edit, message", [
    (lambda o: o["nodes"][3].pop("strategy"), "plan.json: missing field 'nodes[3].strategy'"),
    (lambda o: o["params"][0].update(use="S(0"), "plan.json: field 'params[0].use': cannot parse placement string 'S(0'"),
    (lambda o: o["mesh"]["axes"][1].update(size="two"), "plan.json: field 'mesh.axes[1].size' should be int, got \"two\""),
    (lambda o: o["memory"].update(params_bytes=True), "plan.json: field 'memory.params_bytes' should be int or float, got true"),
    (lambda o: o.update(schema_version=99), "plan.json: field 'schema_version' is 99, a version not supported"),
    (lambda o: o["params"][1].update(tier="disk"), "plan.json: field 'params[1].tier' should be one of 'device', 'host', got 'disk'"),
    (lambda o: o.pop("fingerprint"), "plan.json: missing field 'fingerprint'"),
])
def test_corrupt_plan_names_the_field(plan, edit, message):
    with pytest.raises(PlanFormatError) as info:
        plan_from_json(_corrupt(plan, edit), source="plan.json")
    assert str(info.value).startswith(message)


def test_not_json_and_missing_file(tmp_path):
    with pytest.raises(PlanFormatError, match=r"plan.json: not valid JSON \(Expecting value at line 1, column 1\)"):
        plan_from_json("garbage", source="plan.json")
    with pytest.raises(PlanFormatError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


def test_loading_never_executes_code(plan, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    text = _corrupt(plan, lambda o: o["nodes"][0].update(op=payload, module=payload))
    loaded = plan_from_json(text)
    assert loaded.nodes[0].op == payload and not marker.exists()


def test_fingerprint_parts(traced):
    mesh = two_axis_mesh()
    fp = fingerprint(traced, mesh, 40e9)
    assert fp == fingerprint(_traced(), mesh, 40e9)  # deterministic across traces
    assert fp.param_shapes == (("fc1.weight", (16, 8)), ("fc1.bias", (16,)), ("fc2.weight", (8, 16)), ("fc2.bias", (8,)))
    bigger_batch = fingerprint(_traced(batch=6), mesh, 40e9)
    assert (bigger_batch.ops_sha, bigger_batch.params_sha) == (fp.ops_sha, fp.params_sha) and bigger_batch.shapes_sha != fp.shapes_sha
    assert fingerprint(traced, mesh.with_shape((4,)), None).mesh_shape == (4,)


def test_check_plan_accepts_its_own_model(plan, traced):
    check_plan(replace(plan, nodes=_plan_nodes(traced)), traced, two_axis_mesh(), 40e9)
    with pytest.raises(PlanMismatchError, match=r"nodes\[\d+\]\.strategy\.inputs: 2 specs for node 'mean', which has 1 inputs"):
        check_plan(plan, traced, two_axis_mesh(), 40e9)  # the fixture's odd node: no strategy of mean has two inputs


def _plan_nodes(traced):
    return hand_plan(traced, two_axis_mesh(), column=("fc1.weight", "fc1.bias"), zero=("fc2.weight",),
                     recompute_module="fc1", budget_bytes=40e9).nodes


def test_check_plan_lists_every_difference(plan):
    other = _traced(head=True)
    with pytest.raises(PlanMismatchError) as info:
        check_plan(plan, other, two_axis_mesh(dp=4, tp=1, hardware="a100"), 80e9)
    d = info.value.differences
    assert "parameter 'lm_head.weight' is in the model but not in the plan" in d
    assert any(x.startswith("node '") and "is in the model but not in the plan" in x for x in d)
    assert "mesh shape is (2, 2) in the plan but (4, 1) here" in d
    assert "hardware is 'test' in the plan but 'a100' here" in d
    assert "memory budget is 40 GB in the plan but 80 GB here" in d
    assert "fix:" in str(info.value) and "lm_head.weight" in str(info.value)


def test_check_plan_names_changed_parameter_shape(plan):
    with pytest.raises(PlanMismatchError) as info:
        check_plan(plan, _traced(width=12), two_axis_mesh(), 40e9)
    assert "parameter 'fc1.weight' has shape (16, 12) in the model but (16, 8) in the plan" in info.value.differences


def test_mesh_file_round_trip(tmp_path):
    mesh = two_axis_mesh()
    (tmp_path / "mesh.json").write_text(mesh_to_json(mesh))
    assert load_mesh(tmp_path / "mesh.json") == mesh
