"""Every form of the report says the same thing about one plan: `autopar plan --load`, `show`, `show --json`,
`show --html`, `explain` and `diff`, for Hugging Face's GPT-2 (Conv1D weights stored in x out) and examples/gpt2.py
(the same module names, nn.Linear weights stored out x in).

The plan splits both MLP weights over tp as Megatron does: c_fc by its outputs, c_proj by its inputs. The words
expected are derived here from the weight's shape, independently of autopar's layout detection: the split dim is
c_fc's output dim when its size is the MLP's width (4 x 64), and c_proj's input dim when its size is that width.
"""
from __future__ import annotations

import json
import re

import pytest

from autopar.cli import main
from autopar.report.units import fmt_bytes, fmt_seconds
from tests.cli.plans import EXAMPLES
from tests.report.plans import MODELS

pytestmark = pytest.mark.xdist_group("report")  # one worker: the session's plans (conftest) are made once

SIZE = ["--size", "tiny", "--batch-size", "4", "--seq-len", "16"]  # as `plans.make_plans` plans them


def _run(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _row(text: str, module: str) -> str:
    return next(line for line in text.splitlines() if module in line)


@pytest.mark.long
@pytest.mark.parametrize("name", MODELS)
def test_every_form_says_the_same(plans, capsys, name):
    d = plans
    tp = d / f"{name}-tp.json"
    model_file = str(EXAMPLES / f"{name}.py")
    html_path = d / f"{name}.html"
    planned = _run(capsys, "plan", model_file, *SIZE, "--gpus", "4", "--mesh", "2x2", "--hardware", "cpu", "--load", str(tp))
    shown = _run(capsys, "show", str(tp), "--html", str(html_path))
    summary = json.loads(_run(capsys, "show", str(tp), "--json"))
    explained = _run(capsys, "explain", str(tp), "transformer.h.0.mlp")
    explained_json = json.loads(_run(capsys, "explain", str(tp), "transformer.h.0.mlp", "--json"))
    diffed = _run(capsys, "diff", str(d / f"{name}-dp.json"), str(tp))
    page = html_path.read_text()

    # words: what the plan records, derived from the shapes above, in every form
    rows = {r["module"]: r for r in summary["layers"]}
    c_fc, c_proj = rows["transformer.h.0..1.mlp.c_fc"]["params"], rows["transformer.h.0..1.mlp.c_proj"]["params"]
    assert c_fc.startswith("weight: column-parallel over tp") and c_proj.startswith("weight: row-parallel over tp")
    for words, module in ((c_fc, "transformer.h.0..1.mlp.c_fc "), (c_proj, "transformer.h.0..1.mlp.c_proj ")):
        assert words in _row(planned, module) and words in _row(shown, module)
        assert f"<td>{module.strip()}</td>" in page and f"<td>{words}</td>" in page
    changed = {r["module"]: r["b"] for r in json.loads(_run(capsys, "diff", str(d / f"{name}-dp.json"), str(tp), "--json"))["layers"]}
    assert changed["transformer.h.0..1.mlp.c_fc"].startswith(c_fc) and c_fc in _row(diffed, "transformer.h.0..1.mlp.c_fc ")
    weights = {n["parameter"]: n["words"] for n in explained_json["nodes"] if "parameter" in n}
    assert weights["transformer.h.0.mlp.c_fc.weight"] == "column-parallel over tp"
    assert weights["transformer.h.0.mlp.c_proj.weight"] == "row-parallel over tp"
    assert "transformer.h.0.mlp.c_fc.weight" in explained and "): column-parallel over tp (use RS(" in explained

    # peak and step time: the plan's, in every form; the chart's highest point is the peak
    peak_bytes, step_s = summary["memory"]["total_bytes"], summary["time"]["total_s"]
    peak, step = fmt_bytes(peak_bytes), fmt_seconds(step_s)
    assert max(p["bytes"] for p in summary["memory_timeline"]) == peak_bytes
    for text in (planned, shown, explained):
        assert f"predicted step {step}, peak {peak} per device" in text
    assert re.search(rf"│ peak\s+│\s+{re.escape(peak)} │", planned) and re.search(rf"│ total\s+│\s+{re.escape(step)} │", planned)
    assert f"predicted step {step}, peak {peak} per device" in page and f">peak {peak}</text>" in page
    assert explained_json["peak_bytes"] == peak_bytes and explained_json["step_s"] == step_s
    assert f"-> {step} (" in _row(diffed, "step time") and f"-> {peak} (" in _row(diffed, "peak memory")
