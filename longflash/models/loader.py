"""Load an HF model directory: ``config.json`` + ``*.safetensors`` (single file or sharded with
``model.safetensors.index.json``). Only safetensors are read; no code from a checkpoint ever runs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from longflash.layers.parallel import tp_group_for_build
from longflash.models.base import CausalLM
from longflash.models.registry import get_model_class, resolve_architecture

logger = logging.getLogger("longflash")


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


def load_config(model_dir: str) -> dict:
    """Read ``config.json``. Raises ModelLoadError if missing or not JSON."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        hint = ""
        if not os.path.isdir(model_dir):
            hint = (f": there is no directory {model_dir!r}; longflash loads local checkpoint directories and does not "
                    f"download from the Hugging Face Hub (download it first, e.g. `hf download ORG/NAME --local-dir DIR`)")
        raise ModelLoadError(f"no config.json in model directory {model_dir!r}{hint}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"config.json in {model_dir!r} is not valid JSON: {e}") from e


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files, in index order when sharded.

    Raises ModelLoadError when there are none (e.g. only ``pytorch_model.bin``), or when the
    index names a missing shard.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise ModelLoadError(f"shard {name!r} listed in model.safetensors.index.json is missing")
        return [os.path.join(model_dir, n) for n in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir!r} (only safetensors checkpoints are supported)")
    return [os.path.join(model_dir, f) for f in files]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    """A "Loading weights" tqdm bar on a terminal, else a no-op: even a disabled tqdm creates tqdm's
    multiprocessing lock, a named semaphore that a TP worker killed with SIGKILL leaves behind
    ("resource_tracker: ... leaked semaphore objects"); and redirected to a file, the bar's carriage
    returns (it is cleared, not ended by a newline) glued the next log line onto it."""
    if enabled and sys.stderr.isatty():
        return tqdm(total=total, desc="Loading weights", unit="tensor", leave=False)
    return _NoBar()


def iterate_tensors(files: list[str], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    names = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.extend((path, k) for k in f.keys())
    bar = _progress_bar(len(names), progress)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
                bar.update(1)
    bar.close()


class LazyTensor:
    """A checkpoint tensor not read yet: ``shape``; ``full()`` reads it, ``narrow(dim,
    start, length)`` reads only that slice (``safe_open(...).get_slice``), so a tensor-parallel rank never
    materializes the whole tensor. Valid while the file it came from is open (during iteration)."""

    def __init__(self, handle, key: str):
        self._handle, self._key = handle, key
        self._slice = handle.get_slice(key)
        self.shape = tuple(self._slice.get_shape())

    def full(self) -> torch.Tensor:
        return self._handle.get_tensor(self._key)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]


def iterate_lazy_tensors(files: list[str], progress: bool = True) -> Iterator[tuple[str, LazyTensor]]:
    """Like :func:`iterate_tensors`, yielding :class:`LazyTensor` handles instead of loaded tensors."""
    n = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            n += len(f.keys())
    bar = _progress_bar(n, progress)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, LazyTensor(f, key)
                bar.update(1)
    bar.close()


def _tp_shards(model: CausalLM) -> dict[str, tuple[int, int, int, int]]:
    """Parameter name -> (dim, start, length, full size) of this rank's slice, from the modules'
    ``tp_shards`` (``layers/parallel.py``); absent for replicated parameters."""
    return {f"{mname}.{pname}" if mname else pname: spec for mname, m in model.named_modules()
            for pname, spec in getattr(m, "tp_shards", {}).items()}


_FROM_STATE = object()


def build_model(config: dict, dtype: torch.dtype, device: torch.device, tp=_FROM_STATE) -> CausalLM:
    """Instantiate the registered model for ``config`` without initialising weights.

    ``tp``: the ``comm.GroupCoordinator`` whose rank's shards to build (None: the full model); by
    default the TP group of ``comm.get_parallel_state()``."""
    cls = get_model_class(resolve_architecture(config))
    scope = contextlib.nullcontext() if tp is _FROM_STATE else tp_group_for_build(tp)
    with torch.device("meta"), scope:
        model = cls(config)
    model = model.to(dtype=dtype)
    for m in model.modules():  # routers stay fp32 (HF keeps them fp32 too)
        if hasattr(m, "e_score_correction_bias"):
            m.float()
        if hasattr(m, "keep_fp32_"):  # e.g. KDA A_log, dt_bias, conv kernels, o_norm (F32 in the checkpoint)
            m.keep_fp32_()
    return model.to_empty(device=device)


KV_SCALE_SUFFIXES = (".k_scale", ".kv_scale")


def load_kv_scale(model: CausalLM, ckpt_name: str, tensor: torch.Tensor) -> bool:
    """Set the fp8 KV ``k_scale`` of the attention module named by a checkpoint's ``*.k_scale`` (or
    older ``*.kv_scale``) tensor, e.g. ``model.layers.3.self_attn.k_scale`` (also ``…self_attn.attn.k_scale``).

    A multi-element scale is reduced to its max (one scale per layer row). Returns False when no
    attention module matches (the caller reports it as an unused tensor).
    """
    name = model.remap_checkpoint_name(ckpt_name)
    if name is None:
        return True
    parts = name.split(".")[:-1]
    while parts:
        try:
            module = model.get_submodule(".".join(parts))
        except AttributeError:
            module = None
        if module is not None and hasattr(module, "kv_cache") and hasattr(module, "k_scale"):
            module.k_scale = float(tensor.float().max())
            module.k_scale_source = "checkpoint"
            return True
        parts.pop()
    return False


def _load_into_sink(sinks: dict, name: str, ckpt_name: str, tensor: torch.Tensor) -> bool:
    """Hand ``tensor`` to the innermost sink module whose name prefixes ``name``; False if none does."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = sinks.get(".".join(parts[:i]))
        if module is not None:
            try:
                module.load_checkpoint_tensor(".".join(parts[i:]), tensor)
            except ValueError as e:
                raise ModelLoadError(f"tensor {ckpt_name!r}: {e}") from e
            return True
    return False


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, torch.Tensor | LazyTensor]]) -> None:
    """Copy checkpoint tensors (loaded, or :class:`LazyTensor` handles) into the model's parameters.

    A tensor-parallel parameter (``tp_shards``) receives only its slice of the checkpoint tensor (read
    alone from a LazyTensor); rows of a padded vocab shard past the vocabulary are zeroed.
    Raises ModelLoadError naming a tensor whose shape differs from the model's (the full, unsharded
    shape), or a parameter the checkpoint does not provide. Unknown tensors are skipped with one warning line.
    Modules with a ``load_checkpoint_tensor(relative_name, tensor)`` hook (stacked, packed weights such as
    ``MXFP4Experts``) receive the tensors under their name and report theirs missing through
    ``missing_checkpoint_tensors()``.
    """
    params = dict(model.named_parameters())
    shards = _tp_shards(model)
    sinks = {n: m for n, m in model.named_modules() if hasattr(m, "load_checkpoint_tensor")}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in tensors:
        if ckpt_name.endswith(KV_SCALE_SUFFIXES):
            if not load_kv_scale(model, ckpt_name, tensor.full() if isinstance(tensor, LazyTensor) else tensor):
                unexpected.append(ckpt_name)
            continue
        name = model.remap_checkpoint_name(ckpt_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            full = tensor.full() if isinstance(tensor, LazyTensor) and sinks else tensor
            if sinks and _load_into_sink(sinks, name, ckpt_name, full):
                continue
            unexpected.append(ckpt_name)
            continue
        shard = shards.get(name)
        expected = list(param.shape)
        if shard is not None:
            expected[shard[0]] = shard[3]
        if list(tensor.shape) != expected:
            raise ModelLoadError(f"tensor {ckpt_name!r} has shape {list(tensor.shape)} in the checkpoint, "
                                 f"expected {expected}")
        if shard is None:
            src, dst = (tensor.full() if isinstance(tensor, LazyTensor) else tensor), param
        else:
            dim, start, length, _ = shard
            src, dst = tensor.narrow(dim, start, length), param.narrow(dim, 0, length)
        with torch.no_grad():
            if dst.shape != param.shape:
                param.zero_()
            dst.copy_(src.to(param.dtype))
        loaded.add(name)
    loaded = model.tie_weights_if_needed(loaded)
    missing = [n for n in params if n not in loaded]
    missing += [f"{prefix}.{rel}" for prefix, m in sinks.items() for rel in m.missing_checkpoint_tensors()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    if unexpected:
        logger.warning("skipped %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[0])


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, progress: bool = True,
               tp=_FROM_STATE) -> tuple[CausalLM, dict]:
    """Config + weights -> an eval-mode model on ``device``. Under tensor parallelism (``tp``, by default
    the TP group of ``comm.get_parallel_state()``) only this rank's shards are built and read.
    Raises ModelLoadError / ValueError."""
    config = load_config(model_dir)
    files = safetensors_files(model_dir)
    model = build_model(config, dtype, device, tp)
    load_weights(model, iterate_lazy_tensors(files, progress))
    return model.eval(), model.config  # the text config for nested (multimodal) checkpoints
