"""ListOps data: the generator's labels checked by the independent evaluator, the released file formats, the
serialisation and semantics of data/listops/SPEC.md."""

import pytest

from training import listops_data
from training.listops_data import (
    SETTINGS,
    ListOpsSyntaxError,
    check_labels,
    evaluate_expression,
    generate,
    read_tsv,
    serialize,
    tree_length,
    write_setting,
)


def test_serialisation_is_the_binary_left_nested_bracketing_of_the_spec():
    assert serialize(("[MAX", [2, 9])) == "( ( ( [MAX 2 ) 9 ) ] )"
    assert serialize(("[SM", [1, ("[MIN", [4, 3])])) == "( ( ( [SM 1 ) ( ( ( [MIN 4 ) 3 ) ] ) ) ] )"
    assert serialize(7) == "7"


@pytest.mark.parametrize("expression, value, depth", [
    ("( ( ( [MAX 2 ) 9 ) ] )", 9, 1),
    ("[MIN 4 3 ]", 3, 1),
    ("[MED 3 6 ]", 4, 1),  # even count: the mean of the middle two, rounded down
    ("[MED 1 9 2 ]", 2, 1),
    ("[MED 0 1 8 9 ]", 4, 1),
    ("[SM 7 8 9 ]", 4, 1),  # 24 mod 10
    ("( ( ( [SM 1 ) ( ( ( [MIN 4 ) 3 ) ] ) ) ] )", 4, 2),
    ("[MAX 1 [MIN 5 [SM 9 9 ] 6 ] 0 ]", 5, 3),
    ("5", 5, 0),  # a bare digit is a depth-0 expression
])
def test_evaluator_semantics(expression, value, depth):
    assert evaluate_expression(expression) == (value, depth)


@pytest.mark.parametrize("bad", ["[MAX 2 9", "[MAX 2 9 ] ]", "[FOO 1 ]", "( [MIN 1 ]", "[MIN ]", "", "1 2"])
def test_evaluator_rejects_malformed_expressions(bad):
    with pytest.raises(ListOpsSyntaxError):
        evaluate_expression(bad)


@pytest.mark.parametrize("setting, counts", [("original", (600, 50, 150)), ("lra", (12, 2, 2))])
def test_every_generated_label_is_confirmed_by_the_independent_evaluator(setting, counts):
    splits = generate(setting, counts, seed=3)
    rows = [row for split in splits.values() for row in split]
    assert [len(splits[s]) for s in ("train", "validation", "test")] == list(counts)
    assert len({expression for _, expression in rows}) == len(rows), "trees are distinct across splits"
    assert check_labels(rows) == []
    # The check can fail: a wrong label is found.
    label, expression = rows[5]
    assert check_labels(rows[:5] + [((label + 1) % 10, expression)]) == [(5, (label + 1) % 10, label)]


def test_generator_settings_shape_and_determinism():
    original = generate("original", (300, 0, 0), seed=0)["train"]
    assert original == generate("original", (300, 0, 0), seed=0)["train"]
    assert original != generate("original", (300, 0, 0), seed=1)["train"]
    depths = [evaluate_expression(e)[1] for _, e in original]
    # A list node is only drawn below MAX_DEPTH (root at 1), so list nesting stays below 20; bare digits occur.
    assert max(depths) <= SETTINGS["original"].max_depth - 1 and min(depths) == 0
    # LRA: 500 < length < 2000 with length = operators + digits + "]" (brackets not counted), depth < 10.
    for _, expression in generate("lra", (6, 0, 0), seed=0)["train"]:
        tokens = [t for t in expression.split() if t not in ("(", ")")]
        assert 500 < len(tokens) < 2000
        assert evaluate_expression(expression)[1] <= SETTINGS["lra"].max_depth - 1
    assert tree_length(("[MAX", [1, ("[MIN", [2, 3])])) == 7


def test_released_formats_are_written_and_read_back(tmp_path):
    paths = write_setting(str(tmp_path / "original"), "original", (20, 5, 5), seed=0)
    lines = open(paths["test"], encoding="utf-8").read().splitlines()
    assert len(lines) == 5 and lines[0].split("\t")[0].isdigit(), "original: LABEL<TAB>EXPRESSION, no header"
    assert [p.rsplit("/", 1)[1] for p in paths.values()] == ["train_d20s.tsv", "valid_d20s.tsv", "test_d20s.tsv"]
    lra = write_setting(str(tmp_path / "lra"), "lra", (2, 1, 1), seed=0)
    lra_lines = open(lra["train"], encoding="utf-8").read().splitlines()
    assert lra_lines[0] == "Source\tTarget" and lra_lines[1].split("\t")[1].isdigit()
    assert len(read_tsv(lra["train"])) == 2 and check_labels(read_tsv(lra["train"])) == []


def test_reading_hand_written_files_in_both_formats(tmp_path):
    original = tmp_path / "test_d20s.tsv"
    original.write_text("9\t( ( ( [MAX 2 ) 9 ) ] )\n4\t[MED 3 6 ]\n5\t5\n", encoding="utf-8")
    assert read_tsv(str(original)) == [(9, "( ( ( [MAX 2 ) 9 ) ] )"), (4, "[MED 3 6 ]"), (5, "5")]
    lra = tmp_path / "basic_test.tsv"
    lra.write_text("Source\tTarget\n( ( ( [SM 7 ) 8 ) ] )\t5\n", encoding="utf-8")
    assert read_tsv(str(lra)) == [(5, "( ( ( [SM 7 ) 8 ) ] )")]
    broken = tmp_path / "broken.tsv"
    broken.write_text("[MAX 2 9 ]\t9\n", encoding="utf-8")  # LRA order without the header
    with pytest.raises(ValueError, match="broken.tsv:1"):
        read_tsv(str(broken))
    with pytest.raises(FileNotFoundError):
        read_tsv(str(tmp_path / "missing.tsv"))


def test_command_line_generate_and_check(tmp_path, capsys):
    assert listops_data.main(["generate", "--train", "30", "--validation", "5", "--test", "5",
                              "--output_dir", str(tmp_path)]) == 0
    assert listops_data.main(["check", str(tmp_path / "test_d20s.tsv")]) == 0
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text("1\t[MAX 2 9 ]\n", encoding="utf-8")
    assert listops_data.main(["check", str(wrong)]) == 1
    assert "1 label mismatches" in capsys.readouterr().out


def test_lra_lengths_are_strictly_between_500_and_2000():
    setting = listops_data.SETTINGS["lra"]
    assert (setting.min_length, setting.max_length) == (500, 2000)

    def tree_of(length):  # a flat tree of `length` tokens: "[SM", the digits, "]"
        tree = ("[SM", [0] * (length - 2))
        assert listops_data.tree_length(tree) == length
        return tree

    accepted = {length: listops_data._accepted(tree_of(length), setting) for length in (500, 501, 1999, 2000)}
    assert accepted == {500: False, 501: True, 1999: True, 2000: False}
