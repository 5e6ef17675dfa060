"""`env_bytes`: sizes from environment variables in units, and the errors of bad values."""

import pytest

from attnserve.env_options import env_bytes


def test_env_bytes_units_and_errors():
    assert env_bytes("X", 1 << 20, environ={}) is None
    assert env_bytes("X", 1 << 20, environ={"X": "  "}) is None
    assert env_bytes("X", 1 << 20, environ={"X": "1.5"}) == 3 << 19
    assert env_bytes("X", 1 << 10, environ={"X": "0"}) == 0
    with pytest.raises(ValueError, match=r"X='0': expected a number > 0 of MiB"):
        env_bytes("X", 1 << 20, positive=True, environ={"X": "0"})
    for bad in ("-1", "nan", "lots"):
        with pytest.raises(ValueError, match="X=.*>= 0 of KiB"):
            env_bytes("X", 1 << 10, environ={"X": bad})
