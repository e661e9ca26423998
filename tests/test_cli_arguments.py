"""`mirrax train` / `mirrax devices` arguments that parse but mean nothing are refused (exit 2)."""

import pytest

from mirrax._src.cli.main import main


@pytest.mark.parametrize(
    "args, message",
    [
        # A zero, negative or NaN learning rate trained nothing (or climbed the loss) in silence.
        (["train", "--lr", "0"], "argument --lr: expected a finite number > 0 (e.g. 1e-3), received '0'"),
        (["train", "--lr=-1e-3"], "received '-1e-3'"),
        (["train", "--lr", "nan"], "received 'nan'"),
        (
            ["train", "--lr", "fast"],
            "argument --lr: expected a finite number > 0 (e.g. 1e-3), received 'fast'",
        ),
        (["train", "--seed", "-1"], "argument --seed: expected an integer >= 0, received '-1'"),
        (["train", "--epochs", "2.5"], "argument --epochs: expected a positive integer, received '2.5'"),
        (["devices", "--cpu-devices", "0"], "expected a positive integer, received '0'"),
    ],
)
def test_meaningless_numbers_exit_2_naming_the_value(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tensorboard_naming_a_file_exits_2(capsys, tmp_path):
    log = tmp_path / "events.txt"
    log.write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--tensorboard", str(log)])
    assert exit_info.value.code == 2
    assert f"--tensorboard {log} is a file, not a folder" in capsys.readouterr().err
