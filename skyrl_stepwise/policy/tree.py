"""Prefix-tree packing (`trainer.packing=tree`): every distinct prefix of a micro-batch is forwarded once.

The samples of a micro-batch (step-wise, merged or both) become a token trie: a token is a node, and two samples
share a node exactly when they share the whole prefix up to and including it (a GRPO group's prompt, the history
step k+1 re-reads from step k, a tool-schema system prompt every prompt starts with). The packed row holds the
nodes in depth-first preorder, so each node's subtree is the contiguous range [node, subtree_end[node]) and

    query q attends to key k  <=>  k <= q < subtree_end[k]       (k is q or one of its ancestors)

which policy/packing/masks.py turns into the mask each attention takes (dense bool for sdpa, additive for eager, a
flex_attention BlockMask on GPUs), with each layer type's sliding window measured in depth.
Position ids are depths, so every node sees the RoPE positions and the context it has in its own samples: its
hidden state is the one each of those samples would compute alone.

Every sample keeps its own copies of its response tokens' logprobs: response token j of a sample is predicted by
the logits of the node of the token before it (its parent), gathered once per sample. A node several samples
train is therefore trained once per sample, exactly as the step-wise loss counts it, and the loss code, metrics
and gradients are those of the same samples packed as plain rows (tests/test_tree.py checks both on SmolLM2).

Memory: the dense mask is T x T booleans for a row of T nodes (16 MiB at T = 4096, 64 MiB at 8192), built once per
micro-batch and shared by all layers; `tree_units` keeps T <= trainer.micro_batch_tokens unless a single sample is
longer, by splitting a prompt group whose trie alone exceeds the budget. flex_attention's BlockMask is (T/128)^2.
Architectures that carry a state along the row (recurrent / linear-attention layers) cannot share prefixes this
way: policy/packing/layout.py refuses the tree for them at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenTrie:
    """A forest of token tries in depth-first preorder (first-seen children first).

    `sample_nodes[s][i]` is the node of token i of sequence s; `subtree_end[n]` is one past the last node of n's
    subtree, so n's descendants are exactly the nodes in (n, subtree_end[n]).
    """

    tokens: list[int]
    parents: list[int]  # -1 for a root
    depths: list[int]
    subtree_end: list[int]
    sample_nodes: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)


def build_trie(sequences: list[list[int]]) -> TokenTrie:
    """The trie of these token sequences: one node per distinct prefix, numbered in depth-first preorder.

    Preorder makes every subtree a contiguous range, which is what lets one `subtree_end` per node describe the
    whole ancestor mask (and what makes flex_attention's block mask sparse: a branch is a block of its own).
    """
    roots: dict[int, int] = {}
    children: list[dict[int, int]] = []
    tokens: list[int] = []
    paths: list[list[int]] = []
    for seq in sequences:  # insertion: provisional ids in first-seen order
        level, path = roots, []
        for tok in seq:
            node = level.get(tok)
            if node is None:
                node = level[tok] = len(tokens)
                tokens.append(tok)
                children.append({})
            path.append(node)
            level = children[node]
        paths.append(path)
    n = len(tokens)
    new_id, order = [0] * n, []
    parents, depths = [-1] * n, [0] * n
    stack = [(r, -1, 0) for r in reversed(roots.values())]
    while stack:  # iterative DFS: a long chain would overflow Python's recursion limit
        node, parent, depth = stack.pop()
        new_id[node] = len(order)
        parents[len(order)], depths[len(order)] = parent, depth
        order.append(node)
        stack.extend((c, new_id[node], depth + 1) for c in reversed(children[node].values()))
    size = [1] * n
    for i in range(n - 1, -1, -1):  # children come after their parent in preorder
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    return TokenTrie(tokens=[tokens[o] for o in order], parents=parents, depths=depths,
                     subtree_end=[i + size[i] for i in range(n)],
                     sample_nodes=[[new_id[p] for p in path] for path in paths])


class PrefixCounter:
    """The distinct prefixes seen so far, to price a set of sequences by the nodes it would add to a row.

    Scheduling needs the marginal cost of a prompt group in a micro-batch (its shared system prompt is already
    there), not its own size; a flat {(parent, token): node} dict is enough for that.
    """

    def __init__(self) -> None:
        self.nodes: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def new_nodes(self, sequences: list[list[int]], limit: int | None = None, add: bool = False) -> int:
        """How many nodes these sequences add (stops counting past `limit`); `add=True` keeps them."""
        overlay: dict[tuple[int, int], int] = {}
        count = 0
        for seq in sequences:
            node = -1
            for tok in seq:
                key = (node, tok)
                nxt = self.nodes.get(key)
                if nxt is None:
                    nxt = overlay.get(key)
                if nxt is None:
                    nxt = overlay[key] = len(self.nodes) + len(overlay)
                    count += 1
                    if limit is not None and count > limit:
                        return count
                node = nxt
        if add:
            self.nodes.update(overlay)
        return count


def unique_tokens(sequences: list[list[int]]) -> int:
    """Distinct prefixes of these sequences: what a single tree row forwards for them."""
    return PrefixCounter().new_nodes(sequences)


def tree_units(sequences: list[list[int]], groups: list[str], max_tokens: int) -> tuple[list[list[int]], int]:
    """Scheduling units (sample indices): whole prompt groups, in first-seen order, and the number of groups split.

    A group's samples share the most, so a group stays together (in one micro-batch on one rank). A group whose
    trie alone exceeds `max_tokens` is cut, in sample order, into consecutive runs whose tries fit (a step's
    chain mostly stays together): that keeps the T x T mask bounded by the budget, or by one over-long sample.
    """
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    units: list[list[int]] = []
    split = 0
    for members in by_group.values():
        counter, current, pieces = PrefixCounter(), [], 1
        for i in members:
            room = max_tokens - len(counter)
            if current and counter.new_nodes([sequences[i]], limit=room) > room:
                units.append(current)
                counter, current, pieces = PrefixCounter(), [], pieces + 1
            counter.new_nodes([sequences[i]], add=True)
            current.append(i)
        units.append(current)
        split += pieces > 1
    return units, split


def pack_units(sequences: list[list[int]], units: list[list[int]], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of units (indices into `units`), priced by the nodes each adds to the bin's trie.

    A unit that shares a prefix with a bin (the same system prompt and tool schemas) costs only its new nodes, so
    the budget counts every node once. A unit over the budget gets a bin of its own.
    """
    sizes = [unique_tokens([sequences[i] for i in u]) for u in units]
    bins: list[list[int]] = []
    counters: list[PrefixCounter] = []
    for u in sorted(range(len(units)), key=lambda u: (-sizes[u], u)):
        seqs = [sequences[i] for i in units[u]]
        for k, counter in enumerate(counters):
            room = max_tokens - len(counter)
            if counter.new_nodes(seqs, limit=room) <= room:
                counter.new_nodes(seqs, add=True)
                bins[k].append(u)
                break
        else:
            counter = PrefixCounter()
            counter.new_nodes(seqs, add=True)
            counters.append(counter)
            bins.append([u])
    return [sorted(b) for b in bins]
