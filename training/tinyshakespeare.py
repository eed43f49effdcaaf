"""TinyShakespeare, character level: EGA-GPT variants against the baseline (SPEC 1.4).

    python -m training.tinyshakespeare --preset demo                 # BASE vs EGA-1 on a CPU, a few minutes
    python -m training.tinyshakespeare --preset cpu --seeds 0 1 2    # the CPU reproduction scale
    python -m training.tinyshakespeare --preset authors              # the authors' setup (GPU)
    python -m training.tinyshakespeare --variants BASE EGA-1 EGA-1:window EGA-C --max_steps 2000
    hf-spectral train tinyshakespeare --help

The text (1,115,394 characters, 65 distinct) has no official split: the first 90% of the characters train,
the last 10% validate, as in nanoGPT and the EGA authors' code.
"""

import sys

from .common.data import TextCorpus, build_lm_data, char_tokenizer, load_corpus_texts
from .common.lm_experiment import Benchmark, run_recipe
from .common.presets import AUTHORS, CPU, SMOKE, LMPreset

CORPUS = TextCorpus(
    name="tinyshakespeare",
    folder="tinyshakespeare",
    files={"train": "input.txt"},
    env_var="TINYSHAKESPEARE_PATH",
    urls={"train": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"},
    sha256={"input.txt": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"},
    validation_fraction=0.1,
    hub_dataset="karpathy/tiny_shakespeare",
)

PRESETS = {
    "authors": AUTHORS,
    "cpu": CPU,
    # The README's first command: BASE and EGA-1 (causal) side by side in a few minutes on a laptop CPU.
    "demo": LMPreset(
        description="README demo: BASE vs EGA-1 (causal), 4 layers, 4 heads, C=128, context 64, batch 16, 600 steps",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=128, context_length=64,
        batch_size=16, max_steps=600, warmup_steps=60, learning_rate=1e-3, eval_steps=100, eval_batches=10,
        save_steps=200, logging_steps=50, variants=("BASE", "EGA-1"),
    ),
    "smoke": SMOKE,
}

BENCHMARK = Benchmark(
    recipe="tinyshakespeare",
    title="TinyShakespeare (char)",
    hub_dataset="karpathy/tiny_shakespeare",
    dataset_description=("TinyShakespeare (karpathy/char-rnn input.txt, 1,115,394 characters): first 90% of the "
                         "characters for training, last 10% for validation"),
    # SPEC 1.4: the authors' README, single seed, final-step validation loss (nats/char).
    paper={"BASE": 1.4742, "EGA-1": 1.3712, "EGA-2": 1.3950, "EGA-4": 1.4088, "EGA-C": 1.3745,
           "EGA-M-F": 1.4733, "EGA-DB2": 1.4692, "EGA-DB4": 1.4748},
    paper_gap={"BASE": 0.331, "EGA-1": 0.289},
    prompt="ROMEO:",
)


def load_data(args, preset, tokenizer_dir):
    texts = load_corpus_texts(CORPUS, args.data_path, args.dataset_name, args.dataset_config, args.text_column,
                              download=not args.no_download)
    tokenizer = char_tokenizer(texts, tokenizer_dir)
    return build_lm_data(texts, tokenizer, preset.context_length, validation_fraction=CORPUS.validation_fraction)


def main(argv=None) -> int:
    return run_recipe(argv, benchmark=BENCHMARK, corpus=CORPUS, presets=PRESETS, default_preset="cpu",
                      description=__doc__, load_data=load_data)


if __name__ == "__main__":
    sys.exit(main())
