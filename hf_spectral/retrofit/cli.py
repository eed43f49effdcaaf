"""``hf-spectral retrofit SRC DST``: write a copy of a checkpoint folder with energy gates added."""

import argparse
import os
import shutil
import stat
import sys
import uuid
from dataclasses import fields

from ..file_permissions import apply_umask, current_umask, make_folders
from .config import EnergyGateConfig


# What a checkpoint folder holds when it has a tokenizer (any one of them).
TOKENIZER_FILES = (
    "tokenizer_config.json", "tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
    "spiece.model", "special_tokens_map.json",
)


# Files of SRC that the copy takes over when saving the model and tokenizer did not write them: documents and small
# metadata (model card, license, use policy, chat template, ...). Weights of any format (a checkpoint folder may hold
# ONNX, TFLite, Rust or sharded copies: stale, gate-less and large) and code stay behind, as do subfolders.
# Other JSON files stay behind: a shard index or an adapter_config.json would send loading the copy elsewhere.
CARRIED_SUFFIXES = (".md", ".txt", ".jinja")
CARRIED_PREFIXES = ("README", "LICENSE", "LICENCE", "NOTICE", "COPYING", "USE_POLICY")
CARRIED_NAMES = ("chat_template.json",)


def _hub_blob(src: str, path: str) -> str | None:
    """The file that the link ``path`` of SRC points to where SRC is a snapshot of a Hub cache repository
    (``.../models--org--name/snapshots/<revision>``) and the link resolves into that repository's ``blobs/``, as
    huggingface_hub lays out every file of a snapshot; None for any other link."""
    snapshot = os.path.realpath(src)
    repository = os.path.dirname(os.path.dirname(snapshot))
    if os.path.basename(os.path.dirname(snapshot)) != "snapshots" or not os.path.basename(repository).startswith(
        "models--"
    ):
        return None
    target = os.path.realpath(path)
    return target if os.path.dirname(target) == os.path.realpath(os.path.join(repository, "blobs")) else None


def _carry_other_files(src: str, staging: str) -> tuple[list[str], list[str]]:
    """Copy into ``staging`` the files at the top of SRC that it lacks and that CARRIED_SUFFIXES, CARRIED_PREFIXES
    or CARRIED_NAMES name. Returns the names copied, and those skipped with the reason.

    A symbolic link is followed only into its Hub cache repository's ``blobs/`` (`_hub_blob`); any other link is
    skipped, so that the copy never holds, ready to push, a file that SRC only points to. A copy's mode is its
    source's less the umask (0666 at most): never wider than the source's."""
    carried, skipped = [], []
    file_mode = 0o666 & ~current_umask()
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        wanted = name.endswith(CARRIED_SUFFIXES) or name.upper().startswith(CARRIED_PREFIXES) or name in CARRIED_NAMES
        if not wanted or name.startswith(".") or os.path.lexists(os.path.join(staging, name)):
            continue
        source = path
        if os.path.islink(path):
            source = _hub_blob(src, path)
            if source is None:
                skipped.append(f"{name} (a link to {os.readlink(path)}: only a Hub cache snapshot's links into its "
                               "blobs/ are followed)")
                continue
        if not os.path.isfile(source):  # a folder, a socket, ...
            continue
        with open(source, "rb") as reader:
            mode = stat.S_IMODE(os.fstat(reader.fileno()).st_mode) & file_mode
            # Created with the final mode, so that the copy is never readable more widely, not even for a moment.
            descriptor = os.open(os.path.join(staging, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with open(descriptor, "wb") as writer:
                shutil.copyfileobj(reader, writer)
        carried.append(name)
    return carried, skipped


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-spectral retrofit",
        description="Add energy gates to the checkpoint in SRC (GPT-2, Llama, Mistral, Qwen2) and save it to DST. "
        "With the default alpha-init 0 the new model's outputs equal the original's. SRC's other files (model card, "
        "license, chat template, ...) are copied along, each with its own mode less the umask (never wider); its "
        "weights in other formats, code, subfolders and links are not, except a Hub cache snapshot's links into its "
        "blobs/ (listed as not copied).",
    )
    parser.add_argument("src", help="checkpoint folder (config.json + weights)")
    parser.add_argument("dst", help="output folder (must not exist, unless --overwrite)")
    helps = {f.name: f.metadata["help"] for f in fields(EnergyGateConfig)}  # one text per setting, the config's
    parser.add_argument("--normalization", default="causal", choices=["causal", "window", "none"],
                        help=helps["normalization"])
    parser.add_argument("--energy-kind", default="linear", choices=["linear", "conv", "morlet", "db2", "db4"],
                        help=helps["energy_kind"])
    parser.add_argument("--projections", type=int, default=1, help=helps["projections"])
    parser.add_argument("--scales", type=_int_list, default=None,
                        help="kernel lengths (conv, morlet; default 3,7,15,31) or dilations (db2, db4; default "
                        "1,2,4,8), comma-separated")
    parser.add_argument("--layers", type=_int_list, default=None, help="layer indices to gate, e.g. 0,1,2 (default all)")
    parser.add_argument("--heads", type=_int_list, default=None, help="key/value head indices to gate (default all)")
    parser.add_argument("--tau-init", type=float, default=0.0, help=helps["tau_init"])
    parser.add_argument("--alpha-init", type=float, default=0.0, help=helps["alpha_init"])
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace DST if it exists (DST may be SRC: what SRC held besides the files copied along goes)",
    )
    return parser


def _fail(message: str) -> int:
    """One line on stderr and exit status 2 (argparse's status for bad usage): bad input is not a crash."""
    print(f"hf-spectral retrofit: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(os.path.join(args.src, "config.json")):
        return _fail(f"{args.src} is not a checkpoint folder (no config.json)")
    if os.path.exists(args.dst) and not os.path.isdir(args.dst):
        return _fail(f"{args.dst} exists and is not a folder")
    if os.path.exists(args.dst) and not args.overwrite:
        return _fail(f"{args.dst} exists; pass --overwrite to replace it")
    dst, src, cwd = (os.path.realpath(path) for path in (args.dst, args.src, os.getcwd()))
    if os.path.exists(dst):  # replacing DST deletes what it holds: never the current folder, nor SRC below it
        if os.path.commonpath([dst, cwd]) == dst:
            return _fail(f"DST {args.dst} is or holds the current folder, which replacing it would delete")
        if src != dst and os.path.commonpath([dst, src]) == dst:
            return _fail(f"DST {args.dst} holds SRC {args.src}, which replacing it would delete")
    try:
        gate_config = EnergyGateConfig(
            normalization=args.normalization, energy_kind=args.energy_kind, projections=args.projections,
            scales=args.scales, layers=args.layers, heads=args.heads, tau_init=args.tau_init,
            alpha_init=args.alpha_init,
        )
    except ValueError as error:
        return _fail(str(error))

    from transformers import AutoConfig, AutoTokenizer

    import transformers

    import torch

    from .model import add_energy_gates, check_supported
    from .modeling_energy_gated import check_class_supported

    try:
        config = AutoConfig.from_pretrained(args.src)
    except (OSError, ValueError) as error:
        return _fail(f"cannot read {os.path.join(args.src, 'config.json')}: {error}")
    if getattr(config, "energy_gates", None) is not None or str(config.model_type).startswith("energy_gated_"):
        return _fail(f"{args.src} already has energy gates (config.energy_gates): retrofit the original checkpoint, "
                     "or load this one with AutoModelForCausalLM")
    architectures = config.architectures
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    model_class = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        return _fail(f"cannot tell the model class of {args.src}: config.architectures={architectures!r} does not "
                     "start with the name of a transformers model class")
    try:
        # Checked on the meta device, from the config alone: an unsupported model is refused before any weight loads.
        check_class_supported(model_class)
        with torch.device("meta"):
            check_supported(model_class(config))
    except ValueError as error:
        return _fail(str(error))
    try:
        model = model_class.from_pretrained(args.src)
    except Exception as error:  # noqa: BLE001  (corrupt weights raise safetensors', pickle's, torch's own errors)
        return _fail(f"cannot load the weights of {args.src}: {type(error).__name__}: {error}")
    try:
        # Checks the layer and head indices against this model; needs PyWavelets for db2/db4 energies.
        model = add_energy_gates(model, gate_config)
    except (ValueError, ImportError) as error:
        return _fail(str(error))

    # Build the copy next to DST and move it into place at the end: no half-written folder on failure. DST gets
    # the permissions of any folder the user creates (the umask's), not mkdtemp's or safetensors' private ones.
    parent = os.path.dirname(os.path.abspath(args.dst))
    try:
        created = make_folders(parent)  # removed again if the retrofit fails
    except OSError as error:  # a file where a folder of DST's path should be, no permission, ...
        return _fail(f"cannot create the folder {parent} for {args.dst}: {error}")
    staging = os.path.join(parent, f".retrofit-{uuid.uuid4().hex}")
    done = False
    try:
        os.mkdir(staging)
        model.save_pretrained(staging)
        # Only a tokenizer SRC has: from a folder without one, AutoTokenizer may build an empty tokenizer from the
        # config (GPT-2: a vocabulary of 1 that encodes any text to nothing) instead of failing.
        if any(os.path.exists(os.path.join(args.src, name)) for name in TOKENIZER_FILES):
            try:
                AutoTokenizer.from_pretrained(args.src).save_pretrained(staging)
            except (OSError, ValueError, TypeError) as error:
                return _fail(f"cannot copy the tokenizer of {args.src}: {type(error).__name__}: {error}")
        apply_umask(staging)  # all it holds is new; safetensors writes its files as 0600
        try:
            carried, skipped = _carry_other_files(args.src, staging)  # (with modes of their own)
        except OSError as error:
            return _fail(f"cannot copy the other files of {args.src}: {error}")
        old = None
        if os.path.exists(args.dst):  # moved aside, and deleted only once the new folder is in place
            old = os.path.join(parent, f".retrofit-old-{uuid.uuid4().hex}")
            os.replace(args.dst, old)
        try:
            os.replace(staging, args.dst)
        except OSError:
            if old is not None:  # DST as it was
                os.replace(old, args.dst)
            raise
        done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as error:  # a full disk, no permission: said as an error, and nothing half-written is left
        return _fail(f"cannot write {args.dst}: {error}")
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging)
        if not done and created is not None and os.path.isdir(created):
            shutil.rmtree(created)
    print(f"wrote {args.dst}: {architecture} with energy gates {gate_config.to_dict()}")
    if carried:
        print(f"copied from {args.src}: {', '.join(carried)}")
    if skipped:
        print(f"not copied from {args.src}: {', '.join(skipped)}")
    return 0
