"""Pricing one assignment exactly: its memory and time breakdowns under the same model the ILP optimises
(`solver/ilp.py`), in plain Python without PuLP. The textbook plans, the anytime search's candidates, `explain`'s
what-ifs, the timeline and the tests all price plans here; the ILP's rows are this function written as constraints,
and `tests/solver/test_ilp.py` checks the two agree on random problems.
"""
from __future__ import annotations

from typing import Sequence

from autopar.solver.cost import GRAD_BUCKET_BYTES
from autopar.solver.offload import lean_in_flight_bytes
from autopar.solver.plan import MemoryBreakdown, TimeBreakdown
from autopar.solver.problem import Assignment, Option, Problem


def evaluate(problem: Problem, a: Assignment, saved_by_node: list[float] | None = None) -> tuple[MemoryBreakdown, TimeBreakdown]:
    """Price an assignment with the same model the ILP optimises (independent of PuLP). `saved_by_node`: a list
    of one zero per problem node, to which each node's part of the saved activations is added (the resharded
    inputs a consumer keeps are the consumer's part): what `solver.timeline` draws."""
    compute_s = comm_s = recompute_s = update_s = offload_s = 0.0
    params = grads = opt = act = temp = 0.0
    host = [0.0, 0.0, 0.0]  # the host tier's masters, gradients, optimizer state
    in_flight, lean_total = 0.0, None  # lean gradients on the device (`solver.offload`), the most there can be
    saved = saved_by_node if saved_by_node is not None else [0.0] * len(problem.nodes)
    # backward rebuilds a recomputed layer in graph order: per recomputed node what it rebuilds (its saved bytes, the
    # resharded inputs it saves again) and the largest buffers of a reshard of its inputs run again before it
    rebuilds: dict[int, float] = {}  # its saved outputs
    resaved: dict[int, float] = {}  # the resharded inputs its rebuild saves again
    reshards: dict[int, float] = {}
    regathered: dict[str, float] = {}  # layer -> its ZeRO parameters' gathered bytes (saved by the rebuild)
    flows: dict[int, float] = {}  # recomputed node -> what backward holds at its step through the rebuilt layer
    param_grads: dict[int, float] = {}  # recomputed node -> the whole gradients it makes of parameters resharded or ZeRO
    regathered_grads: set[tuple[int, int]] = set()  # (recomputed node, ZeRO parameter) whose whole gradient it counts
    kept = {u for u, v in problem.recompute_with if not a.recompute[v]}  # a consumer that is not recomputed saves them
    kept |= {u for u, v in problem.region_inputs if a.recompute[v]}  # ... and a recomputed one of another region too
    for v, node in enumerate(problem.nodes):
        o = node.options[a.choice[v]]
        compute_s += o.compute_s
        update_s += o.update_s
        comm_s += o.comm_s
        factor = 1
        if a.zero[v]:
            if o.zero is None:
                raise ValueError(f"node {node.name!r} option {o.label} cannot be ZeRO-sharded (no replicated axis divides it)")
            factor = o.zero.factor
            comm_s += o.zero.comm_s
            compute_s -= o.zero.update_saving_s
            update_s -= o.zero.update_saving_s
            temp = max(temp, o.zero.gathered_bytes)
            if node.region is not None:
                regathered[node.region] = regathered.get(node.region, 0.0) + o.zero.gathered_bytes
        params += o.param_bytes / factor
        grads += o.grad_bytes / factor
        tiers = [] if o.forced_host is None else [o.forced_host.layout(factor)]  # its members the caller put on the host tier
        if a.offloaded(v):  # its state on the host, stepped there instead of on the device
            if o.host is None:
                raise ValueError(f"node {node.name!r} option {o.label} has no host tier (nothing the optimizer steps)")
            tiers.append(o.host.layout(factor))
            device_step_s = o.update_s - (o.zero.update_saving_s if a.zero[v] else 0.0)
            compute_s -= device_step_s
            update_s -= device_step_s
        else:
            opt += o.optimizer_bytes / factor
        for tier in tiers:
            if tier.lean:  # ZeRO-Offload's layout: the master and its gradient are the host's alone
                params -= tier.host_params_bytes
                grads -= tier.host_grads_bytes
                lean_total = lean_gradient_bytes(problem, problem.host_budget_bytes is not None or any(a.offload)) \
                    if lean_total is None else lean_total
                in_flight = max(in_flight, lean_in_flight_bytes(tier, GRAD_BUCKET_BYTES, lean_total))
            offload_s += tier.step_s
            host = [h + b for h, b in zip(host, (tier.host_params_bytes, tier.host_grads_bytes, tier.host_optimizer_bytes))]
        if a.recompute[v]:
            if not node.recomputable:
                raise ValueError(f"node {node.name!r} cannot be recomputed (a placeholder, or it saves nothing)")
            recompute_s += o.recompute_s
            act += o.held_input_bytes  # its region's inputs from other layers
            saved[v] += o.held_input_bytes
            if v in kept:
                act += o.saved_bytes
                saved[v] += o.saved_bytes
            if node.region is not None:
                rebuilds[v] = 0.0 if v in kept else o.saved_bytes / node.copies
                resaved[v] = 0.0
                flows[v] = o.grad_flow_bytes
        else:
            act += o.saved_bytes
            saved[v] += o.saved_bytes
        temp = max(temp, o.temp_bytes)
    for e in problem.edges:
        i, j, dst = a.choice[e.src], a.choice[e.dst], problem.nodes[e.dst]
        comm_s += e.cost(i, j)
        temp = max(temp, e.buffers(i, j))
        if a.recompute[e.dst]:
            recompute_s += e.forward_cost(i, j)
            # its region reshards again, so nothing resharded is kept through the step, but the rebuild saves it
            if dst.region is not None:
                resaved[e.dst] += e.saved(i, j) / dst.copies
                reshards[e.dst] = max(reshards.get(e.dst, 0.0), e.buffers(i, j))
        else:
            act += e.saved(i, j)
            saved[e.dst] += e.saved(i, j)
            if a.recompute[e.src]:  # the producer's output, which `saved` counts as the producer's, is not kept
                act += e.replaced(i, j)
                saved[e.dst] += e.replaced(i, j)
        if a.zero[e.src]:  # the ZeRO reduce-scatter takes over the consumer's bucketed all-reduce
            comm_s -= e.zero_saving(i, j)
        # The consumer's backward step makes a parameter's gradient at its input spec beside its own gradients: where
        # the edge reshards the parameter or it is stored ZeRO (re-gathered then), a transient before the reduce
        # to the parameter's spec. The step is dst's, or where dst is a view of the parameter, its consumer's (`Edge.grad_step`)
        zero = problem.nodes[e.src].options[i].zero if a.zero[e.src] else None
        held_bytes = e.grads(i, j) + (zero.backward_bytes if zero is not None else 0.0)
        if zero is None:  # a tied parameter's later use: its gradient and the sum beside the first (`Edge.accumulated_bytes`)
            temp = max(temp, e.accumulated(i, j))
        if held_bytes > 0:
            m = e.grad_maker
            temp = max(temp, held_bytes + problem.nodes[m].options[a.choice[m]].temp_bytes)
            # in a rebuilt layer: the parameter is saved by the rebuild (`regathered`, `resaved`)
            if e.dst in flows and e.grads(i, j):  # made at dst's input spec while dst is rebuilt
                param_grads[e.dst] = param_grads.get(e.dst, 0.0) + e.grads(i, j)
            if m in flows and zero is not None and (m, e.src) not in regathered_grads:  # once, through however many edges
                regathered_grads.add((m, e.src))
                param_grads[m] = param_grads.get(m, 0.0) + zero.grad_bytes
    # a rebuilt layer holds its re-gathered ZeRO parameters and what it rebuilt so far, beside a reshard's buffers
    # while its recompute runs one. Backward then runs through it in reverse: at a node's step, what the layer
    # rebuilt before the node is still held, and the inputs the node saved again, beside the gradients of the step
    # (`Option.grad_flow_bytes`); its outputs were freed by its consumers' steps, unless its own backward keeps them
    held: dict[str, float] = {}
    for v in sorted(rebuilds):
        region = problem.nodes[v].region
        held.setdefault(region, regathered.get(region, 0.0))
        temp = max(temp, held[region] + reshards.get(v, 0.0), held[region] + resaved[v] + flows[v] + param_grads.get(v, 0.0))
        held[region] += rebuilds[v] + resaved[v]
    temp = max([temp, *held.values()])  # the whole layer rebuilt
    stepped = [node.options[c].param_bytes / (node.options[c].zero.factor if z else 1)
               for v, (node, c, z) in enumerate(zip(problem.nodes, a.choice, a.zero))
               if node.options[c].optimizer_bytes > 0 and not a.offloaded(v)]
    # the optimizer step's scratch, of every parameter at once under foreach, else of the largest alone (`_add_optimizer_step`)
    step_bytes = problem.step_scratch_per_param_byte * (sum(stepped) if problem.step_scratch_foreach else max(stepped, default=0.0))
    temp = max(temp, step_bytes)
    recompute_s += problem.region_s * checkpoint_regions(problem, a.recompute)
    used = frozenset().union(*(node.options[c].sync_groups for node, c in zip(problem.nodes, a.choice)))
    comm_s += sum(latency_s for g, latency_s in problem.sync_latency_s if g in used)
    for shared in problem.shared_syncs:  # each consumer's price has its part: the sync sends the sum once
        charged = [seconds[a.choice[v]] for v, seconds in shared.terms]
        comm_s += max(charged) - sum(charged)
    return (
        MemoryBreakdown(params, grads + in_flight, opt, act, temp, problem.budget_bytes, *host),
        TimeBreakdown(compute_s, comm_s, recompute_s, update_s, offload_s),
    )


def lean_gradient_bytes(problem: Problem, chosen: bool) -> float:
    """Every lean gradient at once (copies' and sums' bytes, each node's largest option): the most in flight. Of the
    tiers forced, and with `chosen` of those the solver may choose (where the problem offers them, or an assignment
    puts a parameter there)."""
    def lean(o: Option) -> float:
        tiers = [o.forced_host] + ([o.host] if chosen else [])
        return sum(t.copy_grad_bytes + t.summed_grad_bytes for t in tiers if t is not None)
    return sum(max((lean(o) for o in node.options), default=0.0) for node in problem.nodes)


def checkpoint_regions(problem: Problem, recompute: Sequence[bool]) -> int:
    """The checkpoint regions these recompute decisions cost: one per layer with recomputed nodes, and one more per
    node that opens another (`Problem.region_cuts`, taken in graph order); times the layers a tied class stands for.
    Pairs see two recomputed nodes at a time, so kept work that reads two of them is seen through each alone
    (measured on random recompute sets of six zoo models: the count codegen makes in 69 of 72, else short)."""
    copies: dict[str, int] = {}  # layer with recomputed nodes -> the layers it stands for: one region each
    for v, node in enumerate(problem.nodes):
        if recompute[v] and node.region is not None:
            copies[node.region] = max(copies.get(node.region, 1), node.copies)
    opened: dict[int, int] = {}  # node that opens another region -> the layers it stands for
    for cut in problem.region_cuts:  # in graph order of `second`: whether a node between opened one is known
        if (recompute[cut.first] and recompute[cut.second] and not any(recompute[m] for m in cut.joins)
                and not any(m in opened for m in cut.between)):
            opened[cut.second] = problem.nodes[cut.second].copies
    return sum(copies.values()) + sum(opened.values())


def recomputable_options(problem: Problem) -> list[frozenset[int]]:
    """Per node, the options under which it may be recomputed: a call (not a placeholder) that saves something, or
    that keeps another node's output (`Problem.recompute_with`: it may join that node's region); recomputing
    anything else frees nothing."""
    keepers = {v for _, v in problem.recompute_with}
    return [frozenset(s for s, o in enumerate(node.options) if node.recomputable and (o.saved_bytes > 0 or v in keepers))
            for v, node in enumerate(problem.nodes)]
