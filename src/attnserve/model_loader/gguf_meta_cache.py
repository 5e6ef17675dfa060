"""A disk cache of what transformers builds from a GGUF's metadata: the config and the tokenizer.

``AutoConfig.from_pretrained(dir, gguf_file=...)`` and ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)`` each parse the whole metadata section, vocabulary arrays included, and the
tokenizer is then converted to a fast tokenizer. For Gemma 3 270M (262k tokens) on one core
of a 2-core EPYC that was 20 s for the config and 34 s for the tokenizer, paid again by every
engine start and every tensor-parallel rank. The first load saves both with transformers'
own ``save_pretrained`` under ``<cache>/gguf-meta/<key>/{config,tokenizer}``; later loads
read them back with ``from_pretrained`` (well under a second). Nothing is written by hand:
the files are transformers' own formats.

The key is the GGUF's absolute path, size and modification time plus the transformers
version, so a changed file or library builds a fresh entry. An entry is written to a
temporary directory and renamed into place, so a reader never sees half of one; a cache
that cannot be written (read-only home) only costs the parse. ``ATTNSERVE_GGUF_META_CACHE=0``
turns the cache off. The cache root is the loader's (``$ATTNSERVE_CACHE_DIR`` or
``~/.cache/attnserve``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

#: environment variable: ``0`` disables the cache (every load parses the GGUF)
CACHE_ENV = "ATTNSERVE_GGUF_META_CACHE"


def cache_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1").strip() not in ("0", "false", "no", "off")


def entry_dir(gguf_path: str, kind: str, root: Optional[str] = None) -> str:
    """The cache directory of ``kind`` (``config`` / ``tokenizer``) for ``gguf_path``.

    Raises:
        FileNotFoundError: when ``gguf_path`` does not exist.
    """
    import transformers

    from attnserve.model_loader.loader import _cache_dir

    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    name = os.path.basename(path).replace(os.sep, "_")
    return os.path.join(root or _cache_dir(), "gguf-meta", f"{name}-{digest}", kind)


def cached(gguf_path: str, kind: str, build: Callable[[], Any], load: Callable[[str], Any]) -> Any:
    """``load(entry)`` when the entry exists, else ``build()`` saved to the entry and returned.

    Args:
        gguf_path: the GGUF file.
        kind: ``config`` or ``tokenizer`` (the entry's sub-directory).
        build: parses the GGUF (transformers' ``from_pretrained(..., gguf_file=)``).
        load: reads an entry back (``from_pretrained(entry)``).
    """
    if not cache_enabled():
        return build()
    entry = entry_dir(gguf_path, kind)
    if os.path.isdir(entry):
        try:
            return load(entry)
        except Exception as e:  # a damaged entry: rebuild it
            logger.warning("GGUF metadata cache entry %s unreadable (%s: %s); parsing the GGUF", entry,
                           type(e).__name__, e)
            shutil.rmtree(entry, ignore_errors=True)
    obj = build()
    _store(obj, entry)
    return obj


def _store(obj: Any, entry: str) -> None:
    parent = os.path.dirname(entry)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        obj.save_pretrained(tmp)
        os.replace(tmp, entry)
    except OSError as e:  # read-only or full disk, or another process stored it first
        logger.info("GGUF metadata cache not written (%s: %s)", type(e).__name__, e)
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
