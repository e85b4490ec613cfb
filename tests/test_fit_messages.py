"""A "does not fit" answer names values that fit, and following it fits: pstar-plan's host (and
device) memory where no device memory fits with this host memory, pstar-train's sequence length
where a shorter sequence is the fix, and its memory flags where it is not."""

import re

import pytest

from pstar_jax.cli.plan import main as plan
from pstar_jax.cli.train import main as train

TINY = ["--model", "tiny", "--batch-size", "4", "--no-search"]
HOST_ADAM = ["--adam-placement", "host", "--host-memory", "16KiB"]  # the host updates: host memory it needs


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("device, names_device", [("150KiB", True), ("4MiB", False)])
def test_plan_names_a_host_memory_that_fits_where_no_device_memory_does(capsys, device, names_device):
    """Host-updated optimizer state needs host memory: no device memory fits with 16KiB of it. The
    answer names the least host memory that fits (with the device memory it needs there, unless
    this one does), and planning with the values named fits."""
    assert plan([*TINY, *HOST_ADAM, "--device-memory", device]) == 1
    err = _one_line(capsys)
    named = re.search(r"; it fits with --host-memory (\S+)(?: and --device-memory (\S+))?$", err)
    assert named, err
    assert bool(named[2]) == names_device, err
    assert plan([*TINY, "--adam-placement", "host", "--host-memory", named[1],
                 "--device-memory", named[2] or device]) == 0, capsys.readouterr().err


def test_plan_names_the_host_memory_of_the_whole_host(capsys):
    """--host-memory is shared by --devices-per-host devices: the value named is theirs together."""
    flags = [*TINY, *HOST_ADAM, "--device-memory", "4MiB"]
    assert plan(flags) == 1
    one = re.search(r"--host-memory (\S+)$", _one_line(capsys))[1]
    assert plan([*flags, "--devices-per-host", "4"]) == 1
    four = re.search(r"--host-memory (\S+)$", _one_line(capsys))[1]
    assert plan([*TINY, "--adam-placement", "host", "--device-memory", "4MiB", "--host-memory", four,
                 "--devices-per-host", "4"]) == 0
    from pstar_jax.config import parse_bytes
    assert abs(4 * parse_bytes(one, "") - parse_bytes(four, "")) < parse_bytes(four, "") // 50  # (bisections: 1/256)


TRAIN = ["--model", "tiny", "--batch-size", "2", "--steps", "1", "--data-parallel", "1", "--host-memory", "1GiB",
         "--quiet"]


def test_train_names_a_seq_len_that_fits(capsys):
    """Too long a sequence for 16MiB: the error names a shorter --seq-len (a few traces of the tiny
    model) and the device memory this length needs, in one line; training at that length runs."""
    assert train([*TRAIN, "--seq-len", "1024", "--device-memory", "16MiB"]) == 2
    err = _one_line(capsys)
    assert err.startswith("pstar-train: error: the model does not fit: device memory runs out at"), err
    named = re.search(r"it fits with --seq-len (\d+) \(at this batch\) or with --device-memory (\S+) \(at this "
                      r"length\)$", err)
    assert named, err
    assert 128 <= int(named[1]) < 1024, err
    assert train([*TRAIN, "--seq-len", named[1], "--device-memory", "16MiB"]) == 0, capsys.readouterr().err


def test_train_names_the_memory_where_no_shorter_sequence_fits(capsys):
    """60KiB fits no sequence of the tiny model: the error names the device memory, not --seq-len."""
    assert train([*TRAIN, "--device-memory", "60KiB"]) == 2
    err = _one_line(capsys)
    assert "--seq-len" not in err and re.search(r"; it fits with --device-memory \S+$", err), err
