"""Model registry keyed by the HF ``architectures`` entry."""

from __future__ import annotations

import importlib

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("longflash.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen3ForCausalLM": ("longflash.models.qwen3", "Qwen3ForCausalLM"),
    "KimiK3ForCausalLM": ("longflash.models.kimi_k3", "KimiK3ForCausalLM"),
    "KimiK3ForConditionalGeneration": ("longflash.models.kimi_k3", "KimiK3ForCausalLM"),
    "KimiLinearForCausalLM": ("longflash.models.kimi_linear", "build_kimi_linear"),
}

# model_type values that imply an architecture when ``architectures`` is absent.
_MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "kimi_k3": "KimiK3ForCausalLM", "kimi_linear": "KimiLinearForCausalLM"}


def register_model(architecture: str, module: str, cls: str, model_type: str | None = None) -> None:
    _MODELS[architecture] = (module, cls)
    if model_type:
        _MODEL_TYPES[model_type] = architecture


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(config: dict) -> str:
    """The registered architecture named by ``config``.

    Raises ValueError naming the unknown architecture and listing the supported ones.
    """
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    if not archs and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    name = ", ".join(archs) if archs else f"model_type={config.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {name}; supported architectures: {', '.join(supported_architectures())}")


def get_model_class(architecture: str):
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
