"""Record the calls of a module-level function in a test (``monkeypatch`` undoes it)."""

from __future__ import annotations


def spy_calls(monkeypatch, module, name: str, log: list) -> None:
    """Wrap ``module.name`` so that each call appends ``(args, kwargs, result)`` to ``log``."""
    real = getattr(module, name)

    def spy(*a, **kw):
        out = real(*a, **kw)
        log.append((a, kw, out))
        return out

    monkeypatch.setattr(module, name, spy)
