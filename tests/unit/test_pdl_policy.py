"""`attnserve.pdl`: when kernels are launched with programmatic dependent launch."""

import pytest
import torch

from attnserve import pdl


def test_never_on_cpu(monkeypatch):
    monkeypatch.setenv("ATTNSERVE_PDL", "1")
    assert not pdl.pdl_supported(torch.device("cpu"))
    assert not pdl.pdl_enabled(torch.device("cpu"))


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("on", True), ("0", False),
                                            ("false", False), (" OFF ", False), ("no", False)])
def test_env_switch(monkeypatch, value, expected):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)  # as on a Hopper GPU
    if value is None:
        monkeypatch.delenv("ATTNSERVE_PDL", raising=False)
    else:
        monkeypatch.setenv("ATTNSERVE_PDL", value)
    assert pdl.pdl_enabled(torch.device("cuda")) is expected


def test_unsupported_wins_over_env(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: False)
    monkeypatch.setenv("ATTNSERVE_PDL", "1")
    assert pdl.pdl_enabled(torch.device("cuda")) is False
