"""`env_bytes` (sizes from environment variables in units, and the errors of bad values) and
`env_flag` (on/off switches)."""

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


def test_env_flag(monkeypatch):
    from attnserve.env_options import env_flag

    monkeypatch.delenv("X_SWITCH", raising=False)
    assert env_flag("X_SWITCH")
    for off in ("0", "false", " OFF ", "No"):
        monkeypatch.setenv("X_SWITCH", off)
        assert not env_flag("X_SWITCH"), off
    for on in ("1", "yes", "on", ""):
        monkeypatch.setenv("X_SWITCH", on)
        assert env_flag("X_SWITCH"), on
    # an opt-in switch: off while unset or empty, on when set to anything but an off value
    for unset in (None, "", "  "):
        if unset is None:
            monkeypatch.delenv("X_SWITCH", raising=False)
        else:
            monkeypatch.setenv("X_SWITCH", unset)
        assert not env_flag("X_SWITCH", default=False), unset
    monkeypatch.setenv("X_SWITCH", "1")
    assert env_flag("X_SWITCH", default=False)
    monkeypatch.setenv("X_SWITCH", "off")
    assert not env_flag("X_SWITCH", default=False)


def test_env_int(monkeypatch):
    from attnserve.env_options import env_int

    monkeypatch.delenv("ATTNSERVE_TEST_INT", raising=False)
    assert env_int("ATTNSERVE_TEST_INT", 7, 0, 10) == 7
    monkeypatch.setenv("ATTNSERVE_TEST_INT", " ")
    assert env_int("ATTNSERVE_TEST_INT", 7, 0, 10) == 7
    for raw, want in (("0", 0), ("10", 10), (" 3 ", 3)):
        monkeypatch.setenv("ATTNSERVE_TEST_INT", raw)
        assert env_int("ATTNSERVE_TEST_INT", 7, 0, 10) == want
    for raw in ("11", "-1", "2.5", "x"):
        monkeypatch.setenv("ATTNSERVE_TEST_INT", raw)
        with pytest.raises(ValueError, match=r"ATTNSERVE_TEST_INT=.*0\.\.10 \(what it means\)"):
            env_int("ATTNSERVE_TEST_INT", 7, 0, 10, "what it means")
