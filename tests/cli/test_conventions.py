"""One set of conventions: `--mesh 2x4` in examples/train.py as on the CLI, a missing optional package names its pip
command, a plan made for another model names that model, and transformers' known noise is not printed."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from autopar.cli import main
from autopar.errors import PlanMismatchError
from autopar.model_file import import_model_file
from autopar.solver.plan_io import check_plan
from autopar.tracer import trace
from tests.cli.plans import EXAMPLES, hand_plan, traced_zoo, two_axis_mesh

train = import_model_file(EXAMPLES / "train.py")


def test_train_takes_the_clis_mesh_syntax(capsys, monkeypatch):
    assert train.parse_args(["--mesh", "2x2"]).mesh == (2, 2)
    assert train.parse_args([]).mesh is None  # one axis over the world
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--mesh", "2,2"])
    assert info.value.code == 2
    assert "cannot read mesh shape '2,2'; write sizes joined by x, e.g. 8 or 2x4" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # under torchrun every rank parses: rank 0 alone says why
    with pytest.raises(SystemExit):
        train.parse_args(["--mesh", "2,2"])
    assert capsys.readouterr().err == ""


def test_a_missing_optional_package_names_its_pip_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    assert main(["plan", "--hf-config", "gpt2", "--gpus", "8"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "--hf-config gpt2 needs the optional package 'transformers', which is not installed" in err[-2]
    assert err[-1].strip() == 'fix: pip install -e ".[hf]"'
    model_file = tmp_path / "uses_hf.py"
    model_file.write_text("import transformers\n")
    assert main(["plan", str(model_file), "--gpus", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "uses_hf.py imports 'transformers', which is not installed" in err[-2] and err[-1].strip() == 'fix: pip install -e ".[hf]"'


def test_a_plan_for_another_model_names_that_model():
    plan = hand_plan(traced_zoo("gpt2"), two_axis_mesh())
    with pytest.raises(PlanMismatchError) as info:
        check_plan(plan, traced_zoo("mlp"), two_axis_mesh(), None)
    first = str(info.value).splitlines()[0]
    assert first.startswith("the plan was made for GPT, not this MLP (first difference: ")
    assert len(first) < 250 and len(info.value.differences) > 1  # every difference is still on the error


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_transformers_loss_type_warning_is_not_printed_while_tracing():
    """GPT2LMHeadModel has no loss type of its own: its first forward warns (once a process) that it falls back to
    the causal-LM loss. Tracing runs that forward without the warning; an eager forward afterwards still has it.
    (Read from transformers' own logger, which writes to whatever stream was stderr when it was imported.)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    records = _Records()
    logging.getLogger("transformers").addHandler(records)  # transformers' loggers pass their records up to it
    try:
        logging.Logger.warning_once.cache_clear()  # transformers' once-a-process memory of what it warned
        trace(model, {"input_ids": ids, "labels": ids})
        assert not any("loss_type=None" in m for m in records.messages), records.messages
        logging.Logger.warning_once.cache_clear()
        model(input_ids=ids, labels=ids)  # the control: the message the filter drops is the one transformers prints
        assert any(m.startswith("`loss_type=None` was set in the config but it is unrecognized") for m in records.messages)
    finally:
        logging.getLogger("transformers").removeHandler(records)
