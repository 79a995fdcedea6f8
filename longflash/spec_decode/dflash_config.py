"""DFlash drafter configuration (the ``DFlashDraftModel`` checkpoint format of z-lab/dflash).

Source: ``shared/specs/dflash.md`` ("Config of released drafters", default target-layer formula).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """``[L // 2]`` for one draft layer, else ``round(1 + i·(L − 4)/(n − 1))`` for i in 0..n−1
    (Qwen3-8B: L = 36, n = 5 → [1, 9, 17, 25, 33])."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]


@dataclass
class DFlashConfig:
    """Parsed drafter config. ``block_size`` is the draft block length B (pending token + B−1
    masks); ``target_layer_ids`` are 0-based target layers whose outputs feed ``fc``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=dict)
    max_position_embeddings: int = 32768
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    vocab_size: int | None = None
    aux_hidden_state_mode: str = "auto"  # auto | layer_output | attn_res_mixture
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict, num_target_layers: int | None = None) -> "DFlashConfig":
        """Raises ValueError naming a missing key or an inconsistent value."""
        arch = cfg.get("architectures") or []
        if arch and "DFlashDraftModel" not in arch:
            raise ValueError(f"not a DFlash drafter config: architectures={arch}")
        dcfg = cfg.get("dflash_config") or {}
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"drafter config is missing {key!r}")
        mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise ValueError("drafter config is missing dflash_config.mask_token_id")
        n = cfg["num_hidden_layers"]
        ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is None:
            L = num_target_layers or cfg.get("num_target_layers")
            if L is None:
                raise ValueError("drafter config gives no target_layer_ids and no num_target_layers")
            ids = default_target_layer_ids(L, n)
        layer_types = cfg.get("layer_types")
        if layer_types is not None and len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        from longflash.layers.rotary import rope_parameters
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"], num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], block_size=int(dcfg.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(mask), target_layer_ids=[int(i) for i in ids],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=rope_parameters(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768), layer_types=layer_types,
            sliding_window=cfg.get("sliding_window"), vocab_size=cfg.get("vocab_size"),
            aux_hidden_state_mode=dcfg.get("aux_hidden_state_mode", "auto"), raw=cfg)

    def window(self, layer_idx: int) -> int | None:
        """Context lookback bound of a layer (tokens), or None for full attention."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None
