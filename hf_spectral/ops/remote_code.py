"""The code a saved checkpoint carries, so that it loads with ``trust_remote_code=True`` where hf_spectral is not
installed.

`save_model_code` copies the file that defines the saved object's class and the configuration file next to the
weights, with every relative import that leaves the file's folder (``from ...ops.energy_gate import X``) rewritten
to a sibling import (``from .energy_gate import X``), copies the files those imports name as siblings (recursively:
ops files import each other with single-dot imports), and writes a complete ``auto_map``: ``AutoConfig`` and every
Auto model class the modeling file defines a class for into ``config.json``, ``AutoTokenizer`` into
``tokenizer_config.json`` for a tokenizer.

It runs as well on code that was itself loaded with ``trust_remote_code``: that code already imports its siblings with
single dots, so saving a remotely loaded model copies the files unchanged. Hence this file imports only the standard
library and transformers, and travels with the checkpoint like the others.

transformers' own ``custom_object_save`` (used for classes given ``register_for_auto_class``) copies only files
imported with single-dot imports and takes ``from ...ops.x`` for a file named ``..ops.x.py``: the package does not
register its classes that way, their ``save_pretrained`` calls `save_model_code` instead.
"""

import ast
import inspect
import json
import os
import re
import shutil
import sys
from pathlib import Path

import transformers
from transformers.utils import logging

logger = logging.get_logger(__name__)

AUTO_MODEL_CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification")

# Which Auto class a modeling class belongs to, by the suffix of its name (transformers' naming convention).
_HEAD_SUFFIXES = {
    "AutoModelForCausalLM": ("ForCausalLM", "LMHeadModel"),
    "AutoModelForSequenceClassification": ("ForSequenceClassification",),
}

# The head of a relative import statement, `from <dots><module> import`, at the start of its line.
_RELATIVE_IMPORT_HEAD = re.compile(r"^(?P<head>[ \t]*from[ \t]+)\.+[\w.]*(?P<tail>[ \t]+import\b)")
# Inside the package, a file that imports the package by name could not run as remote code. (A copy loaded with
# trust_remote_code lives in transformers' module cache and has nothing to check.)
_PACKAGE = __name__.split(".")[0]
_PACKAGE_CHECKED = _PACKAGE not in ("transformers_modules", __name__)

CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# The models call transformers' masks, caches and model outputs by the names transformers 5.24 gave them
# (`create_causal_mask(cache=...)`, `outputs.cache`); before it they were `past_key_values`.
MINIMUM_TRANSFORMERS = "5.24.0"


def register_with_auto_class(config_class, auto_name: str, model_class) -> None:
    """``transformers.<auto_name>.register(config_class, model_class)``; a causal LM's class name also goes into
    transformers' table of causal-LM names, which the Auto registration does not touch: Trainer shifts the labels
    for label smoothing only for models named there (and would otherwise smooth a loss on unshifted labels), and
    pipelines take only the models named there."""
    getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
    if auto_name == "AutoModelForCausalLM":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(config_class.model_type, model_class.__name__)


def check_transformers_version(version: str) -> None:
    """Raise an ``ImportError`` naming both versions when transformers ``version`` is older than the models need.
    Every configuration and modeling file imports this file, in the package and in a saved checkpoint's code, so an
    old transformers is refused on import instead of failing inside a forward pass."""
    from packaging.version import Version

    if Version(version) < Version(MINIMUM_TRANSFORMERS):
        raise ImportError(
            f"hf_spectral's models need transformers >= {MINIMUM_TRANSFORMERS}, but transformers {version} is "
            f'installed: pip install -U "transformers>={MINIMUM_TRANSFORMERS},<6"'
        )


check_transformers_version(transformers.__version__)


class RemoteCodeError(ValueError):
    """The code of an object cannot be written as remote code (an import that cannot be flattened, a missing file)."""


def save_model_code(model_or_config, save_directory) -> list[str]:
    """Write the code that loads ``model_or_config`` into ``save_directory`` and record it in the ``auto_map``.

    Call it after ``save_pretrained`` wrote ``config.json`` (``tokenizer_config.json`` for a tokenizer) into
    ``save_directory``. Accepts a model (``PreTrainedModel``, also wrapped by ``torch.compile``), a config
    (``PreTrainedConfig``) or a tokenizer.

    * model or config: copies the configuration and modeling files (for a config alone, the modeling file loaded
      with it, when there is one: saving never imports code), the files they import, and sets
      ``auto_map`` in ``config.json`` to ``AutoConfig`` plus ``AutoModel``, ``AutoModelForCausalLM`` and
      ``AutoModelForSequenceClassification`` for each such class the modeling file defines for this config class,
      and sets the same ``auto_map`` on the config object, so that it equals the config loaded back;
    * tokenizer: copies the tokenizer's file (and what it imports) and sets ``auto_map["AutoTokenizer"]`` in
      ``tokenizer_config.json`` as transformers writes it (``[slow class, fast class]``).

    Existing ``auto_map`` entries for other Auto classes are kept. Every file is written under a temporary name and
    renamed into place (code files first, the JSON file last), so an interrupted save leaves no truncated file and
    never an ``auto_map`` naming a file that is not there. Returns the paths written.
    """
    save_directory = Path(save_directory)
    if not save_directory.is_dir():
        raise FileNotFoundError(
            f"save_directory {str(save_directory)!r} is not a directory: call save_pretrained first"
        )
    target = getattr(model_or_config, "_orig_mod", model_or_config)  # torch.compile wrapper -> the model

    if _is_tokenizer(target):
        classes = [type(target)]
        json_file = save_directory / TOKENIZER_CONFIG_FILE
        entries = {"AutoTokenizer": _tokenizer_auto_entry(type(target))}
        slow = getattr(target, "slow_tokenizer_class", None)
        if isinstance(slow, type):
            classes.append(slow)
    else:
        config = getattr(target, "config", None) if not _is_config(target) else target
        if not _is_config(config):
            raise TypeError(
                f"save_model_code expects a model, a config or a tokenizer, got {type(model_or_config).__name__}"
            )
        config_class = shipped_class(type(config))
        model_class = None if target is config else shipped_class(type(target))
        for cls in dict.fromkeys((model_class or config_class, config_class)):
            _source_file(cls)  # refuses transformers' own classes and classes defined outside a file, first
        model_classes = _model_classes(config, model_class, config_class)
        classes = [config_class, *model_classes.values()]
        json_file = save_directory / CONFIG_FILE
        entries = {"AutoConfig": f"{_module_stem(config_class)}.{config_class.__name__}"}
        entries.update({name: f"{_module_stem(cls)}.{cls.__name__}" for name, cls in model_classes.items()})

    if not json_file.is_file():
        raise FileNotFoundError(f"{json_file} does not exist: call save_pretrained before save_model_code")
    files = _code_files(classes)  # {destination name: rewritten source text}, everything checked before writing

    written = []
    for name, text in sorted(files.items()):
        destination = save_directory / name
        if destination.is_file() and destination.read_text(encoding="utf-8") == text:
            written.append(str(destination))  # e.g. already copied by transformers for remotely loaded code
            continue
        write_text_atomically(destination, text)
        written.append(str(destination))

    with open(json_file, encoding="utf-8") as handle:
        values = json.load(handle)
    auto_map = values.get("auto_map")
    auto_map = dict(auto_map) if isinstance(auto_map, dict) else {}
    auto_map.update(entries)
    for auto_name in AUTO_MODEL_CLASSES:
        # A config saved alone from remote code whose modeling file was never loaded: an entry it carried from its
        # own checkpoint would name a file this folder lacks (the model's own save writes it back with the file).
        reference = auto_map.get(auto_name)
        if auto_name not in entries and isinstance(reference, str):
            if not (save_directory / f"{reference.rpartition('.')[0]}.py").is_file():
                del auto_map[auto_name]
                logger.warning(f"{json_file}: saved without {auto_name} ({reference}): that code was not loaded "
                               "with the config (save the model, or load it in this process first)")
    values["auto_map"] = auto_map
    write_text_atomically(json_file, json.dumps(values, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    written.append(str(json_file))
    if not _is_tokenizer(target):
        # As transformers' own custom-code save does: the config holds what its file says, so that it equals the
        # config loaded back from the folder.
        config.auto_map = auto_map
    return written


# Arguments of ``save_pretrained(..., push_to_hub=True, ...)`` that belong to the upload.
_HUB_ARGUMENTS = ("repo_id", "commit_message", "commit_description", "private", "revision", "create_pr", "tags")


def save_pretrained_with_code(parent_save_pretrained, obj, save_directory, *args, **kwargs):
    """The body of a ``save_pretrained`` override: the parent's ``save_pretrained``, then `save_model_code`.

    ``parent_save_pretrained`` is the bound parent method (``super().save_pretrained``). The folder is written whole
    or not at all: the parent saves into a new folder inside ``save_directory``, the code joins it, and only then do
    the files move into place, ``config.json`` last, after the weights files of an earlier save that would not match
    the new ones are removed. A save that fails leaves ``save_directory`` as it was (a folder it created is removed).
    On a process other than the main one (``is_main_process=False``) the parent writes what it writes there and
    nothing more is done, and a model saving only its PEFT adapters (loaded through transformers' PEFT integration)
    needs no model code. ``push_to_hub=True`` uploads the folder as transformers does (the repository created
    first, then the files this save wrote, with a model card for a model), but after the code is written, which the
    parent's upload would precede; the code files are uploaded even where an earlier save had written them already.
    """
    push_to_hub = kwargs.pop("push_to_hub", False)
    hub_arguments = {name: kwargs.pop(name) for name in _HUB_ARGUMENTS if name in kwargs}
    bound = inspect.signature(parent_save_pretrained).bind_partial(save_directory, *args, **kwargs).arguments
    if not bound.get("is_main_process", True) or os.path.isfile(save_directory):
        # (transformers only logs an error for a save_directory that is a file, and writes nothing)
        return parent_save_pretrained(save_directory, *args, **kwargs)
    if push_to_hub:
        from transformers.utils.hub import hf_api

        repo_id = hub_arguments.pop("repo_id", None) or Path(save_directory).name
        repo_id = hf_api().create_repo(repo_id, private=hub_arguments.pop("private", None), token=kwargs.get("token"),
                                       exist_ok=True).repo_id
        timestamps = obj._get_files_timestamps(save_directory) if os.path.isdir(save_directory) else {}
    written, result = _save_whole(parent_save_pretrained, obj, Path(save_directory), args, kwargs)
    if push_to_hub:
        for path in written:
            timestamps.pop(path.name, None)
        tags = hub_arguments.pop("tags", None)
        if hasattr(obj, "model_tags"):  # a model: the Hub's card (or a new one), tagged, as transformers writes it
            from transformers.utils.hub import create_and_tag_model_card

            tags = [tags] if isinstance(tags, str) else list(tags or [])
            card = create_and_tag_model_card(repo_id, [*(obj.model_tags or []), *tags], token=kwargs.get("token"))
            card.save(os.path.join(save_directory, "README.md"))
        obj._upload_modified_files(save_directory, repo_id, timestamps, token=kwargs.get("token"), **hub_arguments)
    return result


# The weights files of a save (single, sharded, index), which a new save's weights replace as a whole.
_WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _save_whole(parent_save_pretrained, obj, save_directory: Path, args, kwargs):
    """Save into a staging folder inside ``save_directory``, then move the files into place; returns (the paths
    moved, what the parent returned)."""
    created = None
    if not save_directory.is_dir():
        created = save_directory
        while not created.parent.exists():  # the outermost folder this save creates, removed if it fails
            created = created.parent
        save_directory.mkdir(parents=True)
    staging = save_directory / f".saving-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        staging.mkdir()
        result = parent_save_pretrained(staging, *args, **kwargs)
        if not getattr(obj, "_hf_peft_config_loaded", False):
            save_model_code(obj, staging)
        staged = sorted(path.relative_to(staging) for path in staging.rglob("*") if path.is_file())
        new_weights = {path.name for path in staged if _WEIGHTS_FILE.fullmatch(path.name)}
        config = save_directory / CONFIG_FILE
        if config.is_file() and Path(CONFIG_FILE) in staged:
            config.unlink()  # interrupted from here on, the folder holds no config that mismatches its weights
        if new_weights:
            for path in save_directory.iterdir():
                if _WEIGHTS_FILE.fullmatch(path.name) and path.name not in new_weights and path.is_file():
                    path.unlink()
        moved = []
        for relative in sorted(staged, key=lambda path: path == Path(CONFIG_FILE)):  # config.json last
            (save_directory / relative).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / relative, save_directory / relative)
            moved.append(save_directory / relative)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return moved, result


# ----------------------------------------------------------------------------------------------------------------
# Which classes
# ----------------------------------------------------------------------------------------------------------------


def _is_config(obj) -> bool:
    from transformers import PreTrainedConfig

    return isinstance(obj, PreTrainedConfig)


def _is_tokenizer(obj) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(obj, PreTrainedTokenizerBase)


def _tokenizer_auto_entry(cls) -> list:
    # The layout transformers' `custom_object_save` gives a tokenizer: [slow class, fast class].
    name = f"{_module_stem(cls)}.{cls.__name__}"
    if not cls.__name__.endswith("Fast"):
        return [name, None]
    slow = getattr(cls, "slow_tokenizer_class", None)
    return [f"{_module_stem(slow)}.{slow.__name__}" if isinstance(slow, type) else None, name]


def auto_class_of(cls) -> str | None:
    """The Auto class a modeling class is loaded through, from its name (``...ForCausalLM`` / ``...LMHeadModel``,
    ``...ForSequenceClassification``, ``...Model`` for the bare model; ``None`` for a ``...PreTrainedModel`` base)."""
    name = cls.__name__
    for auto_name, suffixes in _HEAD_SUFFIXES.items():
        if name.endswith(suffixes):
            return auto_name
    if name.endswith("Model") and not name.endswith("PreTrainedModel"):
        return "AutoModel"
    return None


def shipped_class(cls: type) -> type:
    """The class whose code a checkpoint carries for ``cls``: ``cls`` where hf_spectral defines it (or a checkpoint's
    remote code does), else its nearest such ancestor. A user's subclass (in a notebook, or in a module importing
    hf_spectral by name) is saved as its hf_spectral base, which the checkpoint loads back as, as transformers loads
    a stock subclass's checkpoint as the stock class."""
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("hf_spectral", "transformers_modules"):
            return base
    return cls


def _model_classes(config, model_class, config_class) -> dict:
    """Auto class name -> class, for the model classes of ``config_class`` defined in the modeling module."""
    from transformers import PreTrainedModel

    if model_class is not None:
        module = sys.modules[model_class.__module__]
    else:  # a config alone: the modeling module loaded with it, or the config's own module
        module = _loaded_modeling_module(config, config_class) or sys.modules[config_class.__module__]
    found: dict[str, list] = {}
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, PreTrainedModel)
            and value.__module__ == module.__name__
            and _same_class(getattr(value, "config_class", None), config_class)
        ):
            auto_name = auto_class_of(value)
            if auto_name is not None:
                found.setdefault(auto_name, []).append(value)
    classes = {}
    for auto_name in AUTO_MODEL_CLASSES:
        candidates = found.get(auto_name, [])
        if model_class is not None and model_class in candidates:
            candidates = [model_class]
        if len(candidates) > 1:
            names = ", ".join(sorted(cls.__name__ for cls in candidates))
            raise RemoteCodeError(
                f"{module.__name__} defines several {auto_name} classes for {config_class.__name__}: {names}"
            )
        if candidates:
            classes[auto_name] = candidates[0]
    if model_class is not None and not classes:
        raise RemoteCodeError(
            f"{module.__name__} defines no class for {config_class.__name__} that an Auto class loads (expected "
            f"names ending in Model, ForCausalLM / LMHeadModel or ForSequenceClassification with that config_class)"
        )
    return classes


def _same_class(first, second) -> bool:
    # By name, as transformers' Auto classes compare them: remote code can hold two class objects for one config
    # class (transformers may execute a module file again when another Auto class loads it).
    return (
        isinstance(first, type)
        and first.__name__ == second.__name__
        and first.__module__.rpartition(".")[2] == second.__module__.rpartition(".")[2]
    )


def _loaded_modeling_module(config, config_class):
    """The modeling module loaded in this process that defines models for ``config_class`` and came with the code
    the config was loaded with, or ``None``. Saving imports nothing: a config whose modeling code is not loaded saves
    without model classes.

    In the package, and for remote code from the Hub (one folder per commit in transformers' module cache), it is
    the ``modeling_*`` module beside the configuration module. transformers caches the files of a local checkpoint
    in a folder per set of files, named by their hash, under a folder named after the checkpoint: there it is a
    modeling module under the same checkpoint folder whose own copy of the configuration file is this config's
    file, byte for byte, and whose file is the one in the folder the config was read from (two checkpoints of one
    folder name loaded in one process: the other one's modeling code is never shipped)."""
    package, _, stem = config_class.__module__.rpartition(".")
    if not stem.startswith("configuration_"):
        return None
    modeling_stem = stem.replace("configuration_", "modeling_", 1)
    beside = sys.modules.get(f"{package}.{modeling_stem}" if package else modeling_stem)
    if beside is not None and _defines_models_for(beside, config_class):
        return beside
    if not package.startswith("transformers_modules."):
        return None
    checkpoint = package.rpartition(".")[0]
    config_text = Path(sys.modules[config_class.__module__].__file__).read_bytes()
    source = Path(str(getattr(config, "_name_or_path", "") or "")) / f"{modeling_stem}.py"
    source_text = source.read_bytes() if source.parent.name and source.is_file() else None
    found = {}
    for name, module in list(sys.modules.items()):
        module_package, _, module_stem = name.rpartition(".")
        if module is None or module_stem != modeling_stem or module_package.rpartition(".")[0] != checkpoint:
            continue
        config_copy, module_text = Path(module.__file__).with_name(f"{stem}.py"), Path(module.__file__).read_bytes()
        if (config_copy.is_file() and config_copy.read_bytes() == config_text and source_text in (None, module_text)
                and _defines_models_for(module, config_class)):
            found[module_text] = module
    return next(iter(found.values())) if len(found) == 1 else None  # two different candidates: neither


def _defines_models_for(module, config_class) -> bool:
    from transformers import PreTrainedModel

    return any(
        isinstance(value, type) and issubclass(value, PreTrainedModel)
        and _same_class(getattr(value, "config_class", None), config_class)
        for value in vars(module).values()
    )


def _module_stem(cls) -> str:
    return Path(_source_file(cls)).stem


def _source_file(cls) -> str:
    if cls.__module__.split(".")[0] == "transformers":
        raise RemoteCodeError(
            f"{cls.__name__} is a transformers class: a checkpoint of it loads without remote code (nothing to save)"
        )
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if cls.__module__ == "__main__" or path is None or not path.endswith(".py"):
        raise RemoteCodeError(
            f"{cls.__name__} is defined in {cls.__module__!r}, not in a .py file: its code cannot be saved with a "
            "checkpoint (define it in a module)"
        )
    return path


# ----------------------------------------------------------------------------------------------------------------
# Which files, and their flattened text
# ----------------------------------------------------------------------------------------------------------------


def _code_files(classes) -> dict:
    """{file name in the checkpoint: text} for the files defining ``classes`` and everything they import relatively."""
    sources = {}  # destination name -> source path
    pending = [Path(_source_file(cls)).resolve() for cls in classes]
    texts = {}
    while pending:
        path = pending.pop()
        if path in sources.values():
            continue
        text, imported = flatten_imports(path)
        name = path.name
        if name in sources:
            # Remote code loaded through two Auto classes can come from two folders of transformers' module cache
            # (one per set of files): the same file twice is fine, two different files of one name are not.
            if texts[name] != text:
                raise RemoteCodeError(
                    f"two different files needed by the remote code have the same name {name!r}: "
                    f"{sources[name]} and {path}"
                )
            continue
        sources[name], texts[name] = path, text
        pending.extend(imported)
    return texts


def resolve_relative_import(path, dots: int, module: str) -> Path:
    """The file a ``from <dots><module> import`` line of the file ``path`` names (raises if it is not one file)."""
    path = Path(path)
    statement = f"from {'.' * dots}{module} import"
    if not module:
        raise RemoteCodeError(f"{path}: '{statement} ...' imports a package; import from its module file instead")
    base = path.parent
    for _ in range(dots - 1):
        base = base.parent
    target = base.joinpath(*module.split(".")).with_suffix(".py")
    if not target.is_file():
        if base.joinpath(*module.split(".")).is_dir():
            raise RemoteCodeError(f"{path}: '{statement} ...' imports a package; import from its module file instead")
        raise RemoteCodeError(f"{path}: '{statement} ...' names {target}, which does not exist")
    return target.resolve()


def flatten_imports(path) -> tuple[str, list[Path]]:
    """The text of ``path`` with each relative import rewritten to a sibling import, and the files imported.

    Imports are found with the parser (an example in a docstring is left alone); the rewrite replaces only the
    ``from <dots><module>`` head of the statement, so the file otherwise stays byte for byte as it is.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as error:
        raise RemoteCodeError(f"{path} is not valid Python: {error}") from error
    relative = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            relative.append(node)
        elif _PACKAGE_CHECKED and isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
            if any(name.split(".")[0] == _PACKAGE for name in names):
                raise RemoteCodeError(
                    f"{path}, line {node.lineno}: imports {_PACKAGE} by name, which a saved copy cannot do where "
                    f"{_PACKAGE} is not installed (import relatively: 'from ...ops.x import name')"
                )
    lines = text.splitlines(keepends=True)
    imported = []
    for node in sorted(relative, key=lambda node: node.lineno):
        module = node.module or ""
        target = resolve_relative_import(path, node.level, module)
        imported.append(target)
        line = lines[node.lineno - 1]
        lines[node.lineno - 1], count = _RELATIVE_IMPORT_HEAD.subn(rf"\g<head>.{target.stem}\g<tail>", line, count=1)
        if count != 1:
            raise RemoteCodeError(
                f"{path}, line {node.lineno}: write the relative import as 'from {'.' * node.level}{module} import' "
                "at the start of one line"
            )
    return "".join(lines), imported


def write_text_atomically(destination: str | Path, text: str) -> None:
    """Write ``text`` to ``destination`` through a new file in the same folder (O_EXCL, this writer's own name, mode
    0o666 filtered by the umask like any ordinary file), renamed over the destination once complete: a reader never
    sees half a file, writers of one file at once (processes of one run) never rename each other's away, and an
    interrupted write leaves neither a half file nor its temporary."""
    destination = Path(destination)
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, destination)
    except BaseException:
        if temporary.exists():
            temporary.unlink()
        raise
