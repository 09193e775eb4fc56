"""The token embedding, split over tensor-parallel ranks by vocabulary rows: each rank looks up the ids in
its rows, zeros for the others, and the all-reduce sums the one row that is not zero. At one rank it is
nn.Embedding's lookup."""
from __future__ import annotations

import torch
from torch import nn

from moelora.distributed.sharding import even_shard, size_of
from moelora.distributed.state import get_parallel
from moelora.layers.collectives import all_reduce


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        state = self.dist_state = get_parallel()
        self.vocab_size = vocab_size
        self.shard = even_shard(vocab_size, state.tp_size, state.rank, "the vocabulary")  # rows this rank holds
        self.weight = nn.Parameter(torch.empty(size_of(self.shard), hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if size_of(self.shard) == self.vocab_size:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(self.dist_state, rows.masked_fill(outside[:, None], 0.0))
