"""``hf-spectral`` command line: ``hf-spectral train <recipe> [options]`` and ``hf-spectral retrofit SRC DST [options]``."""

import importlib
import sys

RECIPES = ("tinyshakespeare", "ptb_char", "retrofit_gpt2", "rmt_signal_recovery")

USAGE = f"""usage: hf-spectral <command> [options]

commands:
  train RECIPE [options]   run a training / reproduction recipe ({', '.join(RECIPES)});
                           `hf-spectral train RECIPE --help` lists its options
  retrofit SRC DST [opts]  write a copy of checkpoint folder SRC with energy gates added to DST;
                           `hf-spectral retrofit --help` lists the options
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        if not rest or rest[0] in ("-h", "--help"):
            print(USAGE)
            return 0 if rest else 2
        if rest[0] not in RECIPES:
            print(f"unknown recipe {rest[0]!r}; choose one of {', '.join(RECIPES)}", file=sys.stderr)
            return 2
        module = importlib.import_module(f"training.{rest[0]}")
        return module.main(rest[1:]) or 0
    if command == "retrofit":
        from .retrofit.cli import main as retrofit_main

        return retrofit_main(rest) or 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
