"""Compare two trees of PTX files by instruction stream (no GPU needed).

``python scripts/ptx_compare.py BEFORE_DIR AFTER_DIR``

For every ``*.ptx`` name present in either directory, strips what a pure source refactor may
change without changing the code: ``.loc`` / ``.file`` directives, ``//`` comments, the
``.section .debug_*`` blocks, the ``$L__tmp`` labels that only the debug info refers to and
blank lines, then compares the rest line by line (PTX ISA,
"Debugging directives"). Prints ``identical`` / ``DIFFERENT (first differing line)`` /
``missing`` per file and exits 1 if any file differs or is missing. Write the trees with an
offline compile script's ``--dump`` (e.g. ``scripts/prefill_gluon_offline.py``) before and after
the change.
"""

from __future__ import annotations

import os
import re
import sys
from typing import List


def instruction_stream(ptx: str) -> List[str]:
    """The PTX's lines without debug directives, debug sections, comments and blank lines."""
    ptx = re.sub(r"\.section\s+\.debug_\w+\s*\{[^{}]*\}", "", ptx)
    out = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].strip()
        if line and not line.startswith((".loc", ".file")) and not re.fullmatch(r"\$L__tmp\d+:", line):
            out.append(line)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1])
        return 2
    before, after = argv
    names = sorted({n for d in (before, after) for n in os.listdir(d) if n.endswith(".ptx")})
    bad = 0
    for n in names:
        pa, pb = os.path.join(before, n), os.path.join(after, n)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            print(f"{n}: missing in {'before' if not os.path.exists(pa) else 'after'}")
            bad += 1
            continue
        a, b = instruction_stream(open(pa).read()), instruction_stream(open(pb).read())
        if a == b:
            print(f"{n}: identical ({len(a)} lines)")
            continue
        bad += 1
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"{n}: DIFFERENT at line {i} ({len(a)} vs {len(b)} lines): {a[i:i + 1]} vs {b[i:i + 1]}")
    print(f"{len(names) - bad} identical, {bad} different or missing")
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
