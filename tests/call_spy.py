"""Test spies: record the calls of a module-level function, or the launches of a Triton kernel
(``monkeypatch`` undoes either)."""

from __future__ import annotations


def spy_calls(monkeypatch, module, name: str, log: list) -> None:
    """Wrap ``module.name`` so that each call appends ``(args, kwargs, result)`` to ``log``."""
    real = getattr(module, name)

    def spy(*a, **kw):
        out = real(*a, **kw)
        log.append((a, kw, out))
        return out

    monkeypatch.setattr(module, name, spy)


class LaunchSpy:
    """Stands in for a Triton kernel (``module.kernel = LaunchSpy(module.kernel)``): records each
    launch's keyword arguments (constexprs, ``launch_pdl``) in ``launches`` and runs the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch
