"""Train or fine-tune one sequence classifier with transformers' `Trainer`, on any data: transformers'
examples/pytorch/text-classification/run_classification.py, with hf_spectral's models and additions.

    python -m training.run_classification --model_name_or_path path/or/hub-id --train_file train.csv \\
        --validation_file dev.csv --text_column_name sentence --label_column_name label --do_train --do_eval \\
        --output_dir out
    python -m training.run_classification --model_type chiar_former --config_overrides hidden_size=64,is_causal=false \\
        --tokenizer_name char --train_file train.csv --do_train --do_eval --output_dir out
    python -m training.run_classification args.json [--option value ...]   # arguments from a JSON file
    hf-spectral train classification --help

Model: a checkpoint (--model_name_or_path: any AutoModelForSequenceClassification, e.g. EGA-GPT, CHIAR-Former, a
retrofitted checkpoint; a language model's checkpoint gets a new classification head), or a new model of
--model_type with --config_overrides and --tokenizer_name (a tokenizer, or `char`). The same additions as run_clm:
energy gates, LoRA, CHIAR-Former's calibration and routing logs.
Data: --dataset_name (the Hub) or --train_file / --validation_file (.csv, .json, .jsonl) with a text column
(--text_column_name) and a label column (--label_column_name); texts are cut at --max_seq_length tokens. The labels
are the label column's class names, or its distinct values, sorted.
Metrics: accuracy (through `evaluate`, a local module that works offline) and, when the data has a depth column
(--depth_column_name: ListOps' nesting depth), the accuracy at each depth (eval_accuracy_depth_<d>).
Output in --output_dir as run_clm's (train_results.json, eval_results.json, all_results.json, trainer_state.json, the
model or adapter, the tokenizer, README.md); everything else is a TrainingArguments option.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import numpy as np
from datasets import ClassLabel
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, TrainingArguments, set_seed

from .common.run_scripts import (
    ModelArguments,
    SpectralArguments,
    SpectralTrainer,
    TrainingLogCallback,
    UsageError,
    add_gates_and_lora,
    base_model,
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
    load_metric,
    load_raw_datasets,
    parse_arguments,
    prepare_for_training,
    program_name,
    requested_splits,
    run_main,
    said_as_usage_error,
    save_gates_alone,
    setup_logging,
    trainable_parameters,
    write_model_card,
)

logger = logging.getLogger(__name__)

# What the model reads of a tokenized example (fixed_batches collates only these)
MODEL_INPUTS = ("input_ids", "attention_mask", "labels")


@dataclass
class DataTrainingArguments:
    """The labelled texts to train and evaluate on."""

    dataset_name: str | None = field(default=None, metadata={"help": "A dataset of the Hub (through `datasets`)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Training examples: a .csv, .json or .jsonl file."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation examples, in the same format."})
    test_file: str | None = field(default=None, metadata={"help": "Test examples, in the same format (--do_predict)."})
    text_column_name: str | None = field(
        default=None, metadata={"help": "Column of the text (default: `text`, else `sentence`)."}
    )
    label_column_name: str = field(default="label", metadata={"help": "Column of the label."})
    depth_column_name: str = field(
        default="depth",
        metadata={"help": "Column of each example's nesting depth (ListOps): when the data has it, the accuracy at "
                  "each depth is reported too."},
    )
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example; longer texts are truncated."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Without a validation split: the percentage of the training split held out."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N examples only."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N examples only."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes that tokenize."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of reading the cache."})

    def __post_init__(self):
        check_data_arguments(self, extensions=("csv", "json", "jsonl"), positive=("max_seq_length", "max_train_samples", "max_eval_samples"))


# The argument dataclasses, in the order the options are parsed (drivers check a run's arguments against them)
ARGUMENTS = (ModelArguments, DataTrainingArguments, SpectralArguments, TrainingArguments)


def main(argv=None) -> int:
    prog = program_name("run_classification", "classification")
    return run_main(lambda arguments: run(arguments, prog), argv, prog)


def run(argv, prog: str) -> int:
    model_args, data_args, spectral_args, training_args = parse_arguments(ARGUMENTS, argv, prog, __doc__)
    setup_logging(training_args)
    check_arguments(model_args, spectral_args, training_args)
    set_seed(training_args.seed)

    # Data: a Hub dataset or local files, with a validation split for --do_eval
    raw_datasets = load_raw_datasets(data_args, model_args, need_validation=training_args.do_eval)
    splits = requested_splits(raw_datasets, training_args, spectral_args)
    columns = column_names(raw_datasets[splits[0]])
    text_column = data_args.text_column_name or next((name for name in ("text", "sentence") if name in columns), None)
    if text_column is None:
        raise UsageError(f"no `text` or `sentence` column: give --text_column_name (the columns are "
                         f"{', '.join(columns)})")
    for split in splits:
        check_column(raw_datasets[split], text_column, "--text_column_name")
        check_column(raw_datasets[split], data_args.label_column_name, "--label_column_name")

    # Labels: the class names of a ClassLabel column, else the distinct values of every split used, sorted
    label_feature = raw_datasets[splits[0]].features[data_args.label_column_name]
    if isinstance(label_feature, ClassLabel):
        label_list = list(label_feature.names)
        label_to_id = {index: index for index in range(len(label_list))}
    else:
        values = {value for split in splits for value in raw_datasets[split][data_args.label_column_name]}
        if any(isinstance(value, float) for value in values) or None in values:
            raise UsageError(f"--label_column_name {data_args.label_column_name!r} holds real numbers or empty "
                             "values: run_classification needs class labels")
        label_list = sorted(values)
        label_to_id = {value: index for index, value in enumerate(label_list)}
    if len(label_list) < 2:
        raise UsageError(f"the label column {data_args.label_column_name!r} has fewer than 2 classes: {label_list}")

    # Config, tokenizer, model
    config = build_config(model_args, num_labels=len(label_list),
                          id2label={index: str(label) for index, label in enumerate(label_list)},
                          label2id={str(label): index for index, label in enumerate(label_list)})
    train_texts = raw_datasets["train"][text_column] if "train" in raw_datasets else None
    tokenizer = build_tokenizer(model_args, train_texts, pad_token="<pad>")
    if tokenizer.pad_token is None:  # GPT-2 and Llama tokenizers: pad with the end-of-text token
        if tokenizer.eos_token is None:
            raise UsageError("the tokenizer has neither a padding nor an end-of-text token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    model = build_model(AutoModelForSequenceClassification, model_args, config, tokenizer)

    # hf_spectral's additions: energy gates, only the gates trainable, LoRA (PEFT trains the new head too)
    model = add_gates_and_lora(model, spectral_args, task_type="SEQ_CLS")

    # Tokenize; keep the depth column for the metrics
    def preprocess(examples):
        result = tokenizer(examples[text_column], truncation=True, max_length=data_args.max_seq_length)
        result["labels"] = [label_to_id[label] for label in examples[data_args.label_column_name]]
        return result

    processed = {}
    with training_args.main_process_first(desc="tokenizing"):
        for split in splits:
            dataset = raw_datasets[split]
            processed[split] = dataset.map(
                preprocess, batched=True, num_proc=data_args.preprocessing_num_workers,
                load_from_cache_file=not data_args.overwrite_cache,
                remove_columns=[name for name in dataset.column_names if name != data_args.depth_column_name])
    train_dataset = first_examples(processed.get("train"), data_args.max_train_samples)
    eval_dataset = first_examples(processed.get("validation"), data_args.max_eval_samples)
    test_dataset = first_examples(processed.get("test"), data_args.max_eval_samples)

    # Accuracy; at the end, also the accuracy at each nesting depth when the data has depths
    accuracy = load_metric("accuracy")

    def compute_metrics(eval_prediction):
        logits = eval_prediction.predictions
        predictions = np.asarray(logits[0] if isinstance(logits, tuple) else logits).argmax(-1)
        return accuracy.compute(predictions=predictions, references=np.asarray(eval_prediction.label_ids))

    def final_metrics(dataset, prefix: str) -> dict:
        output = trainer.predict(dataset, metric_key_prefix=prefix)  # in the dataset's order
        metrics = {**output.metrics, f"{prefix}_samples": len(dataset)}
        if data_args.depth_column_name in dataset.column_names:
            logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
            predictions, references = np.asarray(logits).argmax(-1), np.asarray(output.label_ids)
            depths = np.asarray(dataset[data_args.depth_column_name])
            for depth in sorted(set(depths.tolist())):
                metrics[f"{prefix}_accuracy_depth_{depth}"] = accuracy.compute(
                    predictions=predictions[depths == depth], references=references[depths == depth])["accuracy"]
        return metrics

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if training_args.bf16 or training_args.fp16
                                       else None)

    # The first training batches: a CHIAR-Former's calibration and routing logs, an rmt_optimal head's fit
    first_batches = None
    if train_dataset is not None:
        inputs = train_dataset.select_columns([name for name in MODEL_INPUTS if name in train_dataset.column_names])
        first_batches = fixed_batches(inputs, collator, spectral_args.calibration_batches,
                                      training_args.per_device_train_batch_size)
    log_callback = None
    if gate_values(model) or is_chiar(model):
        log_callback = TrainingLogCallback(first_batches if is_chiar(model) else None)
    if getattr(base_model(model).config, "classifier_pooling", None) == "rmt_optimal" and training_args.do_train:
        from hf_spectral.rmt import fit_rmt_pooling

        with said_as_usage_error("cannot fit the rmt_optimal pooling head"):  # (a resumed run loads its weights)
            fit_rmt_pooling(base_model(model), first_batches)
    prepare_for_training(model, training_args)

    trainer = SpectralTrainer(
        model=model,
        args=training_args,
        spectral_args=spectral_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=first_examples(eval_dataset, spectral_args.eval_samples_during_training),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
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
        metrics = {**train_result.metrics, "train_samples": len(train_dataset),
                   "trainable_parameters": trainable_parameters(model)}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        all_metrics.update(metrics)

    # Evaluation: the whole validation split (the curve may have read a part of it), the training examples in
    # evaluation mode, the test split
    if training_args.do_eval:
        metrics = final_metrics(eval_dataset, "eval")
        if spectral_args.train_eval_samples:
            scored = first_examples(train_dataset, spectral_args.train_eval_samples)
            train_metrics = trainer.evaluate(eval_dataset=scored, metric_key_prefix="eval_train")
            metrics["eval_train_loss"] = train_metrics["eval_train_loss"]
            metrics["eval_generalization_gap"] = metrics["eval_loss"] - metrics["eval_train_loss"]
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        all_metrics.update(metrics)
    if training_args.do_predict:
        metrics = final_metrics(test_dataset, "test")
        trainer.log_metrics("test", metrics)
        trainer.save_metrics("test", metrics)
        all_metrics.update(metrics)

    write_model_card(trainer, model_args, data_args, all_metrics, script="run_classification",
                     task="text-classification", tokenizer=tokenizer, log_callback=log_callback)
    return 0


if __name__ == "__main__":
    sys.exit(main())
