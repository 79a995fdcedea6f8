"""Load an HF model directory: ``config.json`` + ``*.safetensors`` (single file or sharded with
``model.safetensors.index.json``). Only safetensors are read; no code from a checkpoint ever runs."""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from longflash.models.base import CausalLM
from longflash.models.registry import get_model_class, resolve_architecture

logger = logging.getLogger("longflash")


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


def load_config(model_dir: str) -> dict:
    """Read ``config.json``. Raises ModelLoadError if missing or not JSON."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"no config.json in model directory {model_dir!r}")
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


def iterate_tensors(files: list[str], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    names = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.extend((path, k) for k in f.keys())
    bar = tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not progress, leave=False)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
                bar.update(1)
    bar.close()


def build_model(config: dict, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Instantiate the registered model for ``config`` without initialising weights."""
    cls = get_model_class(resolve_architecture(config))
    with torch.device("meta"):
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


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model's parameters.

    Raises ModelLoadError naming a tensor whose shape differs from the model's, or a parameter the
    checkpoint does not provide. Unknown tensors are skipped with one warning line.
    Modules with a ``load_checkpoint_tensor(relative_name, tensor)`` hook (stacked, packed weights such as
    ``MXFP4Experts``) receive the tensors under their name and report theirs missing through
    ``missing_checkpoint_tensors()``.
    """
    params = dict(model.named_parameters())
    sinks = {n: m for n, m in model.named_modules() if hasattr(m, "load_checkpoint_tensor")}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in tensors:
        if ckpt_name.endswith(KV_SCALE_SUFFIXES):
            if not load_kv_scale(model, ckpt_name, tensor):
                unexpected.append(ckpt_name)
            continue
        name = model.remap_checkpoint_name(ckpt_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            if sinks and _load_into_sink(sinks, name, ckpt_name, tensor):
                continue
            unexpected.append(ckpt_name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(f"tensor {ckpt_name!r} has shape {list(tensor.shape)} in the checkpoint, "
                                 f"expected {list(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    loaded = model.tie_weights_if_needed(loaded)
    missing = [n for n in params if n not in loaded]
    missing += [f"{prefix}.{rel}" for prefix, m in sinks.items() for rel in m.missing_checkpoint_tensors()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    if unexpected:
        logger.warning("skipped %d checkpoint tensors the model does not use, e.g. %s", len(unexpected), unexpected[0])


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, progress: bool = True) -> tuple[CausalLM, dict]:
    """Config + weights -> an eval-mode model on ``device``. Raises ModelLoadError / ValueError."""
    config = load_config(model_dir)
    files = safetensors_files(model_dir)
    model = build_model(config, dtype, device)
    load_weights(model, iterate_tensors(files, progress))
    return model.eval(), model.config  # the text config for nested (multimodal) checkpoints
