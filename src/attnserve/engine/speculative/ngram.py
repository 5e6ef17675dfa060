"""NGRAM drafting: propose a draft tree from the request's own tokens.

The idea is *prompt lookup decoding* (A. Saxena, 2023,
https://github.com/apoorvumang/prompt-lookup-decoding), as generalised to trees by
SGLang's ``--speculative-algorithm NGRAM``: when the last ``w`` tokens of a sequence
occurred earlier in it, the tokens that followed that earlier occurrence are a good guess
for what comes next (edits, summaries, code, quoting). Here only the request's own prompt
and output are searched (no cross-request cache); the flags keep SGLang's names.

`NgramIndex` holds one request's tokens and a dict from every ``w``-gram, ``w`` in
``[min_match_window, max_match_window]``, to the positions that follow its occurrences
(ascending). Appending a token adds one entry per window (keyed by the gram's int64 bytes,
at most ``max_match_window`` tokens), so `NgramIndex.extend` costs ``O(k * (max - min +
1))`` dict operations for ``k`` tokens whatever the length, and the occurrences of a
suffix window are one lookup away (then ``O(matches)`` to read them).

`NgramDrafter.propose` ranks and merges the continuations into a `DraftTree` (its doc
gives the exact rule).
"""

from __future__ import annotations

from array import array
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from attnserve.engine.speculative.tree import DraftTree


class NgramDrafter:
    """The NGRAM drafting settings and the drafting rule (module doc).

    Args:
        min_match_window / max_match_window: suffix window sizes tried, in tokens
            (``--speculative-ngram-{min,max}-match-window-size``); ``1 <= min <= max``.
        num_draft_tokens: most nodes of a draft tree, root included
            (``--speculative-num-draft-tokens``); ``>= 1``.
        max_bfs_breadth: most nodes kept at each depth of the tree
            (``--speculative-ngram-max-bfs-breadth``); ``>= 1``, 1 gives chains.

    Raises:
        ValueError: a setting out of range; the message names its flag.
    """

    def __init__(self, min_match_window: int = 1, max_match_window: int = 12, num_draft_tokens: int = 8,
                 max_bfs_breadth: int = 8):
        if min_match_window < 1:
            raise ValueError(f"--speculative-ngram-min-match-window-size must be >= 1, got {min_match_window}")
        if max_match_window < min_match_window:
            raise ValueError(f"--speculative-ngram-max-match-window-size must be >= "
                             f"--speculative-ngram-min-match-window-size, got {max_match_window} < {min_match_window}")
        if num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {num_draft_tokens}")
        if max_bfs_breadth < 1:
            raise ValueError(f"--speculative-ngram-max-bfs-breadth must be >= 1, got {max_bfs_breadth}")
        self.min_match_window = int(min_match_window)
        self.max_match_window = int(max_match_window)
        self.num_draft_tokens = int(num_draft_tokens)
        self.max_bfs_breadth = int(max_bfs_breadth)
        #: earlier occurrences read per proposal ("enough"): a fixed number, so a smaller
        #: ``max_nodes`` gives a prefix of the same tree
        self.max_matches = self.max_bfs_breadth * max(1, self.num_draft_tokens - 1)

    def propose(self, index: "NgramIndex", max_nodes: Optional[int] = None) -> DraftTree:
        """The draft tree after ``index``'s tokens (host ints; deterministic).

        Node 0 is the last token. Matching: for ``w`` from ``max_match_window`` down to
        ``min_match_window``, the earlier occurrences of the last ``w`` tokens (their
        continuation starting before the end) are read most recent first, each position
        once (under the longest window it matches), until ``max_matches`` are read. Each
        contributes its continuation, up to ``num_draft_tokens - 1`` tokens (fewer where
        the sequence ends), merged into a trie under the root.

        Emission: breadth first, depth by depth, from the children of the nodes kept at
        the previous depth, at most ``max_bfs_breadth`` per depth and
        ``min(num_draft_tokens, max_nodes)`` in all, root included. Priority among the
        candidates of one depth (also their node order): the longest window among the
        matches through the node, then the number of matches through it, then its most
        recent match (largest position). That order is total, so ``propose(i, m) ==
        propose(i).truncated(m)``.

        Args:
            index: the request's `NgramIndex` (built with these windows).
            max_nodes: a further bound on the nodes (values below 1 count as 1).

        Returns:
            A `DraftTree`; the root alone when nothing matches.

        Raises:
            ValueError: ``index`` is empty (no root) or was built with other windows.
        """
        toks = index.tokens
        if not toks:
            raise ValueError("an empty sequence has no root token to draft from")
        if (index.min_match_window, index.max_match_window) != (self.min_match_window, self.max_match_window):
            raise ValueError("the NgramIndex was built with other match windows than this drafter's")
        budget = self.num_draft_tokens if max_nodes is None else max(1, min(self.num_draft_tokens, int(max_nodes)))
        root = DraftTree((toks[-1],), (-1,))
        if budget == 1:
            return root
        # trie over the continuations: token, children and rank key (-window, -count, -recent)
        tok, kids, rank = [toks[-1]], [{}], [[0, 0, 0]]
        for w, p in self._matches(index):
            node = 0
            for t in toks[p: p + budget - 1]:
                child = kids[node].get(t)
                if child is None:  # windows come longest first: the first match has the longest
                    child = kids[node][t] = len(tok)
                    tok.append(t)
                    kids.append({})
                    rank.append([-w, 0, -p])
                rank[child][1] -= 1
                rank[child][2] = min(rank[child][2], -p)
                node = child
        out_tokens, out_parents = [tok[0]], [-1]
        level = [(0, 0)]  # (trie node, emitted index)
        while level and len(out_tokens) < budget:
            cands = [(c, i) for n, i in level for c in kids[n].values()]
            cands.sort(key=lambda ci: rank[ci[0]])
            level = []
            for c, parent in cands[: min(self.max_bfs_breadth, budget - len(out_tokens))]:
                level.append((c, len(out_tokens)))
                out_tokens.append(tok[c])
                out_parents.append(parent)
        return DraftTree(tuple(out_tokens), tuple(out_parents))

    def _matches(self, index: "NgramIndex") -> Iterator[Tuple[int, int]]:
        """``(window, position)`` of the earlier occurrences (module doc): longest window
        first, most recent first, each position once, at most ``max_matches``."""
        seen, end = set(), len(index)
        for w, positions in index._windows():
            for p in reversed(positions):
                if p < end and p not in seen:
                    seen.add(p)
                    yield w, p
                    if len(seen) >= self.max_matches:
                        return


class NgramIndex:
    """One request's tokens and their n-gram index (module doc), grown by `extend`.

    Args:
        drafter: gives the windows (``min_match_window``, ``max_match_window``).
        tokens: the initial tokens (prompt, or prompt + output), ints.
    """

    def __init__(self, drafter: NgramDrafter, tokens: Iterable[int] = ()):
        self.min_match_window = drafter.min_match_window
        self.max_match_window = drafter.max_match_window
        self.tokens: List[int] = []
        # the same tokens as int64, for bytes keys: w-gram bytes -> the position p after its
        # one occurrence (an int) or after each (an ascending int64 array); bytes, ints and
        # arrays are not tracked by the garbage collector, so a long index costs it nothing
        self._buf = array("q")
        self._grams: Dict[bytes, Union[int, array]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append ``new_tokens`` (ints, in order) and index the grams ending at each;
        ``O(len(new_tokens) * (max_match_window - min_match_window + 1))`` dict operations."""
        buf, grams, lo, hi = self._buf, self._grams, self.min_match_window, self.max_match_window
        for t in new_tokens:
            self.tokens.append(int(t))
            buf.append(self.tokens[-1])
            p = len(buf)  # the continuation after the grams ending here starts at p
            for w in range(lo, min(hi, p) + 1):
                key = buf[p - w:].tobytes()
                positions = grams.get(key)
                if positions is None:
                    grams[key] = p
                elif type(positions) is int:
                    grams[key] = array("q", (positions, p))
                else:
                    positions.append(p)

    def _windows(self) -> List[Tuple[int, Sequence[int]]]:
        """``(w, positions)`` of the suffix ``w``-gram for each window ``w <= len(self)``,
        longest first; ``positions`` (ascending, shared: do not modify) end with ``len(self)``."""
        buf, end, out = self._buf, len(self._buf), []
        for w in range(min(self.max_match_window, end), self.min_match_window - 1, -1):
            positions = self._grams[buf[end - w:].tobytes()]
            out.append((w, (positions,) if type(positions) is int else positions))
        return out

    def occurrences(self, window: int) -> List[int]:
        """Positions ``p < len(self)`` (ascending) where ``tokens[p - window:p]`` equals the
        last ``window`` tokens, i.e. where a continuation of that suffix starts; empty for
        a window outside ``[min_match_window, max_match_window]``. ``O(window + matches)``."""
        for w, positions in self._windows():
            if w == window:
                return list(positions[:-1])
        return []
