"""Train or fine-tune one causal language model with transformers' `Trainer`, on any data: transformers'
examples/pytorch/language-modeling/run_clm.py, with hf_spectral's models and additions.

    python -m training.run_clm --model_name_or_path path/or/hub-id --train_file corpus.txt --block_size 256 \\
        --do_train --do_eval --output_dir out --add_energy_gates --lora_r 8 --max_steps 1000
    python -m training.run_clm --model_type ega_gpt --variant EGA-1 --config_overrides num_hidden_layers=4 \\
        --tokenizer_name char --train_file corpus.txt --do_train --do_eval --output_dir out
    python -m training.run_clm args.json [--option value ...]    # arguments from a JSON file; options after it win
    hf-spectral train clm --help

Model: a checkpoint (--model_name_or_path: any AutoModelForCausalLM, EGA-GPT and CHIAR-Former included), or a new
model of --model_type with --config_overrides (EGA-GPT: of --variant) and --tokenizer_name (a tokenizer, or `char`).
hf_spectral's additions: energy gates on a GPT-2 / Llama / Mistral / Qwen2 model (--add_energy_gates, --gate_*,
--train_only_gates), LoRA (--lora_r; added gates train beside it and are saved in the adapter), CHIAR-Former's
threshold calibration before training and its routing fractions and FLOPs in the training logs.
Data: --dataset_name (the Hub, through `datasets`) or --train_file / --validation_file (.txt, .json, .jsonl,
.csv), tokenized and cut into blocks of --block_size tokens (concatenated across documents, as transformers'
run_clm does), or with --padding_free each document apart, its batches flattened into one row by transformers'
DataCollatorWithFlattening (positions restarting at each document); --streaming reads the data as it trains.
Output in --output_dir, as run_clm writes it: the model (or the adapter) and tokenizer, train_results.json,
eval_results.json (with perplexity), all_results.json, trainer_state.json, README.md (the model card).
Everything else is a TrainingArguments option: --do_train, --do_eval, --max_steps, --resume_from_checkpoint,
--bf16, --report_to, --use_cpu, --push_to_hub; torchrun and `accelerate launch` run it data-parallel.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from itertools import chain

from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from .common.run_scripts import (
    ModelArguments,
    SpectralArguments,
    SpectralTrainer,
    TrainingLogCallback,
    UsageError,
    add_gates_and_lora,
    build_config,
    build_model,
    build_tokenizer,
    calibrate_routing,
    check_arguments,
    check_column,
    check_data_arguments,
    column_names,
    first_examples,
    fixed_batches,
    gate_values,
    is_chiar,
    leak_free_metrics,
    load_metric,
    load_raw_datasets,
    parse_arguments,
    prepare_for_training,
    program_name,
    requested_splits,
    run_main,
    save_gates_alone,
    sees_future_tokens,
    setup_logging,
    trainable_parameters,
    write_model_card,
)

logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    """The text to train and evaluate on."""

    dataset_name: str | None = field(default=None, metadata={"help": "A dataset of the Hub (through `datasets`)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration, e.g. wikitext-2-v1."})
    train_file: str | None = field(default=None, metadata={"help": "Training text: a .txt, .json, .jsonl or .csv."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation text, in the same format."})
    test_file: str | None = field(default=None, metadata={"help": "Test text, in the same format (--do_predict)."})
    text_column_name: str | None = field(
        default=None, metadata={"help": "Column of the text (default: `text` if there is one, else the first column)."}
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per training block: the text is tokenized, concatenated and cut into blocks of this "
                  "length (default: the model's context, at most 1024). With --padding_free: the longest piece of a "
                  "document."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Keep documents apart instead of concatenating them into blocks (TRL's padding_free): each "
                  "example of the data (a line of a .txt file, a row of a .json or .csv file) is a document, cut into "
                  "pieces of at most --block_size tokens, and each batch of --per_device_*_batch_size pieces is "
                  "flattened into one row by transformers' DataCollatorWithFlattening: position ids restart at every "
                  "document and no token attends across a boundary. Documents of fewer than two tokens are dropped."},
    )
    streaming: bool = field(
        default=False, metadata={"help": "Read the data as a stream while training (big corpora; needs --max_steps)."}
    )
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep the line breaks of .txt files."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Without a validation split: the percentage of the training split held out."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N blocks only."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N blocks only."})
    position_loss_buckets: int | None = field(
        default=None,
        metadata={"help": "Also report the loss per position in the block: its T - 1 predictions, by the position t = "
                  "1 .. T - 1 of the predicted token (t tokens before it), split into N buckets as equal as they "
                  "can be; eval_position_loss_<first>-<last> is the mean loss of the predictions of positions first "
                  "to last (test_..., and every evaluation during training, likewise). Computed in the evaluation "
                  "loop, no second pass; N at most T - 1."},
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes that tokenize."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of reading the cache."})

    def __post_init__(self):
        check_data_arguments(self, extensions=("txt", "json", "jsonl", "csv"), positive=("block_size", "max_train_samples", "max_eval_samples", "position_loss_buckets"))
        if self.position_loss_buckets and self.block_size and self.position_loss_buckets > self.block_size - 1:
            raise ValueError(f"--position_loss_buckets {self.position_loss_buckets}: a block of {self.block_size} "
                             f"tokens has {self.block_size - 1} predictions; give at most that many buckets")
        if self.position_loss_buckets and self.padding_free:
            raise ValueError("--position_loss_buckets with --padding_free: a flattened batch is one row of several "
                             "documents, whose positions in the row are not positions in a window")


# The argument dataclasses, in the order the options are parsed (drivers check a run's arguments against them)
ARGUMENTS = (ModelArguments, DataTrainingArguments, SpectralArguments, TrainingArguments)


def main(argv=None) -> int:
    prog = program_name("run_clm", "clm")
    return run_main(lambda arguments: run(arguments, prog), argv, prog)


def run(argv, prog: str) -> int:
    model_args, data_args, spectral_args, training_args = parse_arguments(ARGUMENTS, argv, prog, __doc__)
    setup_logging(training_args)
    check_arguments(model_args, spectral_args, training_args)
    if data_args.streaming and training_args.do_train and training_args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps: a stream has no length to count epochs by")
    set_seed(training_args.seed)

    # Data: a Hub dataset or local files, with a validation split for --do_eval
    raw_datasets = load_raw_datasets(data_args, model_args, need_validation=training_args.do_eval,
                                     streaming=data_args.streaming)
    splits = requested_splits(raw_datasets, training_args, spectral_args)
    columns = column_names(raw_datasets[splits[0]])
    text_column = data_args.text_column_name or ("text" if "text" in columns else columns[0])
    for split in splits:
        check_column(raw_datasets[split], text_column, "--text_column_name")

    # Config, tokenizer, model
    config = build_config(model_args)
    train_texts = None if data_args.streaming or "train" not in raw_datasets else raw_datasets["train"][text_column]
    tokenizer = build_tokenizer(model_args, train_texts)
    model = build_model(AutoModelForCausalLM, model_args, config, tokenizer)
    if model.loss_type is None:
        # A class name transformers reads no loss type from (GPT2LMHeadModel): the model computes ForCausalLM's loss
        # anyway, but Trainer would then count T tokens per block of T instead of the T - 1 predicted ones, and
        # report every loss (T - 1) / T of its value. Naming the loss it computes makes Trainer count right.
        model.loss_type = "ForCausalLM"

    # hf_spectral's additions: energy gates, only the gates trainable, LoRA
    model = add_gates_and_lora(model, spectral_args, task_type="CAUSAL_LM")

    # Tokenize, concatenate and cut into blocks
    if data_args.block_size is None:
        block_size = min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", 1024), 1024)
    else:
        if data_args.block_size > tokenizer.model_max_length:
            logger.warning(f"--block_size {data_args.block_size} is longer than the tokenizer's maximum length "
                           f"({tokenizer.model_max_length}); using {tokenizer.model_max_length}")
        block_size = min(data_args.block_size, tokenizer.model_max_length)
    buckets = position_buckets(block_size, data_args.position_loss_buckets) if data_args.position_loss_buckets else []

    def tokenize(examples):
        return tokenizer(examples[text_column])

    def group_texts(examples):
        concatenated = {key: list(chain(*examples[key])) for key in examples}
        total_length = len(concatenated["input_ids"]) // block_size * block_size  # the remainder is dropped
        result = {key: [tokens[i:i + block_size] for i in range(0, total_length, block_size)]
                  for key, tokens in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    def split_documents(examples):  # --padding_free: each document apart, in pieces of at most block_size tokens
        pieces = [ids[i:i + block_size] for ids in examples["input_ids"] for i in range(0, len(ids), block_size)]
        pieces = [piece for piece in pieces if len(piece) > 1]  # a piece of one token predicts nothing
        return {"input_ids": pieces, "labels": [list(piece) for piece in pieces]}

    lm_datasets = {}
    with training_args.main_process_first(desc="tokenizing and grouping the text into blocks"):
        for split in splits:
            options = {} if data_args.streaming else {
                "num_proc": data_args.preprocessing_num_workers, "load_from_cache_file": not data_args.overwrite_cache}
            tokenized = raw_datasets[split].map(tokenize, batched=True,
                                                remove_columns=column_names(raw_datasets[split]), **options)
            if data_args.padding_free:
                lm_datasets[split] = tokenized.map(split_documents, batched=True,
                                                   remove_columns=column_names(tokenized), **options)
            else:
                lm_datasets[split] = tokenized.map(group_texts, batched=True, **options)
    train_dataset = first_examples(lm_datasets.get("train"), data_args.max_train_samples)
    eval_dataset = first_examples(lm_datasets.get("validation"), data_args.max_eval_samples)
    test_dataset = first_examples(lm_datasets.get("test"), data_args.max_eval_samples)
    for split, dataset in (("training", train_dataset), ("validation", eval_dataset), ("test", test_dataset)):
        if dataset is not None and not data_args.streaming and len(dataset) == 0:
            if data_args.padding_free:
                raise UsageError(f"the {split} text has no document of two tokens or more (--padding_free)")
            raise UsageError(f"the {split} text is shorter than one block of {block_size} tokens (--block_size)")
    # Blocks of one length stack into a batch; documents apart are flattened into one row, positions restarting
    collator = DataCollatorWithFlattening() if data_args.padding_free else default_data_collator

    # Next-token accuracy, as run_clm (a local evaluate module: works offline)
    accuracy = load_metric("accuracy")

    def preprocess_logits_for_metrics(logits, labels):
        logits = logits[0] if isinstance(logits, tuple) else logits
        if not buckets:
            return logits.argmax(dim=-1)
        return logits.argmax(dim=-1), next_token_losses(logits, labels)

    def compute_metrics(eval_prediction):
        predictions, labels = eval_prediction
        losses = None
        if buckets:
            predictions, losses = predictions
        metrics = accuracy.compute(predictions=predictions[:, :-1].reshape(-1), references=labels[:, 1:].reshape(-1))
        if buckets:
            metrics.update(position_losses(losses, labels, buckets))
        return metrics

    # What the additions log while training; a CHIAR-Former's calibration and routing on the first training batches
    log_callback = None
    if gate_values(model) or is_chiar(model):
        routing = None
        if is_chiar(model) and train_dataset is not None:
            routing = fixed_batches(train_dataset, collator, spectral_args.calibration_batches,
                                    training_args.per_device_train_batch_size)
        log_callback = TrainingLogCallback(routing)
    prepare_for_training(model, training_args)

    evaluating = eval_dataset is not None or test_dataset is not None
    trainer = SpectralTrainer(
        model=model,
        args=training_args,
        spectral_args=spectral_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=first_examples(eval_dataset, spectral_args.eval_samples_during_training),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics if evaluating else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if evaluating else None,
        callbacks=[log_callback] if log_callback else None,
    )
    if log_callback:
        log_callback.set_trainer(trainer)

    # Training
    all_metrics = {}
    if training_args.do_train:
        if log_callback and log_callback.routing_batches:
            calibrate_routing(trainer.model, log_callback.routing_batches, spectral_args)
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()  # the model (or the adapter) and the tokenizer
        if spectral_args.train_only_gates:
            save_gates_alone(trainer)
        metrics = {**train_result.metrics, "trainable_parameters": trainable_parameters(model)}
        if not data_args.streaming:
            metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        all_metrics.update(metrics)

    # Evaluation: the whole validation split (the curve may have read a part of it), the training examples in
    # evaluation mode, the test split
    if training_args.do_eval:
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        if not data_args.streaming:
            metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = perplexity(metrics["eval_loss"])
        batches = spectral_args.leak_free_eval_batches
        if batches is None:
            batches = 4 if sees_future_tokens(model.config) else 0
        if batches:
            # Cached decoding scores one sequence a row: documents apart are scored one at a time
            per_batch = 1 if data_args.padding_free else training_args.per_device_eval_batch_size
            rows = batches * training_args.per_device_eval_batch_size
            batches = fixed_batches(eval_dataset, default_data_collator, rows // per_batch, per_batch)
            metrics.update({f"eval_{key}": value for key, value in leak_free_metrics(trainer.model, batches).items()})
        if spectral_args.train_eval_samples:
            scored = first_examples(train_dataset, spectral_args.train_eval_samples)
            train_metrics = trainer.evaluate(eval_dataset=scored, metric_key_prefix="eval_train")
            metrics["eval_train_loss"] = train_metrics["eval_train_loss"]
            metrics["eval_generalization_gap"] = metrics["eval_loss"] - metrics["eval_train_loss"]
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        all_metrics.update(metrics)
    if training_args.do_predict:
        metrics = trainer.evaluate(eval_dataset=test_dataset, metric_key_prefix="test")
        if not data_args.streaming:
            metrics["test_samples"] = len(test_dataset)
        metrics["test_perplexity"] = perplexity(metrics["test_loss"])
        trainer.log_metrics("test", metrics)
        trainer.save_metrics("test", metrics)
        all_metrics.update(metrics)

    write_model_card(trainer, model_args, data_args, all_metrics, script="run_clm", task="text-generation",
                     tokenizer=tokenizer, log_callback=log_callback)
    return 0


def position_buckets(block_size: int, count: int) -> list:
    """The positions of each of ``count`` buckets of a block's predictions: (first, last), the predicted token's
    positions t = 1 .. block_size - 1 split as evenly as they can be (bucket k starts at 1 + k (T - 1) // count)."""
    predictions = block_size - 1
    if count > predictions:
        raise UsageError(f"--position_loss_buckets {count}: a block of {block_size} tokens has {predictions} "
                         "predictions; give at most that many buckets")
    starts = [1 + k * predictions // count for k in range(count + 1)]
    return [(starts[k], starts[k + 1] - 1) for k in range(count)]


def position_loss_key(first: int, last: int, block_size: int) -> str:
    """``position_loss_<first>-<last>``, the positions zero-padded to the width of the block's last one."""
    width = len(str(block_size - 1))
    return f"position_loss_{first:0{width}d}-{last:0{width}d}"


def next_token_losses(logits, labels):
    """(batch, T - 1) next-token losses of a batch (in float32; 0 where the label is ignored, -100)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=-100,
                           reduction="none")


def position_losses(losses, labels, buckets: list) -> dict:
    """The mean loss of the predictions of each bucket's positions (``losses``: (N, T - 1) from
    `next_token_losses`, gathered over the evaluation; the ignored labels, -100, left out)."""
    import numpy as np

    losses, labels = np.asarray(losses, dtype=np.float64), np.asarray(labels)
    block_size = labels.shape[1]
    counted = labels[:, 1:] != -100
    metrics = {}
    for first, last in buckets:
        mask = counted[:, first - 1:last]
        if mask.any():
            metrics[position_loss_key(first, last, block_size)] = float(losses[:, first - 1:last][mask].mean())
    return metrics


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


if __name__ == "__main__":
    sys.exit(main())
