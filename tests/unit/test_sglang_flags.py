"""SGLang launch flags on attnserve's command line (`attnserve.sglang_flags`, `attnserve.cli`):
each is taken where attnserve already does what it asks and refused, naming the flag and what
to do instead, everywhere else; ``--schedule-conservativeness`` is implemented."""

import pytest

from attnserve.cli import build_parser
from attnserve.engine.schedule_policy import AdmissionPolicy
from attnserve.server_args import ServerArgs
from attnserve.sglang_flags import SGLANG_FLAGS


def _parse(*argv, command="serve"):
    return build_parser().parse_args([command, *argv])


def _refused(capsys, *argv, command="serve"):
    with pytest.raises(SystemExit) as e:
        _parse(*argv, command=command)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag", SGLANG_FLAGS, ids=lambda f: f.names[0])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_each_flag_is_taken_or_refused_with_its_reason(capsys, flag, command):
    name = flag.names[0]
    for value in flag.accepted if flag.takes_value else ():
        ns = _parse(name, value, command=command)
        assert ServerArgs.from_cli_args(ns) == ServerArgs.from_cli_args(_parse(command=command))
    if not flag.takes_value and flag.accepted:
        assert ServerArgs.from_cli_args(_parse(name, command=command)) == ServerArgs.from_cli_args(
            _parse(command=command))
        return
    argv = [name, "7"] if flag.takes_value else [name]
    err = _refused(capsys, *argv, command=command)
    assert name in err and flag.reason in err


def test_refusal_messages_say_what_to_do(capsys):
    err = _refused(capsys, "--enable-torch-compile")
    assert "CUDA graphs" in err and "drop the flag" in err
    err = _refused(capsys, "--stream-interval", "8")
    assert "--stream-interval 8" in err and "only --stream-interval 1" in err
    assert "CUDA_VISIBLE_DEVICES" in _refused(capsys, "--base-gpu-id", "2")
    assert "--chunked-prefill-size" in _refused(capsys, "--max-prefill-tokens", "16384")


def test_sglang_command_line_parses():
    ns = _parse("--model-path", "llama-tiny", "--tp", "2", "--host", "0.0.0.0", "--port", "30000",
                "--mem-fraction-static", "0.8", "--enable-metrics", "--enable-cache-report", "--stream-interval", "1",
                "--grammar-backend", "xgrammar", "--sampling-backend", "pytorch", "--schedule-conservativeness", "1.3",
                "--log-level-http", "warning")
    sa = ServerArgs.from_cli_args(ns)
    assert (sa.model, sa.tp_size, sa.mem_fraction_static, sa.schedule_conservativeness) == ("llama-tiny", 2, 0.8, 1.3)
    assert ns.log_level_http == "warning" and not any(k.startswith("_sglang_") for k in vars(ns))


def test_schedule_conservativeness_scales_the_admission_estimate():
    assert AdmissionPolicy.for_conservativeness(1.0) == AdmissionPolicy()
    high, low = AdmissionPolicy.for_conservativeness(2.0), AdmissionPolicy.for_conservativeness(0.5)
    assert high.init_ratio == 1.0 and high.min_ratio == pytest.approx(0.14)
    assert low.init_ratio == pytest.approx(0.35) and low.min_ratio == pytest.approx(0.049)
    assert high.decay > 0 and low.decay > 0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--schedule-conservativeness"):
            ServerArgs(schedule_conservativeness=bad).check()
