"""Walking an autograd graph: its nodes, each once, and its leaf tensors.

A node's Python object may be made anew at each access and freed after, and a freed object's
id is reused: a walk that remembers nodes by bare ``id()`` takes a new node for one it has
seen and skips it (torch 2.6 and 2.11 found no leaves that way). The walk here keeps every
node it has seen alive until it ends.
"""

from __future__ import annotations

import collections
from typing import Iterator

import torch


def graph_nodes(root: torch.autograd.graph.Node | None,
                limit: int | None = None) -> Iterator[torch.autograd.graph.Node]:
    """The nodes under ``root`` (a tensor's ``grad_fn``), each once, breadth-first; at most
    ``limit`` of them when given. The graph's structure outlives ``backward()``."""
    seen: dict[int, torch.autograd.graph.Node] = {}  # (kept alive: see the module docstring)
    queue: collections.deque[torch.autograd.graph.Node | None] = collections.deque([root])
    while queue and (limit is None or len(seen) < limit):
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        for child, _index in node.next_functions:
            queue.append(child)


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` nodes) of ``loss``'s autograd graph, each once, in
    breadth-first order from the loss."""
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()  # (the leaves themselves are kept in ``leaves``)
    for node in graph_nodes(loss.grad_fn):
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in seen:
            seen.add(id(variable))
            leaves.append(variable)
    return leaves


__all__ = ["graph_leaves", "graph_nodes"]
