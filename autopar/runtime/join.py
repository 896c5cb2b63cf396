"""Ranks with different numbers of batches under a data-parallel plan: torch's `Join` shadows the ones that ran out.

    from torch.distributed.algorithms import Join
    with Join([pm], optimizer=opt):          # optimizer: optional, brought along at the end (below)
        for batch in this_ranks_batches:     # the ranks may hold different numbers of batches
            opt.zero_grad()
            pm(**batch).backward()
            opt.step()

What DDP's `join()` does, for autopar's collectives; torch's `Join` drives both. Each
training forward inside the context first tells it that this rank still trains (`Join`'s
own all-reduce of a one), then sends whether this step's backward syncs gradients (one
more all-reduce, of a flag: a `no_sync()` step sends no buckets). A rank whose loop has
ended waits in the context's exit and, for every step the others still take, issues the
same collectives with nothing of its own in them: the loss's all-reduces (a token count of
zero, a loss sum of zero) and, when the step syncs, every gradient bucket filled with
zeros. A mean loss then counts only the tokens of the ranks still training, and each
gradient is the sum of their terms: every step is one device's step on the batches that
remain. (The loss and the gradients are sums over ranks, never averages, so a missing
rank needs no rescaling, unlike DDP's `divide_by_initial_world_size`.)

When every rank has joined, the last one to join sends its parameters and buffers to the
others (the early ones stopped stepping), and the state of the optimizer passed as
`Join([pm], optimizer=opt)`. Without it an early rank's optimizer keeps its old moments
and the ranks' parameters would part at their next step: that rank says so. The module's
forwards are then plain ones again (torch leaves a joinable's config enabled after its
context; DDP goes on announcing every forward), so an evaluation may follow. One `Join`
object serves one `with` block, as torch's examples make it: torch enables the config
only when the object is made, so in a second block of the same object the module's steps
go unannounced, and a rank that runs out of batches there meets mismatched collectives
(gloo stops on the size mismatch: measured).

Only a plan whose steps exchange nothing but the loss's scalars and the gradient buckets
can be shadowed so, and `Join` refuses any other when the context is made: one that moves
activations (tensor, sequence or vocabulary parallel) would need this rank's inputs, one
that gathers parameters stored split would read the part a joined rank no longer updates
(a plan may split a parameter to save time, not only memory: the CPU preset splits
GPT-2-tiny's position table on 2 ranks), and a `local_slice` all-gathers its gradient in
backward, at a point of backward the shadow does not replay. Evaluation inside the context
is refused as well: a joined rank shadows training steps only.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

from autopar.errors import AutoparError
from autopar.runtime import collectives as C
from autopar.runtime import comm

if TYPE_CHECKING:
    from autopar.codegen.module import ParallelModule

logger = logging.getLogger(__name__)

# The loss's all-reduces (`runtime.deferred_loss`), each a 0-d float64 sum, and the argument naming its group.
_LOSS_COLLECTIVES = {C.start_count: 1, C.deferred_mean: 2, C.deferred_all_reduce: 1}
# the runtime's collectives that send data, forward or backward (replicate_to_partial only relabels this rank's;
# local_slice does too, but its backward all-gathers the gradient)
_COMMUNICATING = frozenset(f for f in C.COLLECTIVES.values() if f not in (C.replicate_to_partial, *_LOSS_COLLECTIVES))
_BROADCAST_BUCKET_BYTES = 25 * 2**20  # DDP's final sync uses its bucket size for the same broadcast


class JoinError(AutoparError):
    """The parallel module cannot take part in torch's `Join` as asked."""


def step_begins(pm: ParallelModule, syncing: bool) -> None:
    """A forward inside an enabled `Join`: tell the context this rank still trains, then whether its backward
    syncs gradients. Refuses what the joined ranks cannot shadow."""
    if not (pm.training and torch.is_grad_enabled()):
        raise JoinError("pm(...) ran in eval mode or without gradients inside torch's Join context; a rank that has "
                        "joined shadows training steps only (a forward with gradients, then its backward). Evaluate "
                        "outside the Join context")
    Join.notify_join_context(pm)
    _any_syncs(pm, syncing)


def _any_syncs(pm: ParallelModule, syncing: bool) -> bool:
    """Whether some rank's backward syncs gradients this step: an all-reduce every rank of the context makes."""
    flag = torch.tensor([1.0 if syncing else 0.0], device=pm.join_device)
    dist.all_reduce(flag, group=pm.join_process_group)
    return bool(flag.item())


def loss_groups(pm: ParallelModule) -> list[str]:
    """The group of each loss all-reduce a forward of `pm` issues, in its order. Refuses a plan whose steps move
    anything else between ranks besides the gradient buckets: nothing else can be sent without this rank's data."""
    if pm._inputs_must_agree:  # activations exchanged (`codegen.exchanges`: vocabulary parallel, batch norm's included)
        raise _cannot_shadow("exchanges activations between ranks (tensor, sequence or vocabulary parallel): a rank "
                             "that has joined has no inputs to send")
    return _loss_groups(pm.graph_module)


def _loss_groups(gm: fx.GraphModule) -> list[str]:
    groups = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _LOSS_COLLECTIVES:
            groups.append(node.args[_LOSS_COLLECTIVES[node.target]])
        elif node.op == "call_function" and node.target in _COMMUNICATING:
            raise _cannot_shadow(f"or its backward moves this rank's own part of a tensor ({node.target.__name__}, "
                                 f"{node.name}): a parameter stored split, which a rank that has joined would stop "
                                 "updating while the others still read it, or a gradient gathered in backward")
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target), fx.GraphModule):
            groups += _loss_groups(getattr(gm, node.target))  # a recomputed region
    return groups


def _cannot_shadow(why: str) -> JoinError:
    return JoinError(f"torch's Join cannot shadow this plan: its forward {why}. Join takes plans whose forward "
                     "exchanges only the loss's scalars (data parallel, every parameter whole on every rank). Give "
                     "every rank the same number of batches (torch's DistributedSampler pads the ranks' shares to one "
                     "count), or run a plan that keeps every parameter whole")


class ShadowSteps(JoinHook):
    """`ParallelModule.join_hook`'s: the steps of the ranks still training, with nothing of this rank's in them."""

    def __init__(self, pm: ParallelModule, optimizer: torch.optim.Optimizer | None):
        self.pm, self.optimizer = pm, optimizer
        self.groups = loss_groups(pm)

    def main_hook(self) -> None:
        syncs = _any_syncs(self.pm, False)
        for group in self.groups:
            comm.start_sum(torch.zeros((), dtype=torch.float64, device=self.pm.join_device), group).wait()
        if syncs:
            self.pm._sync.shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        # torch's context leaves its joinables' config enabled once it has exited (DDP then notifies at every later
        # forward): this module's forwards after the context are plain ones again, evaluation included
        self.pm._join_config = _JoinConfig.construct_disabled_join_config()
        self.pm._forwards_since_check = 0  # the ranks took different numbers of forwards: they count afresh alike
        group = self.pm.join_process_group
        last = torch.tensor([dist.get_rank(group) if is_last_joiner else -1], device=self.pm.join_device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
        src = int(last.item())  # a last joiner's rank in the group (the highest, if several ran out at the last step)
        with torch.no_grad():  # torch's coalesced broadcast, as DDP's final sync after its join (a group rank)
            dist._broadcast_coalesced(group, [*self.pm.parameters(), *self.pm.buffers()], _BROADCAST_BUCKET_BYTES, src)
        if self.optimizer is not None:
            state = [self.optimizer.state_dict() if is_last_joiner else None]
            dist.broadcast_object_list(state, group=group, group_src=src, device=self.pm.join_device)
            if not is_last_joiner:
                self.optimizer.load_state_dict(state[0])
        elif not is_last_joiner:
            logger.warning("rank %d ran out of batches first: its parallel module now holds the last rank's parameters, "
                           "but its optimizer keeps its own state, and the ranks' parameters will part at the next "
                           "step; pass the optimizer, Join([pm], optimizer=opt), to bring it along", dist.get_rank())
