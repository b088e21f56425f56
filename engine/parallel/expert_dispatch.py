"""Expert parallelism by all-to-all (``EngineConfig.moe_dispatch`` "all_to_all"): a mixture-of-experts layer's tokens
travel to the ranks that hold their experts, instead of every rank computing its experts' rows of every token and the
tensor-parallel all-reduce summing the ranks' shares (engine/model/moe.py, the default, "all_reduce").

Per layer, on every rank of the group (each holds the whole residual stream after attention, and E / R experts):

    route     every rank routes every token alike (the router replicated; the metrics count every token on each)
    share     rank r takes tokens [T r / R, T (r + 1) / R)
    dispatch  its (token, expert) pairs, ordered by the rank that holds the expert, go there as rows of x, their
              expert ids beside (two all-to-alls)
    compute   each rank runs its experts over the rows it got, expert by expert (a native product's row is the same
              bits in any batch: moe.py)
    return    the outputs go back the way they came (an all-to-all)
    combine   rank r sums its tokens' k outputs, weighted, in ascending expert order (the one-process order), and the
              ranks gather every token's sum (an all-gather); a shared expert (Qwen2-MoE), split as a dense MLP, is
              summed by an all-reduce and added last

On one host it moves more bytes than the all-reduce (two all-to-alls of k T H rows and an all-gather, against one
all-reduce of T H) through gloo rather than the shared-memory all-reduce: ``splitserve bench tp`` prints the two
collectives side by side, and ``bench moe --dispatch`` the model's steps (docs/models.md, "Expert parallelism").
"""

from __future__ import annotations

import torch

from splitserve.engine.model.moe import MoE
from splitserve.engine.parallel.layout import RankShard
from splitserve.engine.parallel.process_group import TensorParallelGroup


class AllToAllExperts:
    """``MoE.dispatch`` of a tensor-parallel rank: the layer's output [T, H] on every rank, as one process's."""

    def __init__(self, group: TensorParallelGroup, shards: list[RankShard]):
        self.group = group
        self.firsts = torch.tensor([shard.experts[0] for shard in shards[1:]])  # where each next rank's experts start

    def __call__(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        group, k = self.group, moe.top_k
        experts, weights = moe.counted_route(x)
        bounds = [len(x) * r // group.size for r in range(group.size + 1)]
        lo, hi = bounds[group.rank], bounds[group.rank + 1]
        pairs = experts[lo:hi].flatten()  # this rank's tokens' (token, j) pairs
        owners = torch.bucketize(pairs, self.firsts, right=True)
        order = owners.argsort(stable=True)
        counts = torch.bincount(owners, minlength=group.size).tolist()
        rows, came = group.all_to_all_rows(x[lo:hi][order // k], counts)
        ids, _ = group.all_to_all_rows(pairs[order], counts)
        outputs = torch.empty_like(rows)
        for expert, mine in zip(moe.local, moe.local_rows(ids)):
            if len(mine):
                outputs[mine] = expert(rows[mine])
        back, _ = group.all_to_all_rows(outputs, came)
        pair_outputs = torch.empty_like(back)
        pair_outputs[order] = back
        pair_outputs = pair_outputs.view(hi - lo, k, x.shape[1]).mul_(weights[lo:hi, :, None])
        ascending = experts[lo:hi].argsort(dim=1, stable=True)
        summed = torch.zeros(hi - lo, x.shape[1], dtype=x.dtype)
        tokens = torch.arange(hi - lo)
        for j in range(k):
            summed += pair_outputs[tokens, ascending[:, j]]
        out = group.all_gather_rows(summed, [b - a for a, b in zip(bounds, bounds[1:])])
        shared = moe.shared_output(x)  # split as a dense MLP: this rank's share
        if shared is not None:
            group.all_reduce(shared)
            out += shared
        return out
