"""Adapter directories from outside, checked before peft reads a byte of them.

``turnrl eval --adapter DIR``, ``turnrl credit-audit --adapter DIR`` and the adapters of a run
directory (``--run-dir R --iteration N``, ``turnrl export``) are folders someone else may have
written. :func:`check_adapter_dir` holds one to these rules, each failure one
:class:`AdapterError` line naming the file and the field:

* the folder is a local directory (peft would take any other string for a hub id);
* ``adapter_config.json`` is a regular file (no FIFO, no device) of at most
  :data:`MAX_CONFIG_BYTES`, one bounded JSON object (:func:`turnrl.bounded.check_bounded`)
  that :class:`AdapterConfigFile` accepts: a LoRA adapter (``peft_type: LORA``) of rank
  ``r`` in 1..:data:`~turnrl.bounded.MAX_LORA_RANK` with a finite ``lora_alpha``; module
  names that are names (peft runs a string ``target_modules``, and the keys of
  ``rank_pattern``/``alpha_pattern``, as regular expressions over every module name);
  no ``layer_replication`` (it rebuilds the base model's layers), no initialisation that
  rewrites the base weights (``init_lora_weights`` other than true/false/"gaussian"), no
  sub-configuration (``*_config``: LoftQ, EVA, CorDA, Megatron, ...) and no
  ``megatron_core`` but peft's default (peft imports that module by its name). Other keys,
  as a newer peft writes them, pass when they are plain values;
* the weights are ``adapter_model.safetensors``, a regular file of at most
  :data:`MAX_WEIGHTS_BYTES` whose header (at most :data:`MAX_HEADER_BYTES`) safetensors
  parses, and whose LoRA matrices have the rank the config states (so what peft allocates is
  what the file holds, never ``r: 1e9`` rows of nothing);
* ``adapter_model.bin`` is a pickle — reading one runs code — so it is refused, never opened.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from turnrl.bounded import MAX_LORA_RANK, InputTooLarge, check_bounded, short_repr
from turnrl.sections import error_lines, strict_validate

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
MAX_CONFIG_BYTES = 64 << 10
"""Largest ``adapter_config.json`` read (peft writes about 1.5 kB)."""
MAX_HEADER_BYTES = 16 << 20
"""Largest safetensors header read (a LoRA adapter of every linear layer of a 100-layer model: ~200 kB)."""
MAX_WEIGHTS_BYTES = 1 << 36
"""Largest adapter weights file (64 GiB: rank 4096 on every linear layer of a 4B model is ~34 GB in float32)."""
MAX_LORA_ALPHA = 1e6
"""Largest ``lora_alpha`` (the scale alpha/r multiplies every update; past this float32 merges overflow)."""

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,200}$")]
"""A module name (or a pattern peft matches as one): letters, digits, ``_``, ``.``, ``-``; no regex syntax."""


class AdapterError(ValueError):
    """An adapter directory breaks a rule; the message names the file, the field and the fix."""


class AdapterConfigFile(BaseModel):
    """The fields of ``adapter_config.json`` that decide what peft builds, typed with bounds."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    peft_type: Literal["LORA"]
    r: int = Field(ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = Field(gt=0, le=MAX_LORA_ALPHA)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: Annotated[list[Name], Field(max_length=4096)] | Literal["all-linear"] | None = None
    exclude_modules: Annotated[list[Name], Field(max_length=4096)] | None = None
    modules_to_save: Annotated[list[Name], Field(max_length=4096)] | None = None
    rank_pattern: Annotated[dict[Name, Annotated[int, Field(ge=1, le=MAX_LORA_RANK)]], Field(max_length=4096)] = {}
    alpha_pattern: Annotated[dict[Name, Annotated[float, Field(gt=0, le=MAX_LORA_ALPHA)]], Field(max_length=4096)] = {}
    layers_pattern: Name | Annotated[list[Name], Field(max_length=64)] | None = None
    layers_to_transform: (
        Annotated[int, Field(ge=0)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)] | None
    ) = None  # noqa: E501
    init_lora_weights: bool | Literal["gaussian"] = True
    layer_replication: None = None
    megatron_core: Literal["megatron.core"] | None = "megatron.core"
    alora_invocation_tokens: None = None
    use_dora: bool = False
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    bias: Literal["none", "all", "lora_only"] = "none"
    task_type: Name | None = None

    @model_validator(mode="after")
    def _plain_extras(self) -> AdapterConfigFile:
        for key, value in (self.model_extra or {}).items():
            if key.endswith("_config"):
                if value not in (None, {}):
                    raise ValueError(
                        f"{key}: a sub-configuration runs code of its own when peft loads the adapter; only null"
                        f" or {{}} is accepted (got {short_repr(value)})"
                    )
            elif not _plain(value):
                raise ValueError(f"{key}: expected a plain value (a number, string, boolean or a short list), got"
                                 f" {short_repr(value)}")  # fmt: skip
        return self

    def ranks(self) -> set[int]:
        """Every rank a LoRA matrix of this adapter may have (``r`` and the ranks of ``rank_pattern``)."""
        return {self.r, *self.rank_pattern.values()}


def _plain(value: Any) -> bool:
    scalar = (type(None), bool, int, float, str)
    if isinstance(value, str):
        return len(value) <= 1000
    if isinstance(value, list):
        return len(value) <= 4096 and all(isinstance(v, scalar) and _plain(v) for v in value)
    return isinstance(value, scalar)


def _regular_file(path: Path, limit: int, what: str) -> int:
    """The size of ``path`` if it is a regular file of at most ``limit`` bytes, else an AdapterError."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise AdapterError(f"{path}: missing; an adapter directory holds {CONFIG_NAME} and {WEIGHTS_NAME}") from None
    if not stat.S_ISREG(info.st_mode):
        raise AdapterError(f"{path}: not a regular file; {what} must be a plain file (not a FIFO, device or folder)")
    if info.st_size > limit:
        raise AdapterError(f"{path}: {info.st_size:,} bytes; {what} is at most {limit:,} bytes")
    return info.st_size


def read_adapter_config(path: Path) -> AdapterConfigFile:
    """``adapter_config.json`` checked against :class:`AdapterConfigFile` (module doc)."""
    _regular_file(path, MAX_CONFIG_BYTES, CONFIG_NAME)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        check_bounded(data, str(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: not valid JSON ({exc}); write it with peft's save_pretrained") from None
    except (InputTooLarge, RecursionError):
        raise AdapterError(f"{path}: the JSON is larger or deeper than an adapter config") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return strict_validate(AdapterConfigFile, data)
    except ValidationError as exc:
        raise AdapterError(f"{path}: field " + "; ".join(error_lines(exc))) from None


def _check_weights(path: Path, config: AdapterConfigFile) -> None:
    from safetensors import SafetensorError, safe_open

    size = _regular_file(path, MAX_WEIGHTS_BYTES, WEIGHTS_NAME)
    with path.open("rb") as fh:
        head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
        raise AdapterError(
            f"{path}: header length {n:,} does not fit the file ({size:,} bytes, header at most {MAX_HEADER_BYTES:,});"
            " not a safetensors file"
        )
    try:
        with safe_open(str(path), "pt") as f:
            shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{path}: not a valid safetensors file ({type(exc).__name__}: {str(exc)[:200]})") from None
    ranks = config.ranks()
    for name, shape in shapes.items():
        dim = 0 if "lora_A" in name or "lora_embedding_A" in name else 1
        if ("lora_A" in name or "lora_B" in name or "lora_embedding_" in name) and (
            len(shape) <= dim or shape[dim] not in ranks
        ):
            raise AdapterError(
                f"{path}: tensor {short_repr(name)} has shape {shape}, not rank r = {config.r} of {CONFIG_NAME}"
                f" (field 'r'{' or rank_pattern' if config.rank_pattern else ''}); the two files do not belong together"
            )


def check_adapter_dir(path: str | Path) -> AdapterConfigFile:
    """The adapter directory ``path`` held to the rules of the module doc; its checked config."""
    path = Path(path)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise AdapterError(f"adapter {path} {what}; give a peft adapter directory (adapter_config.json + weights)")
    weights = path / WEIGHTS_NAME
    if not weights.exists() and (path / PICKLE_NAME).exists():
        raise AdapterError(
            f"{path / PICKLE_NAME}: a pickle (reading one runs code), not loaded; save the adapter as"
            f" {WEIGHTS_NAME} (peft's save_pretrained with safe_serialization=True)"
        )
    config = read_adapter_config(path / CONFIG_NAME)
    _check_weights(weights, config)
    return config
