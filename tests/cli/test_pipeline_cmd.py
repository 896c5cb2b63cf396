"""`autopar plan --pp` and `autopar show` of a pipeline plan: the stages, their layers, the schedule and bubble."""
from __future__ import annotations

import json

from autopar.cli import main
from autopar.pipeline.plan import load_pipeline_plan
from tests.cli.plans import EXAMPLES

MLP = str(EXAMPLES / "mlp.py")


def test_plan_with_pp_saves_and_shows_the_stages(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--hardware", "cpu", "--pp", "2",
            "--time-limit", "5", "--save", str(path), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    plan = load_pipeline_plan(path)
    assert summary["kind"] == "pipeline" and summary["layout"].startswith("pp=2")
    assert summary["schedule"] == plan.schedule and summary["microbatches"] == plan.microbatches
    assert [layer for s in summary["stages"] for layer in s["layers"]] == ["layers.0", "layers.1", "layers.2"]
    assert summary["stages"][0]["also"][0] == "embeddings"
    assert summary["stages"][-1]["also"][-1] == "head and loss"
    assert summary["step_s"] == plan.time.step_s > summary["bubble_s"] >= 0

    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"pipeline pp=2, {plan.schedule}, {plan.microbatches} micro-batches" in out
    assert "layers.0" in out and "layers.2" in out and "bubble" in out


def test_a_pipeline_search_out_of_time_keeps_the_plan_without_stages_and_says_so(capsys):
    argv = ["plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--hardware", "cpu", "--pp", "auto",
            "--time-limit", "5", "--pp-time-limit", "1e-9", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary.get("kind") != "pipeline"
    assert any(n.startswith("no pipeline stages: the pipeline search stopped: its time limit of 1e-09 CPU s ran out")
               for n in summary["notes"]), summary["notes"]


def test_pp_of_one_is_refused_with_the_fix(capsys):
    assert main(["plan", MLP, "--gpus", "2", "--pp", "1"]) == 2
    assert "1 pp ranks is no pipeline: give at least 2, or 'auto'" in capsys.readouterr().err
