"""The two-phase Block AttnRes mixer as an ``execute_plan`` mixer callback (config key
``attn_res_two_phase``; math in ``longflash/layers/attn_res_two_phase.py``).

Queries of block k (``k = l // block_size``), in execution order: layer l's attention mixer, then its
MLP mixer, for every layer of the block; the last block also holds the output mixture as its final
query (its sources are the same committed slots, ``bank[:NB]``, plus the final prefix). Query 0, the
block's first attention mixer, reads exactly the block's committed slots (its prefix is committed as
``bank[k]`` right after it), so phase 1 runs there, over that mixer's sources, for all the block's
queries at once; query 0's result is phase 1's ``acc[0]`` cast to the activation dtype, and every
later query merges its partial with its last source, the running prefix.

Storage: the partials (acc [Q, T, H] fp32, lse [Q, T] fp32) are separate allocations, not values of
the storage plan: they are created at query 0 and dropped after the block's last query. The plan's
values are read no later than the schedule says (phase 1 reads query 0's sources during query 0; phase
2 reads only the prefix, a source of its own op), so ``check_plan``'s proof that no live source is
overwritten still holds unchanged, and ``reuse=False`` stays bitwise equal to ``reuse=True``.
"""

from __future__ import annotations

from typing import Callable

import torch

from longflash.layers.attn_res_two_phase import AttnResPartials, attn_res_block_partials, attn_res_merge_prefix
from longflash.models.attn_res_plan import ATTN_MIX, MLP_MIX, OUT_MIX

# (layer, sublayer) -> (norm weight g [H], proj weight w [1, H] or [H])
WeightsOf = Callable[[int | None, str], tuple[torch.Tensor, torch.Tensor]]


def block_queries(num_layers: int, block_size: int) -> list[list[tuple[int | None, str]]]:
    """The mixers of each block in query order: ``[(l, attn_mix), (l, mlp_mix), ...]``; the last block
    ends with ``(None, output_mix)``. Raises ValueError for num_layers < 1 or block_size < 1."""
    if num_layers < 1 or block_size < 1:
        raise ValueError(f"need num_layers >= 1 and block_size >= 1, got {num_layers}, {block_size}")
    blocks = [[(l, kind) for l in range(k, min(k + block_size, num_layers)) for kind in (ATTN_MIX, MLP_MIX)]
              for k in range(0, num_layers, block_size)]
    blocks[-1].append((None, OUT_MIX))
    return blocks


class AttnResTwoPhase:
    """Block layout and stacked per-block weights for the two-phase mixer of one model.

    ``mixer(weights_of)`` returns a fresh per-forward callback ``mix(layer, sublayer, sources, out)``
    for ``execute_plan``. Stacked weights ([Q, H] per block, detached: inference only) are cached and
    rebuilt when a weight's storage or version changes (weight loading copies in place); during CUDA
    graph capture a missing stack is built inside the graph and not cached, so no cached tensor lives
    in a graph's private memory pool.
    """

    def __init__(self, num_layers: int, block_size: int, eps: float):
        self.blocks = block_queries(num_layers, block_size)
        self.index = {key: (k, i) for k, qs in enumerate(self.blocks) for i, key in enumerate(qs)}
        self.eps = eps
        self._stacks: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def stacked_weights(self, k: int, weights_of: WeightsOf) -> tuple[torch.Tensor, torch.Tensor]:
        """(G [Q, H], W [Q, H]) of block k's queries in query order."""
        ws = [weights_of(l, kind) for l, kind in self.blocks[k]]
        key = tuple((t.data_ptr(), t._version) for gw in ws for t in gw)
        hit = self._stacks.get(k)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.no_grad():
            G = torch.stack([g.detach().reshape(-1) for g, _ in ws])
            W = torch.stack([w.detach().reshape(-1) for _, w in ws])
        if not (G.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._stacks[k] = (key, G, W)
        return G, W

    def mixer(self, weights_of: WeightsOf) -> Callable:
        """A mixer callback for one forward (holds the current block's partials)."""
        state: dict = {}

        def mix(layer: int | None, kind: str, sources: list[torch.Tensor], out: torch.Tensor | None):
            k, i = self.index[(layer, kind)]
            if i == 0:
                G, W = self.stacked_weights(k, weights_of)
                parts = attn_res_block_partials(sources, G, W, self.eps)
                state.update(block=k, parts=parts, committed=list(sources))
                acc0 = parts.acc[0]
                return acc0.to(sources[0].dtype) if out is None else out.copy_(acc0)
            committed = state.get("committed")
            if (state.get("block") != k or len(sources) != len(committed) + 1
                    or any(a is not b for a, b in zip(sources, committed))):
                raise RuntimeError(f"two-phase AttnRes: mixer {kind} of layer {layer} (block {k}) does not read "
                                   f"the committed slots its block's phase 1 read")
            parts: AttnResPartials = state["parts"]
            g, w = weights_of(layer, kind)
            res = attn_res_merge_prefix(parts.query(i), sources[-1], g, w, self.eps, out=out)
            if i == len(self.blocks[k]) - 1:
                state.clear()  # the block's partials are dead
            return res

        return mix
