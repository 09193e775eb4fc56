"""Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache): the KV cache slots of finished
requests' tokens stay in a radix tree, one per adapter, and a new request whose prompt starts with tokens the
tree holds takes their slots instead of computing them again (a shared system prompt, the turns of a chat).

Keys and values depend on the adapter (its LoRA on q/k/v and on every layer before), so each adapter has a tree of
its own, and an adapter loaded again under a name gets a new one (`forget`). A node's slots are shared by every
request that matched through it (`refs` counts them along the path): they are freed only by eviction, least
recently used leaves first, of nodes no request holds, when the pool runs short. Everything here is host state.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Node:
    tokens: list[int]                     # the edge from the parent: these tokens...
    slots: torch.Tensor                   # ...and their KV slots (int64, host)
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)  # first token -> child
    refs: int = 0                         # requests holding this node's slots (through it or a node below)
    last_use: int = 0


class PrefixCache:
    def __init__(self):
        self._roots: dict[Hashable, Node] = {}
        self._generation: dict[Hashable, int] = {}  # per adapter name: its loads so far
        self._clock = itertools.count(1)
        self.cached = 0     # slots the trees hold
        self.evictable = 0  # of those, slots in nodes no request holds
        self.query_tokens = self.hit_tokens = 0  # prompt tokens of the requests admitted, and those found cached
        # (last use, node) of leaves no request holds, entries going stale as nodes are used, held or removed:
        # checked when popped, so that an eviction costs the leaves it takes, not a walk of the trees
        self._leaves: list[tuple[int, int, Node]] = []
        self._entries = itertools.count()  # (ties of last use: the heap never compares nodes)

    def key(self, adapter: str | None) -> Hashable:
        """The tree of the adapter (None: the base model) as it is loaded now."""
        return adapter, self._generation.get(adapter, 0)

    def match(self, key: Hashable, tokens: list[int]) -> tuple[torch.Tensor, Node | None]:
        """The slots of the longest start of `tokens` the tree holds, and the node it ends at (split there if it
        ended inside an edge); (no slots, None) when it holds none."""
        node, matched, slots = self._roots.get(key), 0, []
        if node is None:
            return torch.empty(0, dtype=torch.int64), None
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            n = _common(child.tokens, tokens[matched:])
            if n < len(child.tokens):
                child = self._split(child, n)
            slots.append(child.slots)
            matched += n
            node = child
        if not matched:
            return torch.empty(0, dtype=torch.int64), None
        return torch.cat(slots), node

    def lock(self, node: Node) -> None:
        """A request holds the node's path (its evictable slots, lock_cost of them, are no longer)."""
        now = next(self._clock)
        while node.parent is not None:
            if node.refs == 0:
                self.evictable -= node.slots.numel()
            node.refs += 1
            node.last_use = now
            node = node.parent

    @staticmethod
    def lock_cost(node: Node) -> int:
        """The evictable slots that lock(node) would take."""
        cost = 0
        while node.parent is not None:
            cost += node.slots.numel() if node.refs == 0 else 0
            node = node.parent
        return cost

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            node.refs -= 1
            if node.refs == 0:
                self.evictable += node.slots.numel()
                self._push(node)
            node = node.parent

    def insert(self, key: Hashable, tokens: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Cache the tokens' slots (a finished request's); returns those of `slots` the tree did not take (it held
        their tokens already, in slots of its own), for the pool."""
        node = self._roots.setdefault(key, Node([], torch.empty(0, dtype=torch.int64)))
        now, done, spare = next(self._clock), 0, []
        while done < len(tokens):
            child = node.children.get(tokens[done])
            if child is None:
                leaf = Node(tokens[done:], slots[done:], node, last_use=now)
                node.children[tokens[done]] = leaf
                self.cached += leaf.slots.numel()
                self.evictable += leaf.slots.numel()
                self._push(leaf)
                break
            n = _common(child.tokens, tokens[done:])
            if n < len(child.tokens):
                child = self._split(child, n)
            mine = slots[done:done + n]
            spare.append(mine[mine != child.slots])  # (a request's cached prefix is the tree's own slots)
            child.last_use = now
            self._push(child)
            done += n
            node = child
        return torch.cat([torch.empty(0, dtype=torch.int64), *spare])

    def evict(self, n: int) -> torch.Tensor:
        """Up to n slots (more when a leaf holds more) of the least recently used leaves no request holds, out of
        the trees, for the pool."""
        freed, count = [], 0
        while count < n and self._leaves:
            last_use, _, leaf = heapq.heappop(self._leaves)
            if leaf.parent is None or leaf.children or leaf.refs or last_use != leaf.last_use:
                continue  # stale: removed, a parent again, held, or used since (then pushed again)
            freed.append(leaf.slots)
            count += leaf.slots.numel()
            self._remove(leaf)
        return torch.cat([torch.empty(0, dtype=torch.int64), *freed])

    def forget(self, adapter: str | None) -> torch.Tensor:
        """The adapter's name is loaded again (or unloaded): new requests get a new tree. Returns the old tree's
        slots that no request holds, for the pool; the rest go once their requests end (evicted as they are)."""
        old = self.key(adapter)
        self._generation[adapter] = old[1] + 1
        root = self._roots.get(old)
        if root is None:
            return torch.empty(0, dtype=torch.int64)
        freed = []
        for node in reversed(list(_below(root))):  # leaves before their parents
            if not node.children and node.refs == 0:
                freed.append(node.slots)
                self._remove(node)
        if not root.children:
            del self._roots[old]
        return torch.cat([torch.empty(0, dtype=torch.int64), *freed])

    def slots(self) -> torch.Tensor:
        """Every slot the trees hold (for the accounting check)."""
        return torch.cat([torch.empty(0, dtype=torch.int64), *(node.slots for node in self._nodes())])

    # --------------------------------------------------------------------------------- internals

    def _nodes(self) -> list[Node]:
        return [node for root in self._roots.values() for node in _below(root)]

    def _split(self, child: Node, n: int) -> Node:
        """Cut the edge to `child` after n tokens: the new node above it, which it returns, holds the first n."""
        top = Node(child.tokens[:n], child.slots[:n], child.parent, {child.tokens[n]: child}, child.refs,
                   child.last_use)
        child.parent.children[child.tokens[0]] = top
        child.tokens, child.slots, child.parent = child.tokens[n:], child.slots[n:], top
        return top

    def _remove(self, leaf: Node) -> None:
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        leaf.parent = None
        self.cached -= leaf.slots.numel()
        self.evictable -= leaf.slots.numel()
        if parent.parent is not None and not parent.children and parent.refs == 0:  # a leaf now
            self._push(parent)

    def _push(self, node: Node) -> None:
        """An evictable leaf's heap entry (checked when popped). Stale entries go once they outnumber the slots."""
        if not node.children and node.refs == 0:
            heapq.heappush(self._leaves, (node.last_use, next(self._entries), node))
        if len(self._leaves) > 2 * self.cached + 64:
            self._leaves = [e for e in self._leaves if e[2].parent is not None and not e[2].children and not e[2].refs
                            and e[0] == e[2].last_use]
            heapq.heapify(self._leaves)


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common start of a and b (a whole edge compared at C speed first: long prompts)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _below(root: Node) -> list[Node]:
    """The nodes under root (not root), parents before children."""
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack += node.children.values()
    return out
