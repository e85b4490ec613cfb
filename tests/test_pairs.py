"""A preference file's rows as whole pairs (pstar_jax.data.pairs): what pstar-tokens --preference
writes passes (tests/test_preference.py checks every file it makes), and a file whose rows or
sidecar break the pair layout stops pstar-train --objective dpo in one line naming the file and the
row, before a model is built."""

import numpy as np
import pytest

from pstar_jax.config.errors import DataError
from pstar_jax.data.pairs import check_pairs
from pstar_jax.data.packing import PackedRows, load_packed, write_packed
from test_preference_training import preference_file


def damaged(tmp_path, change):
    """A preference file of 8 rows of 2 pairs each (segments 1 to 4), its arrays or sidecar changed."""
    rows = load_packed(preference_file(tmp_path / "good.sft.u16.bin", n_rows=8))
    tokens, segments, labels = (np.array(a) for a in (rows.tokens, rows.segments, rows.labels))
    info = {k: rows.info[k] for k in ("vocab_size", "preference", "pairs")}
    change(segments, labels, info, *([tokens] if change.__code__.co_argcount == 4 else []))
    path = tmp_path / "bad.sft.u16.bin"
    write_packed(path, PackedRows(tokens, segments, labels), info)
    return path


def drop_last_rejected(segments, labels, info):  # row 5's pair 2 loses its rejected answer to padding
    where = segments[5] == 4
    segments[5, where], labels[5, where] = 0, 0


def untrain_rejected(segments, labels, info):  # row 3's first rejected answer has no completion labelled
    labels[3, segments[3] == 2] = 0


def swap_chosen_and_rejected(segments, labels, info):  # row 6 holds ids 2 then 1
    one, two = segments[6] == 1, segments[6] == 2
    segments[6, one], segments[6, two] = 2, 1


def gap_before_pair_two(segments, labels, info):  # row 2: padding between pair 1 and pair 2
    first = int(np.flatnonzero(segments[2] == 3)[0])
    segments[2, first], labels[2, first] = 0, 0


def other_prompt_token(segments, labels, info, tokens):  # row 4: pair 2's rejected sequence starts elsewhere
    first = int(np.flatnonzero(segments[4] == 4)[0])
    tokens[4, first] = tokens[4, first] % 255 + 1


def shorter_prompt(segments, labels, info, tokens):  # row 7: pair 1's chosen has its prompt's last token labelled
    first = int(np.flatnonzero((segments[7] == 1) & (labels[7] != 0))[0])
    labels[7, first - 1] = 1


def miscount(segments, labels, info):
    info["pairs"] = 15


CASES = {
    "odd": (drop_last_rejected, "row 5: it ends with sequence 3, the chosen answer of pair 2, without a rejected one"),
    "untrained": (untrain_rejected, "row 3: sequence 2, the rejected answer of pair 1, trains no token"),
    "out_of_order": (swap_chosen_and_rejected, "row 6: its segment ids do not run 1, 2, 3"),
    "gap": (gap_before_pair_two, "row 2: its segment ids do not run 1, 2, 3"),
    "sidecar": (miscount, "sidecar says it holds 15 pairs but its rows hold 16"),
    "prompt_token": (other_prompt_token, "row 4: pair 2's chosen and rejected sequences .3 and 4. do not share their "
                                         "prompt"),
    "prompt_length": (shorter_prompt, "row 7: pair 1's chosen and rejected sequences .1 and 2. do not share"),
}


def test_whole_pairs_are_counted():
    rows = PackedRows(*(np.asarray(a) for a in ([[5, 6, 5, 8, 9, 0]] * 2, [[1, 1, 2, 2, 0, 0], [0] * 6],
                                                 [[0, 1, 0, 1, 0, 0], [0] * 6])), {"pairs": 1})
    assert check_pairs(rows, "f") == 1  # a row of padding alone holds no pair and is no error


@pytest.mark.parametrize("change, match", CASES.values(), ids=CASES.keys())
def test_rows_that_are_not_whole_pairs_are_one_line(tmp_path, change, match):
    with pytest.raises(DataError, match=match) as info:
        check_pairs(load_packed(damaged(tmp_path, change)), "bad.sft.u16.bin")
    assert "\n" not in str(info.value) and "pstar-tokens --preference" in str(info.value)


@pytest.mark.parametrize("case", ["odd", "sidecar"])
def test_pstar_train_refuses_them_naming_the_flag_before_building_an_engine(tmp_path, capsys, monkeypatch, case):
    import pstar_jax.planner.build as build
    from pstar_jax.cli.train import main as train_main
    def never(*_, **__):
        raise AssertionError("an engine was built")
    monkeypatch.setattr(build, "build_engine", never)
    data = damaged(tmp_path, CASES[case][0])
    for flags in (["--data", str(data)], ["--data", str(tmp_path / "good.sft.u16.bin"), "--eval-every", "1",
                                          "--eval-data", str(data)]):
        assert train_main(["--objective", "dpo", *flags, "--steps", "1", "--batch-size", "8", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"pstar-train: error: {'--eval-data' if '--eval-data' in flags else '--data'}")
        assert CASES[case][1] in err and len(err.splitlines()) == 1, err
