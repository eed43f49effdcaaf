"""Checks of configuration values, shared by the model configs and the retrofit's gate config.

Each check raises a ``ValueError`` that names the field and the value it got, so that a typo in a config file or a
NaN from a sweep is refused where it enters instead of turning into NaN logits (or a silently changed model) later.
Booleans are refused where numbers are expected (``True`` is an ``int`` to Python, never a size or a rate here).
The models check their sizes against the memory where they are built (`check_parameters_fit`) when they are built,
not in the config: a config may be meant for another machine, or for the meta device.
"""

import contextvars
import dataclasses
import difflib
import functools
import math
import os
import re

from .remote_code import save_pretrained_with_code


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_finite(name: str, value) -> None:
    """A real number that is neither NaN nor infinite."""
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}")


def check_positive(name: str, value) -> None:
    """A finite number > 0 (epsilons, widths, bases)."""
    check_finite(name, value)
    if not value > 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}")


def check_non_negative(name: str, value) -> None:
    """A finite number >= 0 (weights of regularisers, standard deviations)."""
    check_finite(name, value)
    if not value >= 0:
        raise ValueError(f"`{name}` must be >= 0, got {value!r}")


def check_probability(name: str, value) -> None:
    """A dropout rate: a finite number in [0, 1)."""
    check_finite(name, value)
    if not 0 <= value < 1:
        raise ValueError(f"`{name}` must be in [0, 1), got {value!r}")


def check_positive_int(name: str, value) -> None:
    """An integer (not a bool) > 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def check_bool(name: str, value) -> None:
    """``True`` or ``False`` (not ``"no"``, not 0/1)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")


def check_choice(name: str, value, allowed) -> None:
    """One of ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"`{name}` must be one of {tuple(allowed)}, got {value!r}")


def check_index_list(name: str, values, size: int | None = None, *, allow_empty: bool = True) -> None:
    """A list of distinct integer indices >= 0 (and < ``size`` when given)."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"`{name}` must be a list of indices, got {values!r}")
    if not allow_empty and not values:
        raise ValueError(f"`{name}` must not be empty, got {values!r}")
    upper = "" if size is None else f", < {size}"
    for index in values:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0 or (size is not None and index >= size):
            raise ValueError(f"`{name}` must hold integer indices >= 0{upper}, got {index!r} in {list(values)!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"`{name}` lists an index twice: {list(values)!r}")


def check_energy_settings(
    energy_kind: str, *, projections, scales, morlet_learnable, normalization, eps, default_eps
) -> None:
    """Refuse the energy-gate settings that ``energy_kind`` (or ``normalization``) would ignore, and malformed scales.

    ``projections``, ``scales``, ``normalization`` and ``eps`` are ``(field name, value)`` pairs: the name is the one
    the config calls the field (``energy_projections`` in `EGAConfig`, ``projections`` in the retrofit's gate config),
    printed in the message. ``morlet_learnable`` is the value (both configs call it that); ``default_eps`` is the
    value of ``eps`` that ``normalization="none"`` accepts (the field's default)."""
    projections_name, projections = projections
    scales_name, scales = scales
    normalization_name, normalization = normalization
    eps_name, eps = eps
    if energy_kind != "linear" and projections != 1:
        raise ValueError(
            f"`{projections_name}={projections}` applies to linear energies (EGA-k) and would be ignored with "
            f"`energy_kind={energy_kind!r}`; its scales are set by `{scales_name}`"
        )
    if scales is None and energy_kind != "linear":  # (the configs fill the default scales when they are built)
        raise ValueError(
            f"`energy_kind={energy_kind!r}` needs `{scales_name}` (its kernel lengths or dilations); it is None, "
            f"e.g. because the kind was assigned after the config was built: set `{scales_name}` as well"
        )
    if scales is not None:
        if energy_kind == "linear":
            raise ValueError(
                f"`{scales_name}={scales!r}` applies to conv/morlet/db energies and would be ignored with "
                f"`energy_kind='linear'`; use `{projections_name}` for linear energies"
            )
        if not isinstance(scales, (list, tuple)) or not scales or any(
            not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in scales
        ):
            raise ValueError(f"`{scales_name}` must be a non-empty list of positive integers, got {scales!r}")
    if energy_kind != "morlet" and morlet_learnable is not True:
        raise ValueError(
            f"`morlet_learnable={morlet_learnable!r}` applies to Morlet energies and would be ignored with "
            f"`energy_kind={energy_kind!r}`"
        )
    if normalization == "none" and eps != default_eps:
        raise ValueError(
            f"`{eps_name}={eps!r}` bounds the std of the energy statistics and would be ignored with "
            f"`{normalization_name}='none'`"
        )


def parameter_blocks(config, *, learned_positions: bool) -> list[tuple[str, int, str, int]]:
    """The largest parameter tensors a model of this package builds from ``config``: (the fields that size one
    tensor, its elements, the fields that count the tensors, their number) for the token embedding, the learned
    position table (EGA-GPT's, ``learned_positions``) and the two MLP matrices of every layer. Attention, norms and
    heads come on top: a lower bound, so that `check_parameters_fit` never refuses a model that could be built."""
    hidden = config.hidden_size
    blocks = [("vocab_size × hidden_size", config.vocab_size * hidden, "", 1)]
    if learned_positions:
        blocks.append(("max_position_embeddings × hidden_size", config.max_position_embeddings * hidden, "", 1))
    blocks.append(("hidden_size × intermediate_size", hidden * config.intermediate_size, "2 × num_hidden_layers",
                   2 * config.num_hidden_layers))
    return blocks


def available_memory(device) -> int | None:
    """Bytes that parameters built on ``device`` can take: the physical memory for the CPU (what its allocations
    cannot exceed for long: beyond it the system swaps or ends the process), the free memory of a CUDA device plus
    what torch's caching allocator holds unused there. ``None`` where it cannot be told (other device types, a
    system without ``sysconf``)."""
    import torch

    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # Windows has no sysconf
            return None
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return None


def _parameters_stay_where_built() -> bool:
    """False where each parameter moves on as soon as it is made: accelerate's ``init_empty_weights`` replaces
    ``nn.Module.register_parameter`` to move it to the meta device, DeepSpeed ZeRO-3 partitions it. There only each
    tensor, not all of them together, must fit where it is built."""
    from torch import nn
    from transformers.integrations import is_deepspeed_zero3_enabled

    return nn.Module.register_parameter.__module__ == nn.Module.__module__ and not is_deepspeed_zero3_enabled()


def _bytes(count: int) -> str:
    size, unit = float(count), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{count:,} bytes" if unit == "bytes" else f"{size:,.1f} {unit} ({count:,} bytes)"


def check_parameters_fit(config, *, learned_positions: bool) -> None:
    """Refuse, before a model allocates anything, a ``config`` whose parameters (`parameter_blocks`) cannot be
    allocated where the model is built: on torch's default device in the default dtype, which ``from_config(config,
    dtype=...)`` and ``with torch.device("cuda"):`` set. The ``ValueError`` names the fields responsible, the bytes
    needed and the bytes available. Nothing is checked on the meta device (``from_pretrained`` builds there) nor
    where the memory cannot be told (`available_memory`): a model that fits builds as before."""
    import torch

    device = torch.get_default_device()
    available = None if device.type == "meta" else available_memory(device)
    if available is None:
        return
    dtype = torch.get_default_dtype()
    blocks = parameter_blocks(config, learned_positions=learned_positions)
    if _parameters_stay_where_built():  # all of them at once
        what = "the parameters of this model need"
        needed = sum(elements * count for _, elements, _, count in blocks) * dtype.itemsize
        fields, elements, count_fields, count = max(blocks, key=lambda block: block[1] * block[3])
        largest = f"{count_fields} × {fields}" if count_fields else fields
    else:  # one at a time
        fields, elements, _, _ = max(blocks, key=lambda block: block[1])
        what, needed, largest, count = "its largest parameter tensor needs", elements * dtype.itemsize, fields, 1
    if needed > available:
        raise ValueError(
            f"{type(config).__name__}: {what} at least {_bytes(needed)} of {dtype} on {device}, which has "
            f"{_bytes(available)}; {largest} alone takes {_bytes(elements * count * dtype.itemsize)}: lower "
            f"{' or '.join(re.findall('[a-z_]+', largest))}"
        )


# Keys transformers itself writes into or reads from a config.json besides the config's fields.
_TRANSFORMERS_KEYS = {
    "_name_or_path", "name_or_path", "model_type", "transformers_version", "auto_map", "torch_dtype", "dtype",
    "num_labels", "attn_implementation", "experts_implementation", "output_attentions", "per_layer_config",
    "_commit_hash", "custom_pipelines",
}


def take_field_overrides(config_class, kwargs: dict) -> dict:
    """Pop from ``kwargs`` (``from_pretrained(path, energy_kind=...)``) the values of ``config_class``'s own fields, so
    that they are checked together with the file's values instead of being assigned after the checks ran."""
    from transformers import PreTrainedConfig

    base = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    own = [field.name for field in dataclasses.fields(config_class) if field.name not in base]
    return {name: kwargs.pop(name) for name in own if name in kwargs}


@functools.cache
def known_config_keys(config_class) -> frozenset[str]:
    """Every key a ``config_class`` (a ``PreTrainedConfig`` dataclass) knows: its fields (with the base config's),
    its ``attribute_map`` aliases, and the keys transformers itself writes into a config.json or reads from the
    constructor's keywords (``_name_or_path``, ``auto_map``, ``attn_implementation``, generation parameters...)."""
    from transformers import GenerationConfig, PreTrainedConfig

    fields = {field.name for field in dataclasses.fields(config_class)}
    base = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    attribute_map = getattr(config_class, "attribute_map", {}) or {}
    known = fields | base | _TRANSFORMERS_KEYS | set(attribute_map) | set(PreTrainedConfig().to_dict())
    return frozenset(known | set(GenerationConfig._get_default_generation_params()))


def describe_unknown_keys(config_class, keys) -> str:
    """``keys`` (unknown to ``config_class``) as a readable list, each with the closest field name when one is close
    (``energy_normalisation`` → ``energy_normalization``)."""
    fields = sorted(field.name for field in dataclasses.fields(config_class))
    described = []
    for key in keys:
        close = difflib.get_close_matches(key, fields, n=1)
        described.append(f"`{key}` (did you mean `{close[0]}`?)" if close else f"`{key}`")
    return ", ".join(described)


def check_known_keys(config_class, keys, where: str) -> None:
    """Raise a ``ValueError`` naming the ``keys`` that ``config_class`` does not know (`known_config_keys`), for the
    calls (``where``, e.g. ``EGAConfig.from_variant``) that take field values only: there a misspelt field would
    otherwise become a stray attribute while the field keeps its default."""
    unknown = [key for key in keys if key not in known_config_keys(config_class)]
    if unknown:
        raise ValueError(
            f"{where}: unknown keyword(s) {describe_unknown_keys(config_class, unknown)}; the fields of "
            f"{config_class.__name__} are listed in its docstring"
        )


def warn_about_loaded_keys(config_class, config_dict: dict, logger) -> None:
    """Warn, naming them, about the config class's own fields that ``config_dict`` (a loaded config.json) lacks —
    their defaults then decide the computation, which may not be what the checkpoint was trained with — and about
    keys that are no field of the class (a misspelt field is otherwise ignored without a word).

    A config saved by ``save_pretrained`` holds every field of its class that transformers' base config does not
    have, so loading one is silent."""
    from transformers import PreTrainedConfig

    base = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    fields = {field.name for field in dataclasses.fields(config_class)}
    missing = sorted(name for name in fields - base if name not in config_dict)
    unknown = sorted(key for key in config_dict if key not in known_config_keys(config_class))
    name = config_class.__name__
    if missing:
        defaults = ", ".join(f"{field}={getattr(config_class, field, None)!r}" for field in missing)
        logger.warning(
            f"{name}: the loaded config has no value for {missing}; using the defaults ({defaults}). If the "
            "checkpoint was made with other values, its outputs will differ: add them to its config.json."
        )
    if unknown:
        logger.warning(
            f"{name}: the loaded config has keys that are not {name} fields and are ignored: {unknown} (a misspelt "
            "field name? the fields are listed in the class docstring)"
        )


# True while `CheckedConfigMixin.from_dict` builds a config: the loaded keys were already checked (and warned about as
# keys of the loaded config), so the constructor does not warn about them a second time.
_LOADING_CONFIG = contextvars.ContextVar("hf_spectral_loading_config", default=False)


class CheckedConfigMixin:
    """What the package's checked configs (`EGAConfig`, `ChiarConfig`) add to ``PreTrainedConfig``; put it before
    ``PreTrainedConfig`` in the bases. The config defines ``_validate()``, which runs every check of its values.

    * ``save_pretrained`` writes the model code beside the config (`save_pretrained_with_code`), so that
      ``AutoModelForCausalLM.from_config(config, trust_remote_code=True)`` works where hf_spectral is not installed;
    * ``validate_field_values``, a `@strict` class validator, re-runs ``_validate()`` on ``save_pretrained``;
    * ``from_dict`` checks overriding fields together with the file's values and warns about missing and unknown
      keys (`take_field_overrides`, `warn_about_loaded_keys`), through the logger of the config's module;
    * the constructor warns about keywords that are no field (``EGAConfig(energy_normalisation="window")``):
      transformers keeps them as attributes by design, so they are not refused, but a misspelt field would
      otherwise leave the field at its default without a word.
    """

    def __post_init__(self, **kwargs):
        # `kwargs` holds the keywords that are no dataclass field (transformers sets them as plain attributes).
        if kwargs and not _LOADING_CONFIG.get():
            unknown = [key for key in kwargs if key not in known_config_keys(type(self))]
            if unknown:
                from transformers.utils import logging

                name = type(self).__name__
                logging.get_logger(type(self).__module__).warning(
                    f"{name}: keyword(s) that are no {name} field, kept as plain attributes the models do not read: "
                    f"{describe_unknown_keys(type(self), unknown)}"
                )
        super().__post_init__(**kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, then the model code beside the config (``ops/remote_code.py``), so that
        ``AutoModelForCausalLM.from_config(config, trust_remote_code=True)`` works where hf_spectral is not installed."""
        return save_pretrained_with_code(super().save_pretrained, self, save_directory, *args, **kwargs)

    def validate_field_values(self):
        """`@strict` class validator: re-runs the checks on `save_pretrained`, so that a value assigned after
        construction (`config.layer_norm_eps = float("nan")`) is refused before it reaches a config.json."""
        self._validate()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' `from_dict` (used by every `from_pretrained`), plus a warning naming the fields a loaded
        config lacks (their defaults decide the computation) and the keys it has that are no field; overriding
        fields (`from_pretrained(path, hidden_size=128)`) are checked together with the file's values."""
        from transformers.utils import logging

        config_dict = {**config_dict, **take_field_overrides(cls, kwargs)}
        warn_about_loaded_keys(cls, config_dict, logging.get_logger(cls.__module__))
        loading = _LOADING_CONFIG.set(True)
        try:
            return super().from_dict(config_dict, **kwargs)
        finally:
            _LOADING_CONFIG.reset(loading)


__all__ = [
    "CheckedConfigMixin",
    "available_memory",
    "check_energy_settings",
    "check_parameters_fit",
    "check_known_keys",
    "describe_unknown_keys",
    "known_config_keys",
    "parameter_blocks",
    "take_field_overrides",
    "warn_about_loaded_keys",
    "check_bool",
    "check_choice",
    "check_finite",
    "check_index_list",
    "check_non_negative",
    "check_positive",
    "check_positive_int",
    "check_probability",
]
