"""MXFP4 routed experts: E2M1/E8M0 decoding against hand-written bytes, and a tiny Kimi-K3 checkpoint with
packed experts giving the logits of the same checkpoint with the experts dequantized and stored unpacked."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from longflash import LLM
from longflash.layers.mxfp4 import (MXFP4Experts, dequantize_mxfp4, e8m0_to_float, quantize_mxfp4,
                                    routed_experts_packed, unpack_e2m1)
from longflash.models.loader import ModelLoadError
from longflash.models.weight_report import format_weight_report, weight_memory_report
from longflash.training.config import default_model_config
from longflash.training.model import KimiK3TrainModel

# ---- format --------------------------------------------------------------------------------------------


def test_e2m1_table_and_nibble_order_hand_written_bytes():
    # byte -> (element 2k = low nibble, element 2k+1 = high nibble); covers all 16 codes.
    cases = {0x21: (0.5, 1.0), 0xF7: (6.0, -6.0), 0x8B: (-1.5, -0.0), 0x54: (2.0, 3.0), 0x36: (4.0, 1.5),
             0xC0: (0.0, -2.0), 0xAE: (-4.0, -1.0), 0xD9: (-0.5, -3.0)}
    packed = torch.tensor([list(cases)], dtype=torch.uint8)
    got = unpack_e2m1(packed)
    want = torch.tensor([[v for pair in cases.values() for v in pair]])
    assert got.shape == (1, 16)
    assert torch.equal(got, want)
    assert torch.signbit(got[0, 5]) and not torch.signbit(got[0, 10])  # code 8 is -0.0, code 0 is +0.0


def test_e8m0_decode_byte0_subnormal_and_ff_nan():
    got = e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert got.dtype == torch.float32
    assert got[0].item() == math.ldexp(1.0, -127) and got[0].item() != 0.0  # not flushed to zero
    assert got[1:6].tolist() == [math.ldexp(1.0, -126), 0.5, 1.0, 2.0, math.ldexp(1.0, 127)]
    assert torch.isnan(got[6])


def test_dequantize_applies_one_scale_per_32_columns():
    packed = torch.zeros(1, 32, dtype=torch.uint8)  # 64 columns = 2 groups
    packed[0, 0], packed[0, 16] = 0x21, 0xF7          # columns 0,1 (group 0) and 32,33 (group 1)
    scale = torch.tensor([[128, 125]], dtype=torch.uint8)  # x2, x1/4
    w = dequantize_mxfp4(packed, scale)
    assert w[0, :2].tolist() == [1.0, 2.0] and w[0, 32:34].tolist() == [1.5, -1.5]
    assert w[0, 2:32].abs().sum() == 0 and w[0, 34:].abs().sum() == 0
    with pytest.raises(ValueError, match="does not match"):
        dequantize_mxfp4(packed, scale[:, :1])


def test_quantize_roundtrips_representable_values():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (8, 64))
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])[codes]
    vals[:, 0] = 6.0  # amax 6 per group so the scale is the group's power of two
    vals[:, 32] = -6.0
    w = vals * torch.tensor([2.0 ** -5, 2.0 ** 3]).repeat_interleave(32)
    p, s = quantize_mxfp4(w)
    assert s[0].tolist() == [122, 130]
    assert torch.equal(dequantize_mxfp4(p, s), w)


# ---- tiny Kimi-K3 checkpoint ---------------------------------------------------------------------------

QCFG = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "kv_cache_scheme": None, "global_compression_ratio": None,
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                      "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                  "group_size": 32, "symmetric": True, "dynamic": False,
                                                  "scale_dtype": "torch.uint8"}}}}

# Lt = 64 and Im = 96 (2 and 3 scale groups), all layers MLA (KDA is not supported), layer 0 dense.
SMALL = dict(vocab_size=256, hidden_size=48, num_hidden_layers=4, attn_res_block_size=2, intermediate_size=64,
             moe_intermediate_size=96, routed_expert_hidden_size=64, num_experts=6, num_experts_per_token=2,
             num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8)
EXPERT = re.compile(r"(.*\.block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
PROMPT = [3, 17, 99, 4, 250, 7, 7, 31, 64, 5, 128]


def _ref_model(seed=0):
    torch.manual_seed(seed)
    ref = KimiK3TrainModel(default_model_config(**SMALL)).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
            if ".experts." in n:
                p.normal_(0, 0.3)  # experts matter in the logits
        for m in ref.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.uniform_(0, 0.3)
    return ref


def _checkpoints(ref, packed_layers=None):
    """(packed state dict, dequantized fp32 state dict); experts of layers in ``packed_layers`` (all if None)
    are MXFP4 in the first, and hold the decoded values in the second."""
    sd = ref.export_state_dict(torch.float32)
    packed, plain = {}, {}
    for k, v in sd.items():
        m = EXPERT.match(k)
        layer = int(k.split(".")[2]) if m else None
        if m and (packed_layers is None or layer in packed_layers):
            p, s = quantize_mxfp4(v)
            packed[m.group(1) + ".weight_packed"], packed[m.group(1) + ".weight_scale"] = p, s
            plain[k] = dequantize_mxfp4(p, s)
        else:
            packed[k] = plain[k] = v
    return packed, plain


def _write(path, sd, cfg, nested=False, qcfg_top=False):
    path.mkdir(parents=True, exist_ok=True)
    if nested:
        text = {k: v for k, v in cfg.items() if not (qcfg_top and k == "quantization_config")}
        top = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "text_config": dict(text, architectures=["KimiLinearForCausalLM"], model_type="kimi_linear")}
        if qcfg_top and "quantization_config" in cfg:
            top["quantization_config"] = cfg["quantization_config"]
        cfg = top
        sd = {"language_model." + k: v for k, v in sd.items()}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return str(path)


def _llm(path):
    return LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=32)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    ref = _ref_model()
    packed, plain = _checkpoints(ref)
    cfg = default_model_config(**SMALL)
    packed_dir = _write(root / "packed", packed, dict(cfg, quantization_config=QCFG))
    plain_dir = _write(root / "plain", plain, cfg)
    plain_llm = _llm(plain_dir)
    want = plain_llm.engine.score(PROMPT)
    ref.load_state_dict({k: v for k, v in plain.items()})
    with torch.no_grad():
        spec = ref(torch.tensor([PROMPT]))[0]
    return dict(root=root, cfg=cfg, ref=ref, packed=packed, plain=plain, packed_dir=packed_dir, plain_dir=plain_dir,
                want=want, spec=spec)


def test_packed_checkpoint_logits_equal_dequantized_checkpoint(tiny):
    llm = _llm(tiny["packed_dir"])
    model = llm.engine.model
    mx = [m for m in model.modules() if isinstance(m, MXFP4Experts)]
    assert len(mx) == SMALL["num_hidden_layers"] - 1  # every MoE layer packed
    # weights stay packed: no floating-point routed-expert tensor anywhere in the model
    assert not [n for n, p in model.named_parameters() if ".experts." in n]
    assert all(b.dtype == torch.uint8 for m in mx for b in m.buffers())
    got = llm.engine.score(PROMPT)
    assert _rel(got, tiny["want"]) <= 1e-5
    assert _rel(got, tiny["spec"]) <= 1e-4  # and the spec-written reference with the decoded weights


def test_bf16_packed_equals_dequantized_bitwise(tiny):
    """In bf16 the reference dequantizes to exactly the bf16 weights of the unpacked checkpoint (E2M1 times a
    power of two is exact) and runs the same ops, so the logits are identical."""
    def score(path):
        return LLM(path, skip_tokenizer_init=True, dtype="bfloat16", num_gpu_blocks=32).engine.score(PROMPT)
    assert torch.equal(score(tiny["packed_dir"]), score(tiny["plain_dir"]))


@pytest.mark.parametrize("qcfg_top", [False, True])
def test_nested_checkpoint_quant_config_in_text_config_or_top_level(tiny, qcfg_top):
    cfg = dict(tiny["cfg"], quantization_config=QCFG)
    path = _write(tiny["root"] / f"nested{int(qcfg_top)}", tiny["packed"], cfg, nested=True, qcfg_top=qcfg_top)
    assert _rel(_llm(path).engine.score(PROMPT), tiny["want"]) <= 1e-5


def test_ignored_layer_stays_unpacked(tiny):
    qcfg = dict(QCFG, ignore=QCFG["ignore"] + ["re:.*layers\\.2\\.block_sparse_moe\\.experts.*"])
    assert not routed_experts_packed(qcfg, 2) and routed_experts_packed(qcfg, 3)
    packed, _ = _checkpoints(tiny["ref"], packed_layers={1, 3})
    path = _write(tiny["root"] / "ignore", packed, dict(tiny["cfg"], quantization_config=qcfg))
    llm = _llm(path)
    layers = llm.engine.model.model.layers
    assert isinstance(layers[1].block_sparse_moe.experts, MXFP4Experts)
    assert isinstance(layers[2].block_sparse_moe.experts, torch.nn.ModuleList)
    assert layers[2].block_sparse_moe.experts[0].gate_proj.weight.dtype == torch.float32
    assert _rel(llm.engine.score(PROMPT), tiny["want"]) <= 1e-5


@pytest.mark.parametrize("change, match", [
    (dict(format="nvfp4-pack-quantized", config_groups={}), "unsupported quantization_config format"),
    (dict(quant_method="fp8"), "unsupported quantization_config.quant_method"),
])
def test_other_quantization_formats_rejected(tiny, change, match):
    path = _write(tiny["root"] / "bad", {}, dict(tiny["cfg"], quantization_config=dict(QCFG, **change)))
    with pytest.raises(ValueError, match=match):
        _llm(path)


def test_loader_errors_name_the_packed_tensor(tiny):
    sd = dict(tiny["packed"])
    del sd["model.layers.2.block_sparse_moe.experts.4.w2.weight_scale"]
    cfg = dict(tiny["cfg"], quantization_config=QCFG)
    with pytest.raises(ModelLoadError, match=r"layers\.2\.block_sparse_moe\.experts\.4\.down_proj\.weight_scale"):
        _llm(_write(tiny["root"] / "missing", sd, cfg))
    sd = dict(tiny["packed"])
    sd["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"] = torch.zeros(96, 16, dtype=torch.uint8)
    with pytest.raises(ModelLoadError, match=r"experts\.0\.w1\.weight_packed.*shape \[96, 16\].*expected \[96, 32\]"):
        _llm(_write(tiny["root"] / "shape", sd, cfg))
    sd = dict(tiny["packed"])
    del sd["model.layers.1.block_sparse_moe.experts.0.w3.weight_packed"]
    sd["model.layers.1.block_sparse_moe.experts.0.w3.weight"] = torch.zeros(96, 64)
    with pytest.raises(ModelLoadError, match="expected MXFP4 weight_packed"):
        _llm(_write(tiny["root"] / "unpacked", sd, cfg))


def test_weight_report_counts_packed_bytes(tiny):
    model = _llm(tiny["packed_dir"]).engine.model
    r = weight_memory_report(model)
    E, Lt, Im, moe_layers = SMALL["num_experts"], 64, 96, SMALL["num_hidden_layers"] - 1
    per_expert = 2 * (Im * Lt // 2 + Im * Lt // 32) + (Lt * Im // 2 + Lt * Im // 32)
    assert r["mxfp4_packed_bytes"] == moe_layers * E * per_expert == r["bytes_by_dtype"]["uint8"]
    assert r["mxfp4_weights"] == moe_layers * E * 3 * Lt * Im
    assert 8 * r["mxfp4_packed_bytes"] / r["mxfp4_weights"] == 4.25
    floats = sum(p.numel() * 4 for p in model.parameters())
    assert r["bytes_by_dtype"]["float32"] == floats and r["total_bytes"] == floats + r["mxfp4_packed_bytes"]
    assert "4.25 bits/weight" in format_weight_report(r)


def test_mxfp4_experts_module_rejects_bad_widths():
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP4Experts(2, 48, 64, lambda g, u: g * u)


def test_packed_bytes_kept_in_kernel_order_and_dequantized_in_checkpoint_order():
    """``MXFP4Experts`` stores each 16-byte group 4x4-transposed (byte c + 4j at 4c + j, the order the GPU
    kernel's MMA fragments want); ``dequantize`` still gives the checkpoint's matrix, and the transpose is its
    own inverse."""
    from longflash.layers.mxfp4 import from_kernel_byte_order, to_kernel_byte_order
    ex = MXFP4Experts(1, 64, 64, lambda g, u: g * u)
    torch.manual_seed(0)
    packed = torch.randint(0, 256, (64, 32), dtype=torch.uint8)  # down_proj [D, I/2]: 2 groups of 16 bytes
    scale = torch.randint(118, 130, (64, 2), dtype=torch.uint8)
    ex.load_checkpoint_tensor("0.down_proj.weight_packed", packed)
    ex.load_checkpoint_tensor("0.down_proj.weight_scale", scale)
    stored = ex.w2_weight_packed[0]
    assert stored[5, 4 * 2 + 1].item() == packed[5, 2 + 4 * 1].item()        # group 0: byte c + 4j at 4c + j
    assert stored[5, 16 + 4 * 3 + 2].item() == packed[5, 16 + 3 + 4 * 2].item()  # group 1
    assert torch.equal(from_kernel_byte_order(stored), packed)
    assert torch.equal(to_kernel_byte_order(to_kernel_byte_order(packed)), packed)
    assert torch.equal(ex.dequantize(0, "down_proj", torch.float32), dequantize_mxfp4(packed, scale))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        to_kernel_byte_order(packed[:, :8])
