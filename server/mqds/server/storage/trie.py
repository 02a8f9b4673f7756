"""The learned topic structure: a trie that maps topics to streams.

Every stored topic walks the trie level by level. A level value the trie has
seen follows its literal edge. When a node already has ``threshold`` distinct
literal children, a new value is not given an edge of its own: the node grows
a wildcard edge ``+`` instead, and that value and all later new ones follow it,
each remembered as a *varying* value of the topic. A ``#`` edge ends each topic;
the node it leads to is the topic's **stream**.

So ``sensor/1/temp`` .. ``sensor/10/temp`` get streams of their own, and with a
threshold of 10 every later ``sensor/<id>/temp`` shares the stream
``sensor/+/temp`` with the id as its varying value, which the index keys make
searchable. A topic's path never changes while its stream exists (a literal
edge is preferred to the wildcard, and edges are only removed with the streams
under them, by ``prune``), so a topic maps to the same stream and varying values.

At the first level, values starting with ``$`` (``$SYS``) never follow the
``+`` edge: they have a threshold of their own (``threshold_top`` literal ``$``
edges) and then a wildcard edge of their own, ``$+``, which only ``$`` values
follow. So a filter starting with a wildcard, which must not match them, can
skip them by looking at edges alone, and the number of first-level edges is
bounded however the topics are chosen. ``$+`` cannot be a literal level (topic
names have no ``+``).

Nothing here recurses on the depth of a topic or filter (MQTT allows 65,535
bytes, so 65,536 levels): walks over levels and nodes use explicit stacks.
Edges can be removed again (``prune``) when the streams under them hold no data
in any generation left; node ids are never handed out twice.

The trie is deterministic: given the same topics in the same order it creates
the same node ids, because ids are handed out in creation order. It is shared
by all generations of a shard and stored in the shard's metadata.

>>> trie = TopicTrie(threshold_top=100, threshold=2)
>>> [trie.learn(f"s/{i}/t".split("/"), []).stream for i in range(4)]
[4, 7, 10, 10]
>>> trie.learn(["s", "3", "t"], []).varying
('3',)
>>> sorted(trie.pattern(s) for s, _ in trie.match("s/#".split("/")))
['s/+/t', 's/0/t', 's/1/t']
>>> trie.match("s/9/t".split("/"))
[(10, {0: '9'})]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

WILDCARD = "+"
DOLLAR_WILDCARD = "$+"
"""The wildcard edge of ``$``-prefixed first levels (``+`` never takes them)."""
END = "#"
_NOT_LITERAL = (WILDCARD, DOLLAR_WILDCARD, END)


@dataclass(frozen=True)
class Learned:
    """Where a topic is stored: its stream and the values of its varying levels."""

    stream: int
    varying: tuple[str, ...]


class TopicTrie:
    """The learned topic structure of one shard.

    ``learn`` may create nodes; it reports each new edge to ``on_new_edge`` so
    the caller can persist it in the same write batch as the messages.
    """

    ROOT = 0

    def __init__(self, threshold_top: int, threshold: int) -> None:
        if threshold_top < 1 or threshold < 1:
            raise ValueError("trie thresholds must be at least 1")
        self.threshold_top = threshold_top
        self.threshold = threshold
        self._children: dict[int, dict[str, int]] = {self.ROOT: {}}
        self._literal_count: dict[int, int] = {self.ROOT: 0}
        self._patterns: dict[int, str] = {}
        self._parent: dict[int, tuple[int, str]] = {}
        self._dollar_count = 0
        """Literal ``$`` edges of the root: a threshold of their own, not in the root's ``_literal_count``."""
        self.next_node = 1

    # -- building ------------------------------------------------------------

    def restore_edge(self, parent: int, token: str, child: int) -> None:
        """Add an edge read back from disk (any order)."""
        self._children.setdefault(parent, {})[token] = child
        self._children.setdefault(child, {})
        self._literal_count.setdefault(child, 0)
        self._parent[child] = (parent, token)
        if token not in _NOT_LITERAL:
            if parent == self.ROOT and token.startswith("$"):
                self._dollar_count += 1
            else:
                self._literal_count[parent] = self._literal_count.get(parent, 0) + 1
        self.next_node = max(self.next_node, child + 1)

    def _remove_edge(self, parent: int, token: str, child: int) -> None:
        del self._children[parent][token]
        del self._children[child]
        del self._literal_count[child]
        del self._parent[child]
        self._patterns.pop(child, None)
        if token not in _NOT_LITERAL:
            if parent == self.ROOT and token.startswith("$"):
                self._dollar_count -= 1
            else:
                self._literal_count[parent] -= 1

    def forget(self, new_edges: list[tuple[int, str, int]]) -> None:
        """Undo edges ``learn`` reported, newest first, when they could not be persisted.

        Node ids are handed out again afterwards, exactly as if the edges had
        never been learned, so the in-memory trie matches what is on disk.
        """
        for parent, token, child in reversed(new_edges):
            self._remove_edge(parent, token, child)
            self.next_node = min(self.next_node, child)

    def prune(self, keep: set[int]) -> list[tuple[int, str, int]]:
        """Remove every stream not in ``keep``, and the nodes that then lead to no stream.

        Returns the removed edges as ``(parent, token, child)``, in a
        deterministic order, for the caller to delete from disk (``restore_edge``
        puts them back). ``next_node`` does not move: removed ids are never
        handed out again, so an old stream id never names a new stream.
        """
        removed: list[tuple[int, str, int]] = []
        for stream in self.streams():
            if stream in keep:
                continue
            node = stream
            while node != self.ROOT and not self._children[node]:
                parent, token = self._parent[node]
                self._remove_edge(parent, token, node)
                removed.append((parent, token, node))
                node = parent
        return removed

    def _add_edge(self, parent: int, token: str, on_new_edge: list[tuple[int, str, int]]) -> int:
        child = self.next_node
        self.next_node += 1
        self.restore_edge(parent, token, child)
        on_new_edge.append((parent, token, child))
        return child

    def learn(self, levels: list[str], new_edges: list[tuple[int, str, int]]) -> Learned:
        """Map a topic (split into levels) to its stream, learning as needed.

        New edges are appended to ``new_edges`` as ``(parent, token, child)``.
        """
        node = self.ROOT
        varying: list[str] = []
        for depth, level in enumerate(levels):
            children = self._children[node]
            nxt = children.get(level)
            if nxt is None:
                if depth == 0 and level.startswith("$"):
                    # Never the '+' edge: a filter starting with a wildcard must not match it.
                    if DOLLAR_WILDCARD in children:
                        nxt = children[DOLLAR_WILDCARD]
                        varying.append(level)
                    elif self._dollar_count < self.threshold_top:
                        nxt = self._add_edge(node, level, new_edges)
                    else:
                        nxt = self._add_edge(node, DOLLAR_WILDCARD, new_edges)
                        varying.append(level)
                elif WILDCARD in children:
                    nxt = children[WILDCARD]
                    varying.append(level)
                elif self._literal_count[node] < (self.threshold_top if depth == 0 else self.threshold):
                    nxt = self._add_edge(node, level, new_edges)
                else:
                    nxt = self._add_edge(node, WILDCARD, new_edges)
                    varying.append(level)
            node = nxt
        stream = self._children[node].get(END)
        if stream is None:
            stream = self._add_edge(node, END, new_edges)
        return Learned(stream, tuple(varying))

    # -- reading -------------------------------------------------------------

    def streams(self) -> list[int]:
        """Every stream id."""
        return sorted(child for child, (_, token) in self._parent.items() if token == END)

    def pattern(self, stream: int) -> str:
        """The topic structure of a stream, e.g. ``sensor/+/temp``."""
        cached = self._patterns.get(stream)
        if cached is not None:
            return cached
        tokens: list[str] = []
        node = stream
        parent, token = self._parent[node]
        if token != END:
            raise KeyError(f"node {stream} is not a stream")
        node = parent
        while node != self.ROOT:
            parent, token = self._parent[node]
            tokens.append(token)
            node = parent
        pattern = "/".join(reversed(tokens))
        self._patterns[stream] = pattern
        return pattern

    def is_stream(self, stream: int) -> bool:
        entry = self._parent.get(stream)
        return entry is not None and entry[1] == END

    def match(self, filter_levels: list[str]) -> list[tuple[int, dict[int, str]]]:
        """The streams that may hold topics matching a valid filter.

        Each comes with its constraints: varying-level index -> the literal
        value the filter requires there (what the index can look up).
        """
        found: list[tuple[int, dict[int, str]]] = []
        n_levels = len(filter_levels)
        skip_dollar = filter_levels[0] in ("+", "#")
        # Depth first with an explicit stack (a filter may have 65,536
        # levels), children pushed in reverse so streams come out in the order
        # a recursive walk over the children in insertion order gives.
        stack: list[tuple[int, int, dict[int, str], int]] = [(self.ROOT, 0, {}, 0)]
        while stack:
            node, depth, constraints, n_varying = stack.pop()
            children = self._children[node]
            if depth == n_levels:
                end = children.get(END)
                if end is not None:
                    found.append((end, constraints))
                continue
            level = filter_levels[depth]
            if level == "#":
                found.extend(
                    (stream, constraints) for stream in self._subtree_streams(node, skip_dollar and depth == 0)
                )
                continue
            nexts: list[tuple[int, int, dict[int, str], int]] = []
            for token, child in children.items():
                if token == END:
                    continue
                if token in (WILDCARD, DOLLAR_WILDCARD):
                    if level == "+":
                        # A leading '+' does not match '$' levels: skip '$+'.
                        if token == WILDCARD or not skip_dollar:
                            nexts.append((child, depth + 1, constraints, n_varying + 1))
                    elif token == WILDCARD or level.startswith("$"):
                        nexts.append((child, depth + 1, {**constraints, n_varying: level}, n_varying + 1))
                elif (level == "+" and not (skip_dollar and depth == 0 and token.startswith("$"))) or token == level:
                    nexts.append((child, depth + 1, constraints, n_varying))
            stack.extend(reversed(nexts))
        return found

    def _subtree_streams(self, node: int, skip_dollar: bool) -> Iterator[int]:
        stack = [node]
        first = True
        while stack:
            current = stack.pop()
            for token, child in self._children[current].items():
                if token == END:
                    yield child
                elif not (first and skip_dollar and token.startswith("$")):
                    stack.append(child)
            first = False


def filter_constraints(pattern: str, filter_levels: list[str]) -> dict[int, str] | None:
    """Match a filter against a stream's pattern.

    Returns None when no topic of the stream can match, else the constraints
    on the stream's varying levels (varying-level index -> required value).

    >>> filter_constraints("sensor/+/temp", "sensor/42/#".split("/"))
    {0: '42'}
    >>> filter_constraints("sensor/+/temp", "sensor/+/hum".split("/")) is None
    True
    >>> filter_constraints("a", "a/#".split("/"))
    {}
    >>> filter_constraints("$SYS/x", "#".split("/")) is None
    True
    >>> filter_constraints("$+/x", "$SYS/x".split("/"))
    {0: '$SYS'}
    """
    tokens = pattern.split("/")
    if filter_levels[0] in ("+", "#") and tokens[0].startswith("$"):
        return None
    constraints: dict[int, str] = {}
    n_varying = 0
    for depth, level in enumerate(filter_levels):
        if level == "#":
            return constraints
        if depth >= len(tokens):
            return None
        token = tokens[depth]
        if token in (WILDCARD, DOLLAR_WILDCARD):
            if level != "+":
                if token == DOLLAR_WILDCARD and not level.startswith("$"):
                    return None
                constraints[n_varying] = level
            n_varying += 1
        elif level != "+" and level != token:
            return None
    return constraints if len(filter_levels) == len(tokens) else None
