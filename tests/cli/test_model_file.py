"""Model files and --hf-config presets: what the CLI plans."""
from __future__ import annotations

import pytest
import torch

from autopar.errors import ModelFileError
from autopar.model_file import load_hf_preset, load_model_file
from tests.cli.plans import EXAMPLES


def test_build_gets_only_the_given_sizes():
    model, sample = load_model_file(EXAMPLES / "gpt2.py", batch_size=3, seq_len=8, size="tiny")
    assert sample["input_ids"].shape == (3, 8) and sample["input_ids"].device.type == "meta"
    assert next(model.parameters()).device.type == "meta"
    model, sample = load_model_file(EXAMPLES / "mlp.py", size="tiny")  # build()'s own default batch
    assert sample[0].shape == (1024, 32)


def test_fixed_model_file(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\nmodel = torch.nn.Linear(4, 2)\nsample_input = torch.randn(3, 4)\n")
    model, sample = load_model_file(f)
    assert isinstance(model, torch.nn.Linear) and sample.shape == (3, 4)
    with pytest.raises(ModelFileError, match=r"--batch-size given but .* defines a fixed `model`/`sample_input`, not build\(\)\n  fix: drop --batch-size"):
        load_model_file(f, batch_size=2)


def test_a_model_files_batch_dim_reaches_the_trace_the_cli_plans(tmp_path):
    """A sequence-first model file sets `batch_dim = 1`: the CLI traces (and so prices) its input as fed along
    dim 1; without it, along dim 0."""
    from autopar.report.commands import _trace_and_profile
    from autopar.solver.plan import PlanSource

    text = "import torch\nmodel = torch.nn.Linear(4, 2)\nsample_input = torch.randn(6, 8, 4)\n"
    for name, extra, want in (("first.py", "batch_dim = 1\n", (1,)), ("default.py", "", (0,))):
        f = tmp_path / name
        f.write_text(text + extra)
        traced, _ = _trace_and_profile(PlanSource(str(f), "", None, None, "", "adamw"), "cpu")
        assert traced.input_batch_dims == want


@pytest.mark.parametrize("text, message", [
    ("def build(batch_size, seq_len=4):\n    return 1\n", r"build\(\) in .* returned int, not \(model, sample_input\)"),
    ("def build(batch_size):\n    raise RuntimeError('boom')\n", r"build\(batch_size=2\) in .* raised RuntimeError: boom"),
    ("raise ValueError('bad import')\n", r"raised ValueError while loading: bad import\n  fix: run `python "),
])
def test_model_file_errors(tmp_path, text, message):
    f = tmp_path / "m.py"
    f.write_text(text)
    with pytest.raises(ModelFileError, match=message):
        load_model_file(f, batch_size=2)


def test_unknown_build_option(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def build(batch_size):\n    pass\n")
    with pytest.raises(ModelFileError, match=r"--seq-len was given but build\(\) in .* has no `seq_len` argument"):
        load_model_file(f, batch_size=2, seq_len=4)


def test_hf_gpt2_preset_is_gpt2_small_on_meta():
    model, sample = load_hf_preset("gpt2", batch_size=2, seq_len=16)
    # GPT-2 small: 124,439,808 parameters (tied LM head counted once), as published with the HF checkpoint
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sample["input_ids"].shape == (2, 16)
    with pytest.raises(ModelFileError, match="unknown --hf-config preset 'bert'"):
        load_hf_preset("bert")
