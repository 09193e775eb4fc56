"""Which part of a full dimension a rank holds. Every split is even: a size that does not divide is refused
with the sizes named, rather than padded (the served families' head counts, intermediate sizes and
vocabularies divide by 2, 4 and 8)."""
from __future__ import annotations


def even_shard(size: int, parts: int, index: int, what: str) -> slice:
    """Part `index` of `size` split in `parts` equal pieces."""
    if size % parts:
        raise ValueError(f"{what} ({size}) does not split evenly over {parts} ranks")
    step = size // parts
    return slice(index * step, (index + 1) * step)


def kv_head_shard(num_kv_heads: int, tp_size: int, rank: int) -> slice:
    """The key/value heads a rank holds: its share when there are at least as many heads as ranks, else the
    one head its query heads use (held by tp_size / num_kv_heads ranks alike)."""
    if num_kv_heads >= tp_size:
        return even_shard(num_kv_heads, tp_size, rank, "key/value heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} key/value heads cannot be replicated evenly over {tp_size} ranks")
    head = rank // (tp_size // num_kv_heads)
    return slice(head, head + 1)


def scale(shard: slice, factor: int) -> slice:
    """A shard of heads -> the shard of their rows (factor = rows per head)."""
    return slice(shard.start * factor, shard.stop * factor)


def size_of(shard: slice) -> int:
    return shard.stop - shard.start
