"""`RecipeTrainer`: what its saves write gets ordinary permissions, and nothing else in the folder changes mode."""

import os
import stat

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from training.common.trainer import RecipeTrainer


def test_save_model_gives_the_model_files_the_umasks_modes_and_leaves_the_folders_other_files_alone(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "private_notes.txt").write_text("mine")
    os.chmod(folder / "private_notes.txt", 0o600)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16))
    trainer = RecipeTrainer(model=model, args=TrainingArguments(output_dir=str(folder), report_to=[]))
    previous = os.umask(0o022)
    try:
        trainer.save_model()
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert modes.pop("private_notes.txt") == 0o600
    assert modes["model.safetensors"] == 0o644 and modes == dict.fromkeys(modes, 0o644), modes
