"""``hf-spectral`` command line: ``hf-spectral train <recipe> [options]``, ``hf-spectral retrofit SRC DST [options]``.

The recipes are the modules of ``hf_spectral.recipes`` (the repository's ``training/`` folder, installed under
that name): ``hf-spectral train tinyshakespeare`` runs what ``python -m training.tinyshakespeare`` runs in a
checkout. Each recipe parses its options before it imports torch, transformers or datasets. ``hf-spectral train
clm`` and ``hf-spectral train classification`` run the scripts ``run_clm`` and ``run_classification`` (one model,
your data, transformers' ``HfArgumentParser`` options, which need transformers to parse).
"""

import importlib
import importlib.util
import sys

# Every recipe module of hf_spectral.recipes, in the order `hf-spectral --help` lists them (tests check that each
# exists and that every recipe module is listed).
RECIPES = {
    "tinyshakespeare": "EGA-GPT variants vs the baseline on TinyShakespeare (characters)",
    "ptb_char": "the same on Penn Treebank (characters)",
    "wikitext": "CHIAR-Former arms vs an all-attention model on WikiText-2 / -103 (language modelling)",
    "imdb": "IMDB sentiment classification",
    "listops": "ListOps classification (long sequences)",
    "retrofit_gpt2": "energy gates retrofitted to a GPT-2 and fine-tuned, vs plain fine-tuning",
    "reproduce_ega": "the EGA reproduction: every variant, both corpora, several seeds, one table (--smoke: tiny)",
    "reproduce_ega_context": "EGA-1 vs the baseline at contexts 64-512, loss per window position, the τ study",
    "reproduce_chiar": "the CHIAR-Former reproduction: every arm on WikiText-2, ListOps and IMDB, several seeds",
    "rmt_signal_recovery": "the random-matrix theory of attention pooling, checked by simulation",
}

# The scripts in the shape of transformers' examples: `hf-spectral train NAME` -> module of hf_spectral.recipes
SCRIPTS = {
    "clm": ("run_clm", "train or fine-tune one causal LM: any checkpoint or model type, your data (as run_clm)"),
    "classification": ("run_classification", "the same for one sequence classifier (as run_classification)"),
}

# What the [train] extra installs (import name -> distribution): checked before a recipe runs
TRAIN_EXTRA = {"datasets": "datasets", "evaluate": "evaluate", "matplotlib": "matplotlib", "scipy": "scipy",
               "pywt": "PyWavelets"}

USAGE = """usage: hf-spectral [--version] <command> [options]

commands:
  train RECIPE [options]   run a training / reproduction recipe;
                           `hf-spectral train RECIPE --help` lists its options
  retrofit SRC DST [opts]  write a copy of checkpoint folder SRC with energy gates added to DST;
                           `hf-spectral retrofit --help` lists the options

recipes:
{recipes}

one model on your data (`hf-spectral train clm args.json` reads a JSON file of options):
{scripts}
"""


def _version() -> str:
    from . import __version__

    return __version__


def usage() -> str:
    width = max(len(name) for name in [*RECIPES, *SCRIPTS])
    return USAGE.format(recipes="\n".join(f"  {name:<{width}}  {text}" for name, text in RECIPES.items()),
                        scripts="\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in SCRIPTS.items()))


def recipe_module_name(name: str) -> str:
    """``hf_spectral.recipes.<name>`` (of a script: ``hf_spectral.recipes.run_<name>``); a ``ValueError`` naming the
    choices for an unknown recipe."""
    if name not in RECIPES and name not in SCRIPTS:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join([*RECIPES, *SCRIPTS])}")
    module_name = f"{__package__}.recipes.{SCRIPTS[name][0] if name in SCRIPTS else name}"
    if importlib.util.find_spec(module_name) is None:
        raise ValueError(f"recipe {name!r} is not part of this installation (no module {module_name})")
    return module_name


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"hf-spectral {_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        if not rest or rest[0] in ("-h", "--help"):
            print(usage(), file=sys.stdout if rest else sys.stderr)
            return 0 if rest else 2
        try:
            module_name = recipe_module_name(rest[0])
        except ValueError as error:
            print(f"hf-spectral train: error: {error}", file=sys.stderr)
            return 2
        missing = [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]
        # A recipe answers --help without them; a script imports datasets to build its parser.
        if missing and (rest[0] in SCRIPTS or not {"-h", "--help"} & set(rest[1:])):
            print(f"hf-spectral train: error: the recipes need {', '.join(TRAIN_EXTRA[name] for name in missing)}, "
                  f'which {"is" if len(missing) == 1 else "are"} not installed: pip install "hf_spectral[train]"',
                  file=sys.stderr)
            return 2
        code = importlib.import_module(module_name).main(rest[1:])
        # Recipes return their exit status; one that returns its results (rmt_signal_recovery) succeeded.
        return code if isinstance(code, int) else 0
    if command == "retrofit":
        from .retrofit.cli import main as retrofit_main

        return retrofit_main(rest) or 0
    print(f"hf-spectral: error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
