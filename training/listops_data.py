"""ListOps data: a seeded generator (the original and the Long Range Arena settings), an independent evaluator,
and readers / writers of the released TSV formats.

    python -m training.listops_data generate --setting original --train 90000 --validation 1000 --test 10000 \\
        --seed 0 --output_dir data/listops                  # train_d20s.tsv, valid_d20s.tsv, test_d20s.tsv
    python -m training.listops_data generate --setting lra --output_dir data/listops-1000   # basic_*.tsv
    python -m training.listops_data check data/listops/test_d20s.tsv      # re-evaluate every label

Written from the description of the two public generators in the project's ``data/listops/SPEC.md`` (the
original: Nangia & Bowman 2018; LRA: Tay et al. 2020); no code copied.

* Vocabulary: digits 0-9, the operators ``[MIN [MAX [MED [SM`` (each opens a list), ``]`` (closes it), and the
  bracketing tokens ``(`` ``)`` of the binary left-nested serialisation: ``[MAX 2 9 ]`` is written
  ``( ( ( [MAX 2 ) 9 ) ] )``.
* Semantics: MIN, MAX, MED (median, the mean of the two middle values rounded down for an even count) and SM
  (sum modulo 10) of the evaluated arguments; the label is the value of the whole expression.
* Tree process: ``make(depth)`` draws u ~ U[0, 1) while depth < MAX_DEPTH (else forces a leaf); u > 0.25 gives a
  digit leaf, otherwise a list of k ~ U{2..MAX_ARGS} children made with ``make(depth + 1)`` in order, then an
  operator drawn uniformly. The root is ``make(1)``; duplicates are dropped until enough distinct trees exist.

The generator labels a tree by evaluating the tree it built; :func:`evaluate_expression` labels the serialised
text with its own stack machine (it never sees a tree), so checking one against the other checks both.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from dataclasses import dataclass

from .common.cli import positive_int, program_name

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
DIGITS = tuple(str(d) for d in range(10))
BRACKETS = ("(", ")")
VOCABULARY = DIGITS + OPERATORS + (END,) + BRACKETS  # the 17 symbols of both generators' output
LEAF_PROBABILITY_THRESHOLD = 0.25  # u > 0.25: a leaf (probability 0.75)


@dataclass(frozen=True)
class Setting:
    """One generator setting: tree shape, length filter, split sizes and the released file layout."""

    name: str
    max_args: int
    max_depth: int
    min_length: int | None  # strict bounds on the tree length (operators, digits and "]"; no brackets)
    max_length: int | None
    sizes: tuple  # default (train, validation, test)
    files: tuple  # (train, validation, test) file names
    header: bool  # LRA files: a "Source<TAB>Target" header and EXPRESSION<TAB>LABEL rows


SETTINGS = {
    # Nangia & Bowman (2018): no length filter; the released d20s files hold 90k train / 10k test (the
    # validation file is this project's addition: the original release has none).
    "original": Setting("original", max_args=5, max_depth=20, min_length=None, max_length=None,
                        sizes=(90_000, 1_000, 10_000), files=("train_d20s.tsv", "valid_d20s.tsv", "test_d20s.tsv"),
                        header=False),
    # Long Range Arena "basic": 500 < length < 2000, 96k / 2k / 2k.
    "lra": Setting("lra", max_args=10, max_depth=10, min_length=500, max_length=2000,
                   sizes=(96_000, 2_000, 2_000), files=("basic_train.tsv", "basic_val.tsv", "basic_test.tsv"),
                   header=True),
}
SPLITS = ("train", "validation", "test")


# ------------------------------------------------------------------------------------------------------------
# Generator (trees)
# ------------------------------------------------------------------------------------------------------------
# A tree is an int (a digit leaf) or a tuple (operator, [children]).


def make_tree(rng: random.Random, depth: int, setting: Setting):
    u = rng.random() if depth < setting.max_depth else 1.0
    if u > LEAF_PROBABILITY_THRESHOLD:
        return rng.randint(0, 9)
    count = rng.randint(2, setting.max_args)
    children = [make_tree(rng, depth + 1, setting) for _ in range(count)]
    return (rng.choice(OPERATORS), children)


def tree_value(tree) -> int:
    """The generator's own label: the tree evaluated recursively."""
    if isinstance(tree, int):
        return tree
    operator, children = tree
    values = [tree_value(child) for child in children]
    if operator == "[MIN":
        return min(values)
    if operator == "[MAX":
        return max(values)
    if operator == "[MED":
        return int(statistics.median(values))
    return sum(values) % 10


def tree_length(tree) -> int:
    """LRA's length: a leaf counts 1, a list 2 (operator and "]") plus its children; brackets not counted."""
    if isinstance(tree, int):
        return 1
    return 2 + sum(tree_length(child) for child in tree[1])


def serialize(tree) -> str:
    """Binary left-nested bracketing: (OP, a1), then (that, a2), ..., then (that, "]"), each pair "( L R )"."""
    if isinstance(tree, int):
        return str(tree)
    operator, children = tree
    text = operator
    for child in children:
        text = f"( {text} {serialize(child)} )"
    return f"( {text} {END} )"


def _accepted(tree, setting: Setting) -> bool:
    if setting.min_length is None and setting.max_length is None:
        return True
    length = tree_length(tree)
    return (setting.min_length is None or length > setting.min_length) and (
        setting.max_length is None or length < setting.max_length)


def generate(setting: Setting | str, counts: tuple, seed: int = 0, max_draws: int | None = None) -> dict:
    """``{split: [(label, expression), ...]}`` with ``counts`` = (train, validation, test) distinct trees, in the
    order they were first drawn (train first, then validation, then test). Deterministic for a given seed."""
    setting = SETTINGS[setting] if isinstance(setting, str) else setting
    wanted = sum(counts)
    if any(count < 0 for count in counts) or wanted == 0:
        raise ValueError(f"split sizes must be non-negative and not all zero, got {counts}")
    rng = random.Random(seed)
    found: dict = {}
    draws, limit = 0, max_draws if max_draws is not None else max(1000, 200 * wanted)
    while len(found) < wanted:
        if draws >= limit:
            raise RuntimeError(f"only {len(found)} distinct trees after {draws} draws (wanted {wanted}); the "
                               f"{setting.name} setting cannot produce that many")
        draws += 1
        tree = make_tree(rng, 1, setting)
        if not _accepted(tree, setting):
            continue
        expression = serialize(tree)
        if expression not in found:
            found[expression] = tree_value(tree)
    items = [(label, expression) for expression, label in found.items()]
    splits, start = {}, 0
    for split, count in zip(SPLITS, counts):
        splits[split] = items[start:start + count]
        start += count
    return splits


# ------------------------------------------------------------------------------------------------------------
# Independent evaluator (text only)
# ------------------------------------------------------------------------------------------------------------


class ListOpsSyntaxError(ValueError):
    """An expression that is not valid ListOps."""


def _apply(operator: str, values: list) -> int:
    if not values:
        raise ListOpsSyntaxError(f"{operator} has no arguments")
    if operator == "[MIN":
        return min(values)
    if operator == "[MAX":
        return max(values)
    if operator == "[SM":
        return sum(values) % 10
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2


def evaluate_expression(expression: str) -> tuple[int, int]:
    """(value, list-nesting depth) of a ListOps expression, with or without the ``(`` ``)`` bracketing.

    A stack machine over the tokens: an operator opens a frame, a digit joins the innermost frame, ``]`` closes
    it and hands its value to the frame below. A bare digit is a depth-0 expression.
    """
    stack: list = []  # frames: [operator, values]
    result, depth, balance = None, 0, 0
    for token in expression.split():
        if token in BRACKETS:
            balance += 1 if token == "(" else -1
            if balance < 0:
                raise ListOpsSyntaxError(f"unbalanced ')' in {expression[:80]!r}")
            continue
        if result is not None:
            raise ListOpsSyntaxError(f"tokens after the end of the expression in {expression[:80]!r}")
        if token in OPERATORS:
            stack.append([token, []])
            depth = max(depth, len(stack))
        elif token == END:
            if not stack:
                raise ListOpsSyntaxError(f"']' without an open list in {expression[:80]!r}")
            operator, values = stack.pop()
            value = _apply(operator, values)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif token in DIGITS:
            if stack:
                stack[-1][1].append(int(token))
            else:
                result = int(token)
        else:
            raise ListOpsSyntaxError(f"unknown token {token!r} in {expression[:80]!r}")
    if stack or result is None or balance != 0:
        raise ListOpsSyntaxError(f"incomplete expression {expression[:80]!r}")
    return result, depth


def check_labels(examples: list) -> list:
    """Indices (and found / expected values) of the examples whose label the evaluator does not reproduce."""
    mismatches = []
    for index, (label, expression) in enumerate(examples):
        value, _ = evaluate_expression(expression)
        if value != int(label):
            mismatches.append((index, int(label), value))
    return mismatches


# ------------------------------------------------------------------------------------------------------------
# Files in the released formats
# ------------------------------------------------------------------------------------------------------------


def write_tsv(path: str, examples: list, header: bool):
    """Original format (``header=False``): ``LABEL<TAB>EXPRESSION`` per line. LRA format: a ``Source<TAB>Target``
    header, then ``EXPRESSION<TAB>LABEL``. Written through a temporary file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # several processes may write the same generated file
    with open(tmp, "w", encoding="utf-8") as handle:
        if header:
            handle.write("Source\tTarget\n")
            handle.writelines(f"{expression}\t{label}\n" for label, expression in examples)
        else:
            handle.writelines(f"{label}\t{expression}\n" for label, expression in examples)
    os.replace(tmp, path)


def read_tsv(path: str) -> list:
    """[(label, expression), ...] from a file in either released format (detected from the first line)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ListOps file {path} not found")
    examples = []
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    lra = bool(lines) and lines[0].strip() == "Source\tTarget"
    for number, line in enumerate(lines[1:] if lra else lines, start=2 if lra else 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected two tab-separated fields, got {len(parts)}")
        expression, label = (parts[0], parts[1]) if lra else (parts[1], parts[0])
        label = label.strip()
        if label not in DIGITS:
            raise ValueError(f"{path}:{number}: label {label!r} is not a digit 0-9 "
                             f"({'LRA' if lra else 'original'} format: "
                             f"{'EXPRESSION<TAB>LABEL' if lra else 'LABEL<TAB>EXPRESSION'})")
        examples.append((int(label), expression.strip()))
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def write_setting(output_dir: str, setting: Setting | str, counts: tuple | None = None, seed: int = 0) -> dict:
    """Generate and write the three files of ``setting``; returns {split: path}."""
    setting = SETTINGS[setting] if isinstance(setting, str) else setting
    splits = generate(setting, counts or setting.sizes, seed)
    paths = {}
    for split, name in zip(SPLITS, setting.files):
        paths[split] = os.path.join(output_dir, name)
        write_tsv(paths[split], splits[split], setting.header)
    return paths


def statistics_of(examples: list) -> dict:
    lengths = sorted(len([t for t in e.split() if t not in BRACKETS]) for _, e in examples)
    depths = sorted(evaluate_expression(e)[1] for _, e in examples)
    labels = {str(d): 0 for d in range(10)}
    for label, _ in examples:
        labels[str(label)] += 1
    return {"examples": len(examples), "length_min": lengths[0], "length_median": lengths[len(lengths) // 2],
            "length_max": lengths[-1], "depth_max": depths[-1], "depth_median": depths[len(depths) // 2],
            "labels": labels}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=program_name("listops_data"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write train / validation / test TSV files")
    gen.add_argument("--setting", choices=sorted(SETTINGS), default="original")
    gen.add_argument("--train", type=positive_int, help="training examples (default: the setting's)")
    gen.add_argument("--validation", type=positive_int, help="validation examples (default: the setting's)")
    gen.add_argument("--test", type=positive_int, help="test examples (default: the setting's)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--output_dir", required=True)
    check = commands.add_parser("check", help="re-evaluate every label of TSV files (either format)")
    check.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "generate":
        setting = SETTINGS[args.setting]
        counts = tuple(default if value is None else value
                       for value, default in zip((args.train, args.validation, args.test), setting.sizes))
        paths = write_setting(args.output_dir, setting, counts, args.seed)
        for split, path in paths.items():
            print(f"{split}: {path}")
        return 0
    failed = 0
    for path in args.files:
        examples = read_tsv(path)
        mismatches = check_labels(examples)
        failed += bool(mismatches)
        print(f"{path}: {len(examples)} examples, {len(mismatches)} label mismatches; {statistics_of(examples)}")
        for index, label, value in mismatches[:10]:
            print(f"  example {index}: label {label}, evaluates to {value}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
