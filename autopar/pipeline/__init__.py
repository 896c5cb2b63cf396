"""Pipeline parallelism: a model cut into stages between its layers, run on torch.distributed.pipelining.

    plan = solve_pipeline(trace_at, 1536, 64, hardware="h100-ib")  # search.py: stages, cuts, micro-batches, schedule
    pm = parallelize_pipeline(model, sample, plan)                   # api.py: this rank's stages
    loss = pm.step(**pm.local_batch(batch)); opt.step()

`autopar.parallelize(..., pp="auto")` does both, keeping stages only where they predict a faster step.
Modules, in the order data flows: `loss` (how a loss adds up over micro-batches), `cut` (stages as graphs
of their own), `plan` (the plan and its JSON), `cost` (bubble, sends, memory in flight), `search` (the
solver's outer loop), `choose` (stages or the single-mesh plan, whichever is faster), `runtime` and
`module` (stages on torch's schedules), `state` (tied weights, state dicts, checkpoints), `api`.
"""
