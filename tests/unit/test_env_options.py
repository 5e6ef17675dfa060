"""`env_bytes` (sizes from environment variables in units, and the errors of bad values),
`env_flag` (on/off switches), `env_int` and `env_float` (numbers in a range)."""

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


@pytest.mark.parametrize("kind", ["int", "float"])
def test_env_int_and_float(kind, monkeypatch):
    from attnserve.env_options import env_float, env_int

    fn, good, bad, rng = {
        "int": (env_int, (("0", 0), ("10", 10), (" 3 ", 3)), ("11", "-1", "2.5", "x"), r"0\.\.10"),
        "float": (env_float, (("0", 0.0), (" 1.25 ", 1.25), ("10", 10.0)), ("10.01", "-0.1", "nan", "x"),
                  r"0\.\.10"),
    }[kind]
    monkeypatch.delenv("ATTNSERVE_TEST_NUM", raising=False)
    assert fn("ATTNSERVE_TEST_NUM", 7, 0, 10) == 7
    monkeypatch.setenv("ATTNSERVE_TEST_NUM", " ")
    assert fn("ATTNSERVE_TEST_NUM", 7, 0, 10) == 7
    for raw, want in good:
        monkeypatch.setenv("ATTNSERVE_TEST_NUM", raw)
        assert fn("ATTNSERVE_TEST_NUM", 7, 0, 10) == want
    for raw in bad:
        monkeypatch.setenv("ATTNSERVE_TEST_NUM", raw)
        with pytest.raises(ValueError, match=rf"ATTNSERVE_TEST_NUM=.*{rng} \(what it means\)"):
            fn("ATTNSERVE_TEST_NUM", 7, 0, 10, "what it means")


def test_ragged_factor_from_env(monkeypatch):
    """The triton backend's ragged factor: the module default unless the variable names another."""
    from attnserve.attention.triton_ops import decode_splits

    monkeypatch.delenv(decode_splits.RAGGED_FACTOR_ENV, raising=False)
    assert decode_splits.ragged_factor_from_env() == decode_splits._RAGGED_FACTOR
    monkeypatch.setenv(decode_splits.RAGGED_FACTOR_ENV, "1.0")
    assert decode_splits.ragged_factor_from_env() == 1.0
    monkeypatch.setenv(decode_splits.RAGGED_FACTOR_ENV, "-1")
    with pytest.raises(ValueError, match="ATTNSERVE_DECODE_RAGGED_FACTOR"):
        decode_splits.ragged_factor_from_env()
