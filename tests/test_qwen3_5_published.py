"""A scaled-down Qwen3.8-27B-style checkpoint in the PUBLISHED layout, written by transformers'
own `Qwen3_5ForConditionalGeneration` at a tiny size (tensor names and ranks are the real
model's: `model.language_model.*`, the vision tower `model.visual.*`, an untied `lm_head`, bf16),
plus `mtp.*` tensors as the published files carry, plus a tokenizer: it loads through the
production loader (`dn.load_target`, the families registry), decodes like transformers, pairs
with a DFlash2 draft, and `inspect` shows its schedule, state sizes and ignored tensors.

Scaling of the 27B shape (hidden 5120, 64 layers = 48 GDN + 16 attention, 24 query / 4 KV heads of
256, Hk 16 / Hv 48 of 128, K 4, partial RoPE 0.25, vocab 248320 > tokenizer): hidden 64, 8 layers
(interval 4: G G G A G G G A), 6 query / 1 KV heads of 32, Hk 2 / Hv 6 of 16, K 4, vocab 1024 >
tokenizer 1007.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [test] extra) is not installed: the torch / HF reference checks need it")
pytest.importorskip("transformers", reason="transformers (the [test] extra) is not installed: the HF reference checks need it")
from safetensors.torch import load_file, save_file

import dflash2_numba as dn
from dflash2_numba import tiny
from dflash2_numba.checkpoint import open_checkpoint
from dflash2_numba.inspect_model import format_inspect, inspect_model
from dflash2_numba.families.qwen3_5 import Qwen3_5Model
from dflash2_numba.families.qwen3_5 import expected_qwen3_5_tensors
from dflash2_numba.tiny_hybrid import write_qwen3_5_target

from qwen3_5_fixtures import VISION, _randomise, hf_greedy, load_hf

pytestmark = pytest.mark.usefixtures("one_thread")

H, V = 64, 1024
TEXT = dict(vocab_size=V, hidden_size=H, intermediate_size=208, num_hidden_layers=8, full_attention_interval=4,
            num_attention_heads=6, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            max_position_embeddings=512, tie_word_embeddings=False)
MTP = {"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_embedding.weight": (H,),
       "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.layers.0.input_layernorm.weight": (H,),
       "mtp.layers.0.self_attn.q_proj.weight": (2 * 6 * 32, H), "mtp.layers.0.mlp.down_proj.weight": (H, 208)}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    d = tmp_path_factory.mktemp("qwen3_8_scaled")
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION,
                                                          tie_word_embeddings=False))
    _randomise(model, seed=8)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    tensors = load_file(d / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    tensors |= {name: torch.randn(shape, generator=gen).to(torch.bfloat16)
                for name, shape in MTP.items()}  # the published MTP head, by name
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    tok = tiny.train_tiny_tokenizer(1000)
    tiny.write_tokenizer_files(d, tok, "qwen3", 512)
    hf_names = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    return d, hf_names


def test_inventory_is_the_transformers_state_dict(published, tmp_path):
    """Our expected inventory == transformers' text-stack state dict (names AND shapes); the
    rest is exactly the vision tower and the MTP head, ignored by name. The torch-free writer
    (tiny_hybrid) produces the same inventory."""
    d, hf_names = published
    cfg = dn.load_target(d).config
    expected = expected_qwen3_5_tensors(cfg)
    text = {n: s for n, s in hf_names.items() if not n.startswith("model.visual.")}
    assert dict(expected) == text
    assert {n for n in hf_names if n not in expected} == {n for n in hf_names if n.startswith("model.visual.")}
    on_disk = set(open_checkpoint(d).names())
    assert on_disk - set(expected) == {n for n in on_disk if n.startswith(tuple(expected.ignored_prefixes))}
    mine = write_qwen3_5_target(tmp_path / "w", **{k: v for k, v in TEXT.items() if k not in (
        "rope_parameters", "max_position_embeddings", "tie_word_embeddings")}, partial_rotary_factor=0.25)
    ours = open_checkpoint(mine)
    assert {n: ours.info(n).shape for n in ours.names()} == text


def test_loads_through_the_production_loader_and_decodes_like_transformers(published):
    d, _ = published
    target = dn.load_target(d)
    assert isinstance(target, Qwen3_5Model) and target.config.prefix == "model.language_model."
    assert target.valid_vocab == target.tokenizer.vocab_size < V  # padded vocabulary, masked
    prompt = target.tokenizer.encode_prompt("The quick brown fox jumps over the lazy dog", chat=False)
    assert len(prompt) > 4  # crosses the conv window
    ours = dn.generate(target, None, prompt_ids=prompt, max_new_tokens=24).output_ids
    ref = hf_greedy(load_hf(d, torch.float32), prompt, 24)
    assert ours == ref[:len(ours)] and len(set(ours)) > 4
    draft_dir = tiny.write_draft(d.parent / "draft", d, kind="dflash2", block_size=16, target_layer_ids=[1, 3, 5],
                                 seed=1, init_std=0.2)
    spec = dn.generate(target, dn.load_draft(draft_dir, target), prompt_ids=prompt, max_new_tokens=24, block_size=8)
    assert spec.output_ids == ours


def test_inspect_shows_schedule_state_bytes_and_ignored(published):
    d, hf_names = published
    report = inspect_model(d, hash_files=False)
    assert report["inventory_error"] is None and report["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert report["layer_schedule"] == "GGGAGGGA"
    # 6 GDN layers x (S: Hv dk dv f32 + conv: (2 Hk dk + Hv dv) (K-1) f32), by hand
    S, conv = 6 * 16 * 16 * 4, (2 * 2 * 16 + 6 * 16) * 3 * 4
    assert report["recurrent_state_bytes"] == 6 * (S + conv) == 48384
    assert report["state_sizes"]["kv_per_token"] == 2 * (2 * 1 * 32 * 4)
    ignored = set(report["ignored_tensors"])
    assert ignored == set(MTP) | {n for n in hf_names if n.startswith("model.visual.")}
    text = format_inspect(report)
    assert "GGGAGGGA" in text and "48,384 B" in text and f"ignored:    {len(ignored)} tensors" in text
    assert "mtp.fc.weight" in text and "(ignored)" in text
    print("\n" + "\n".join(text.splitlines()[:9]))
