"""The README's training loop, runnable: GPT-2 tiny on every rank of a torchrun world.

    torchrun --nproc_per_node 2 examples/quickstart.py
"""
import torch

import autopar
from autopar.model_file import load_model_file
from autopar.runtime.launch import init_from_env

rank, world, device = init_from_env()                       # torchrun's world: NCCL on GPUs, gloo on CPU
torch.manual_seed(0)                                        # every rank builds the same model
model, batch = load_model_file("examples/gpt2.py", batch_size=8, seq_len=64, size="tiny", device=str(device))
bf16 = autopar.MixedPrecision(torch.bfloat16)              # bf16 compute on float32 weights, planned and run
pm = autopar.parallelize(model, batch, device_mesh=(world,), mixed_precision=bf16)  # solved on rank 0, lowered on every rank
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)          # made after parallelize: this rank's float32 shards
for step in range(5):
    loss = pm(**pm.local_batch(batch))                      # this rank's rows; the loss is the global one, in float32
    loss.backward()                                         # gradients summed across ranks into float32 .grad
    pm.clip_grad_norm_(1.0)                                 # by the norm of the full gradients
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}  loss {loss.item():.4f}")
pm.save_checkpoint("ckpt", opt, extra={"step": step + 1})   # every rank: each writes its own shards
