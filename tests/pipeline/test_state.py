"""State across stages: a pipeline's state dict is one device's, and its checkpoint resumes elsewhere.

GPT-2 (its token embedding tied to the LM head, held by the first and the last stage) trains two
steps under pp=2 x dp=2 and saves a checkpoint; training resumes from it under a data-parallel plan
on 4 ranks, under a pipeline cut elsewhere, and on one device with torch alone: each takes the step
one device that never stopped takes.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from autopar.pipeline.api import build_pipeline
from autopar.runtime.checkpoints import latest_checkpoint
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from tests.codegen.harness import EPS, LR, call, load_on_one_device, loss_of, parallel_module, trace_model, train_on_one_device
from tests.codegen.harness import check_steps as check_parallel_steps
from tests.codegen.plans import cpu_mesh, random_plan
from tests.pipeline.harness import STEPS, check_steps, micro_trace, random_case, zoo_model

STOP = 2  # steps before the checkpoint; the reference trains STEPS


def _first_half(rank, world, case, path):
    model, sample, ref = zoo_model(case.model)
    pm = build_pipeline(model, micro_trace(case.model, case.plan.microbatches), case.plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    check_steps(pm, opt, sample, ref, range(STOP), case.label)
    full = pm.state_dict()
    pm.save_checkpoint(path, opt)
    return full


def _resume_pipeline(rank, world, case, path):
    model, sample, ref = zoo_model(case.model)
    pm = build_pipeline(model, micro_trace(case.model, case.plan.microbatches), case.plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    pm.load_checkpoint(path, opt)
    check_steps(pm, opt, sample, ref, range(STOP, STEPS), f"resumed under {case.label}")


def _resume_data_parallel(rank, world, plan, path):
    model, sample, ref = zoo_model("gpt2")
    pm = parallel_module(model, sample, trace_model(model, sample), plan, ProcessMesh((world,)))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    pm.load_checkpoint(path, opt)
    check_parallel_steps(pm, opt, ref, range(STOP, STEPS), "resumed under a plan on 4 ranks", [sample] * (STEPS - STOP))


@pytest.mark.long
@pytest.mark.timeout(400)
def test_checkpoint_of_pp2_dp2_resumes_under_dp4_another_pipeline_and_one_device(tmp_path):
    model, sample, ref = zoo_model("gpt2")
    case = random_case("gpt2", 2, (2,), random.Random(11), ("1f1b", "gpipe"))
    path = str(tmp_path / "ckpt")
    fulls = run_ranks(_first_half, 4, case, path, timeout_s=300)

    one = copy.deepcopy(model)  # one device after STOP steps
    one_opt = torch.optim.AdamW(one.parameters(), lr=LR, eps=EPS)
    for _ in range(STOP):
        one_opt.zero_grad()
        loss_of(call(one, sample)).backward()
        one_opt.step()
    want = one.state_dict()
    for full in fulls:  # every rank's state_dict(): the whole model, tied names included
        assert set(full) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"state_dict()[{k!r}]: {m}")

    traced = trace_model(model, sample)
    run_ranks(_resume_data_parallel, 4, random_plan(traced, cpu_mesh((4,)), random.Random(12)), path, timeout_s=300)
    run_ranks(_resume_pipeline, 4, random_case("gpt2", 4, (1,), random.Random(13), ("gpipe", "1f1b")), path, timeout_s=300)

    fresh, opt = load_on_one_device(model, latest_checkpoint(path))  # the newest published save
    train_on_one_device(fresh, opt, sample, ref, range(STOP, STEPS), atol=1e-5)
