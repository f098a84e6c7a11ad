"""Greedy decode speed side by side, one run, same weights: this project vs llama.cpp vs transformers.

    python bench/bench_vs_llamacpp.py [--model dense|moe] [--quantize bf16|q8_0|q4_0|q4_k] [--rounds 5] [--tokens 128] [--threads 1,2] [--prompt-len 16]
        [--engines dflash2-numba,llama.cpp,transformers] [--check-tokens 32] [--bw-gib 1]
        [--cache-dir DIR] [--out bench/results/vs_llamacpp.json] [--llama-no-extra-bufts]

The model is the ~120M-parameter random Qwen3 bf16 checkpoint that bench/bench_target.py writes
(its SHAPE / model_dir(): hidden 768, inter 2048, 12 layers, 12 heads, 4 KV heads, head_dim 64,
vocab 32000, untied head). --model moe: the random Qwen3-MoE of MOE_SHAPE below (Qwen3-30B-A3B
at half its width: hidden 1024, 16 q / 4 kv heads of 128, 64 experts top-8 of width 384,
norm_topk_prob true, 12 layers, vocab 32000; ~2 GB of bf16, written once by write_moe_target with
the Hub's per-expert names) against llama.cpp only, its GGUF `qwen3moe` (write_gguf: router F32
`ffn_gate_inp`, experts stacked into `ffn_{gate,up,down}_exps`); weight GB/s then counts the ACTIVE
bytes per token (attention, router, k of E experts, head); default --out vs_llamacpp_moe[_fmt].json.
On this VM llama.cpp needs --llama-no-extra-bufts for q8_0 MoE (SIGILL with its extra buffer types: repacked / AMX weights).
Each engine decodes greedily one token at a time over its KV cache
after the same prompt of fixed token ids (default_rng(0), 16 ids below 1000); only the
single-token steps are timed (argmax included):

  dflash2-numba  TargetModel.load(dir, device="cpu"): bf16 weights, f32 compute (numba kernels)
  llama.cpp      llama-cpp-python on a bf16 GGUF of the SAME weights, written by this script from
                 the safetensors (write_gguf; cached next to the model, rewritten when missing,
                 stale or of another GGUF_LAYOUT): `qwen3` architecture, matrices BF16 as
                 stored, norms F32, vocabulary `tokenizer.ggml.model = "none"` + `qwen3.vocab_size`
                 (llama.cpp then makes vocab_size dummy tokens and evaluates raw ids; there is no
                 text tokenizer). n_ctx 512, n_batch 512, logits_all False, llm.eval([tok]) per
                 step, argmax over llama_get_logits_ith(ctx, -1)
  transformers   AutoModelForCausalLM in torch.bfloat16 (weights as stored, bf16 compute), manual
                 loop feeding back the KV cache (`cache` in transformers 5.2x, else past_key_values)

For each thread count (numba.set_num_threads / llama_set_n_threads(n, n) / torch.set_num_threads)
the engines are warmed up once (a full untimed decode: numba compiles on first use) and then
timed alternately round by round (A, B, C, A, B, C, ...) for --rounds rounds, because the decode
speed of any engine moves 15-20% with where a file's pages land in memory; the table shows each
engine's MEDIAN round and the ratios this-project / llama.cpp and this-project / transformers
(of the medians; the median of the per-round ratios beside it). Also measured in the same run:
memory READ bandwidth at each thread count (bench/bandwidth.py: a numba sum over a --bw-gib GiB
array, four interleaved streams per thread, best of 5 runs before and 5 after the rounds),
against which each engine's weight GB/s (bytes of every layer matrix + the head at 2 bytes/param
per token / seconds per token) is put as a %. (A sum loop is not a hardware peak; the 200 MB of
weights exceed what of the L3 a VM's core gets here, so each token streams them from memory.)

Correctness check, on the warm-up tokens: the first --check-tokens greedy tokens of llama.cpp
and transformers against ours (positions that agree, identical prefix). bf16 GGUF kernels and
our f32 accumulation may part late on random weights: reported, not asserted; but if the first
4 tokens of llama.cpp differ, the GGUF conversion is wrong: the script says so loudly and exits 1
(after writing the JSON). transformers computes in bf16 (activations rounded at every op), which
on this random model parts from any f32 engine after a few tokens; its same-model check is an
extra untimed run of the checkpoint loaded in float32 (the first 4 tokens must agree, same exit).

--quantize q8_0 / q4_0: this project loads the same safetensors with load-time quantization
(quant/: llama.cpp's block math, every matrix and the head in that format), and llama.cpp runs a
GGUF made by ITS OWN quantizer (llama_model_quantize) from the bf16 GGUF above, with the output
tensor in the same format (output_tensor_type; llama.cpp would otherwise pick Q6_K for a q4_0
head) and the token embedding kept bf16 (token_embedding_type; it is only gathered, and this
project keeps it as stored), so both compute the same model and read the same bytes per token. transformers is skipped (no q8_0 / q4_0 there).
--quantize q4_k: llama.cpp's file type Q4_K_M with `pure` set (llama.cpp's Q4_K_M / Q4_K_S would put
Q6_K / Q5_K in some layers) and the output tensor Q4_K: every matrix Q4_K on both sides. Before timing,
each Q4_K tensor of llama.cpp's GGUF (gguf.GGUFReader) is compared with this project's quantizer on the
same safetensors tensor (check_q4_k_bytes: they must be equal byte for byte, else the run stops); the
JSON records the check under engines.llama.cpp.q4_k_gguf_vs_ours.
The default --out then gets the format's suffix (vs_llamacpp_q8_0.json), and the JSON records
the instruction-set path the integer kernels compiled for (kernels/isa.py; DFLASH2_ISA=avx2
forces a lower one).

Writes bench/results/vs_llamacpp.json: machine (CPU model, avx2/avx512f/avx512_bf16/amx flags),
versions, llama.cpp's system info, load average before/after (and per round), bandwidth, every
round's numbers, medians, ratios, agreement and the reference tokens.

Engines that are not installed are skipped with a line saying so (the rest still run). Install:

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e ".[bench]"   # llama-cpp-python + gguf
    pip install -e ".[test]"                                   # torch (CPU) + transformers

(llama-cpp-python builds from source: ~12 minutes, needs cmake and g++.)

On llama.cpp: its AMX / repacked-weight ("extra buffer type") kernels crashed on some AVX-512 VMs;
--llama-no-extra-bufts loads with the model param use_extra_bufts = false. It also takes away
llama.cpp's repacked q4_0 / q8_0 kernels, its default wherever they run (AMD EPYC Zen 4, AVX2
build: q4_0 decode 164 -> 239 tok/s with them, docs/amd_epyc_zen4.md session 21): use it only where
the default crashes, and say so beside the ratio. On a machine whose
cores are shared with other work, multi-threaded results of every engine collapse (spin-waiting
threads): the load average is recorded for that reason, and --pause sleeps between engine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("dflash2-numba", "llama.cpp", "transformers")
GGUF_LAYOUT = 1  # bump when write_gguf writes something different: cached GGUFs are rewritten
MUST_AGREE = 4  # the first tokens that must agree with ours, else the GGUF (or the model) is wrong
# llama.cpp's file type and ggml tensor type per format (llama.h LLAMA_FTYPE_MOSTLY_*, ggml.h GGML_TYPE_*)
QUANT_TYPES = {"q8_0": (7, 8), "q4_0": (2, 2), "q4_k": (15, 12)}  # q4_k: Q4_K_M's ftype, made pure (below)
QUANT_TYPES_NAMES = tuple(QUANT_TYPES)
GGML_TYPE_BF16 = 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", choices=("dense", "moe"), default="dense",
                    help="dense: bench_target.py's random Qwen3; moe: the random Qwen3-MoE of MOE_SHAPE "
                         "(Qwen3-30B-A3B's proportions, see the docstring)")
    ap.add_argument("--quantize", choices=("bf16",) + QUANT_TYPES_NAMES, default="bf16",
                    help="weight format of both engines (see the docstring)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per timed decode")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--bw-gib", type=float, default=1.0, help="size of the bandwidth array (GiB)")
    ap.add_argument("--pause", type=float, default=0.2,
                    help="seconds of sleep between engine runs (lets spinning worker threads park)")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp: use_extra_bufts = false (no AMX / repacked weight buffers)")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2_numba")
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/vs_llamacpp.json (vs_llamacpp_<format>.json when quantized)")
    args = ap.parse_args(argv)
    if args.out is None:
        stem = "vs_llamacpp" + ("_moe" if args.model == "moe" else "")
        args.out = HERE / "results" / (f"{stem}.json" if args.quantize == "bf16" else f"{stem}_{args.quantize}.json")
    args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.quantize != "bf16" or args.model == "moe":  # transformers: no q8_0 / q4_0; the MoE model is timed
        args.engines = [e for e in args.engines if e != "transformers"]  # against llama.cpp only
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown or not args.threads or min(args.threads) < 1 or args.rounds < 1 or args.tokens < 1:
        ap.error(f"bad --engines {unknown} (known: {', '.join(ENGINES)}) / --threads / --rounds / --tokens")
    if "dflash2-numba" not in args.engines:
        ap.error("dflash2-numba is the reference engine: keep it in --engines")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # numba's pool size is fixed at import: make room for the largest count
    if int(os.environ.get("NUMBA_NUM_THREADS", "0") or 0) < max(ARGS.threads):
        os.environ["NUMBA_NUM_THREADS"] = str(max(max(ARGS.threads), os.cpu_count() or 1))

import numpy as np  # noqa: E402

sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import dflash2_numba  # noqa: E402,F401  first: a DFLASH2_ISA override must reach numba before any codegen
from bandwidth import read_bandwidth  # noqa: E402  (bench/bandwidth.py: four-stream sum)
from bench_target import SHAPE, decode, model_dir  # noqa: E402
from dflash2_numba.checkpoint import open_checkpoint  # noqa: E402
from dflash2_numba.families.qwen3 import load_target_config  # noqa: E402
from dflash2_numba.numerics import bf16_to_f32_array, f32_to_bf16_array  # noqa: E402


# ---------------------------------------------------------------- the MoE benchmark model
# Qwen3-30B-A3B (hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top-8 of width 768,
# norm_topk_prob true, vocab 151936) at half its width: hidden 1024, 16 q / 4 kv heads of 128 (q rows
# = 2 x hidden and 512 kv rows as there), 64 experts top-8 of width 384, vocab 32000, 12 layers.
# Per layer 5.2M attention + 75.5M expert parameters (9.4M of them active per token): 12 layers hold
# 1.03 B parameters = 1.1 GB at q8_0, twice this VM's reported L3 (480 MiB) and far above what one
# core of it gets, so the experts a token picks stream from memory as a 30B-A3B's do; 12 (not 8)
# layers keep the head (32.8M parameters, read by every token) at ~16% of the active bytes.
MOE_SHAPE = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384,
                 intermediate_size=3072, norm_topk_prob=True, vocab_size=32000, tie_word_embeddings=False)
MOE_NAME = "bench_vs_llamacpp_qwen3moe_h1024_e64k8_l12_bf16"


def write_moe_target(path, *, seed: int = 0, init_std: float = 0.05, router_std: float | None = None,
                     num_shards: int = 4, **shape) -> Path:
    """A random Qwen3MoeForCausalLM in bf16 as a Hugging Face directory: the Hub's per-expert names
    (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, router `mlp.gate.weight`), the
    config keys of Qwen3-30B-A3B's config.json, the tiny tokenizer (ids < ~1000 are text; the rest
    of the vocabulary is padding). Every matrix N(0, init_std); routers N(0, router_std) (default
    4 / sqrt(H): logits of std ~4 on a normed row, so routing varies token to token and ties are
    rare); norms 1 + N(0, 0.1)."""
    from dflash2_numba import tiny

    c = dict(MOE_SHAPE, **shape)
    H, L, nh, nkv, hd = (c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "head_dim"))
    E, I, V = c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]
    router_std = 4.0 / np.sqrt(H) if router_std is None else router_std
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)

    def mat(name, shape, std=init_std):  # bf16 bits of N(0, std)
        rng = tiny._rng(seed, name)
        return f32_to_bf16_array(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm(name, n):
        return f32_to_bf16_array(tiny._norm_weight(seed, name, n))

    w = {"model.embed_tokens.weight": mat("model.embed_tokens.weight", (V, H))}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(p + "input_layernorm.weight", H)
        for proj, shp in (("q_proj", (nh * hd, H)), ("k_proj", (nkv * hd, H)), ("v_proj", (nkv * hd, H)),
                          ("o_proj", (H, nh * hd))):
            w[p + f"self_attn.{proj}.weight"] = mat(p + f"self_attn.{proj}.weight", shp)
        for nm in ("q_norm", "k_norm"):
            w[p + f"self_attn.{nm}.weight"] = norm(p + f"self_attn.{nm}.weight", hd)
        w[p + "post_attention_layernorm.weight"] = norm(p + "post_attention_layernorm.weight", H)
        w[p + "mlp.gate.weight"] = mat(p + "mlp.gate.weight", (E, H), router_std)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            for proj, shp in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                w[q + f"{proj}.weight"] = mat(q + f"{proj}.weight", shp)
    w["model.norm.weight"] = norm("model.norm.weight", H)
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = mat("lm_head.weight", (V, H))
    tiny._write_weights(d, w, num_shards)
    del w
    tok = tiny.train_tiny_tokenizer(1000)
    config = {  # Qwen3-30B-A3B's config.json keys
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "decoder_sparse_step": 1,
        "head_dim": hd, "hidden_act": "silu", "hidden_size": H, "initializer_range": init_std,
        "intermediate_size": c["intermediate_size"], "max_position_embeddings": 4096, "max_window_layers": L,
        "mlp_only_layers": [], "moe_intermediate_size": I, "norm_topk_prob": c["norm_topk_prob"],
        "num_attention_heads": nh, "num_experts": E, "num_experts_per_tok": c["num_experts_per_tok"],
        "num_hidden_layers": L, "num_key_value_heads": nkv, "output_router_logits": False,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1e6, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": c["tie_word_embeddings"], "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": V,
    }
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tiny.write_tokenizer_files(d, tok, "qwen3", 4096, chat_template=False)
    return d


def moe_model_dir(cache_dir: Path) -> Path:
    d = cache_dir / MOE_NAME
    done = d / ".complete"
    if not done.exists():
        print(f"writing the MoE benchmark model to {d} (once, ~2 GB) ...", file=sys.stderr, flush=True)
        write_moe_target(d, seed=0)
        done.write_text("ok\n")
    return d


def read_target_config(src_dir: Path):
    """The resolved config of a Qwen3 or Qwen3-MoE directory (the family's own resolver)."""
    from dflash2_numba.config import read_config_json
    from dflash2_numba.families.qwen3_moe import is_qwen3_moe, resolve_qwen3_moe_config

    path, raw = read_config_json(src_dir)
    return resolve_qwen3_moe_config(raw, str(path)) if is_qwen3_moe(raw) else load_target_config(src_dir)


# ---------------------------------------------------------------- GGUF (llama.cpp's qwen3 / qwen3moe layout)
def gguf_tensor_names(num_layers: int, tied: bool, moe_layers=()) -> dict[str, str]:
    """HF tensor name -> llama.cpp GGUF tensor name (gguf-py's TENSOR_NAMES for MODEL_ARCH.QWEN3 /
    QWEN3MOE). Qwen3 uses NeoX RoPE in llama.cpp (as in HF), so q / k need no permutation. In a
    MoE layer the router `mlp.gate.weight` is `ffn_gate_inp`; the experts have no one-to-one
    name (write_gguf stacks them into `ffn_{gate,up,down}_exps`)."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    per_layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    }
    dense = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(num_layers):
        for hf, gg in (per_layer | ({"mlp.gate": "ffn_gate_inp"} if i in moe_layers else dense)).items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    return names


EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_gguf(src_dir: str | Path, out_path: str | Path) -> Path:
    """Write a Qwen3 or Qwen3-MoE safetensors checkpoint (HF directory) as a GGUF llama.cpp loads:
    `qwen3` / `qwen3moe` metadata, BF16 / F16 / F32 matrices kept in their stored type (bytes
    copied), 1-D norm weights as F32 (bf16 -> f32 is exact), and a vocabulary of `vocab_size`
    dummy tokens (tokenizer.ggml.model = "none"): enough to evaluate raw token ids. Written to a
    temporary name and renamed, so a half-written file is never taken for a GGUF.

    Qwen3-MoE as llama.cpp's convert_hf_to_gguf.py (Qwen3MoeModel <- Qwen2MoeModel) writes it:
    the router `mlp.gate.weight` [E, H] -> `blk.N.ffn_gate_inp.weight` in F32 (the converter keeps
    it F32 and llama_model_quantize never quantizes it); each projection's experts stacked into
    one 3-D tensor `blk.N.ffn_{gate,up,down}_exps.weight` of numpy shape [E, I, H] / [E, H, I]
    (ggml ne {H, I, E} / {I, H, E}), bytes as stored; keys qwen3moe.expert_count,
    expert_used_count, expert_feed_forward_length. llama.cpp's qwen3moe graph softmaxes the router
    over all E, takes the top k and renormalises them (build_moe_ffn norm_w = true), so only
    norm_topk_prob = true checkpoints without dense layers are written."""
    import gguf

    src_dir, out_path = Path(src_dir), Path(out_path)
    cfg = read_target_config(src_dir)
    moe = cfg.architecture == "Qwen3MoeForCausalLM"
    if cfg.architecture not in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        raise ValueError(f"{src_dir}: write_gguf writes Qwen3ForCausalLM / Qwen3MoeForCausalLM only, not "
                         f"{cfg.architecture} (a Llama target needs llama.cpp's Q/K permutation)")
    if any(w is not None for w in cfg.layer_window):
        raise ValueError(f"{src_dir}: sliding-window layers are not written to GGUF here")
    moe_layers = cfg.moe_layers if moe else []
    if moe and (not cfg.norm_topk_prob or len(moe_layers) != cfg.num_hidden_layers):
        raise ValueError(f"{src_dir}: llama.cpp's qwen3moe renormalises the top-k weights and has no dense "
                         "layers: norm_topk_prob must be true and mlp_only_layers empty")
    ck = open_checkpoint(src_dir)
    names = gguf_tensor_names(cfg.num_hidden_layers, cfg.tie_word_embeddings, moe_layers)
    experts = {n for n in ck.names() if ".mlp.experts." in n} if moe else set()
    unmapped = sorted(set(ck.names()) - set(names) - experts)
    if unmapped:
        raise ValueError(f"{src_dir}: tensors with no GGUF name: {unmapped[:5]}")
    if moe and (len(experts) != 3 * cfg.num_experts * len(moe_layers)):
        raise ValueError(f"{src_dir}: expected the per-expert layout (3 x {cfg.num_experts} tensors per layer), "
                         f"found {len(experts)} expert tensors")

    arch = "qwen3moe" if moe else "qwen3"
    tmp = out_path.with_name(out_path.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch=arch)
    w.add_name(src_dir.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("none")  # llama-vocab.cpp: LLAMA_VOCAB_TYPE_NONE, vocab_size dummy tokens
    raw_types = {"BF16": gguf.GGMLQuantizationType.BF16}
    for hf_name in ck.names():
        if hf_name in experts:
            continue
        arr, dtype = ck.get(hf_name), ck.info(hf_name).dtype
        if arr.ndim == 1 or hf_name.endswith(".mlp.gate.weight"):  # norms and routers: F32 (exact from bf16)
            w.add_tensor(names[hf_name], bf16_to_f32_array(arr) if dtype == "BF16" else arr.astype(np.float32))
        elif dtype in raw_types:
            w.add_tensor(names[hf_name], arr, raw_dtype=raw_types[dtype])
        elif dtype in ("F32", "F16"):
            w.add_tensor(names[hf_name], arr)
        else:
            raise ValueError(f"{src_dir}: {hf_name} has dtype {dtype}; expected BF16, F16 or F32")
    for i in moe_layers:  # the experts, stacked per projection: [E, rows, cols]
        for proj, gg in EXPERT_GGUF.items():
            parts = [ck.get(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight") for e in range(cfg.num_experts)]
            dtypes = {ck.info(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight").dtype for e in range(cfg.num_experts)}
            if dtypes != {"BF16"}:
                raise ValueError(f"{src_dir}: layer {i} {proj} experts have dtypes {sorted(dtypes)}; expected BF16")
            w.add_tensor(f"blk.{i}.{gg}.weight", np.stack(parts), raw_dtype=raw_types["BF16"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)
    return out_path


def cached_gguf(src_dir: Path) -> Path:
    """The benchmark model's GGUF next to it, (re)written when missing, older than the
    safetensors, or written by another GGUF_LAYOUT."""
    out = src_dir / "model-bf16.gguf"
    stamp = src_dir / "model-bf16.gguf.layout"
    newest = max(p.stat().st_mtime for p in src_dir.glob("*.safetensors"))
    if not (out.exists() and stamp.exists() and stamp.read_text().strip() == str(GGUF_LAYOUT)
            and out.stat().st_mtime >= newest):
        print(f"writing the GGUF {out} ...", file=sys.stderr, flush=True)
        stamp.unlink(missing_ok=True)
        write_gguf(src_dir, out)
        stamp.write_text(f"{GGUF_LAYOUT}\n")
    return out


def quantized_gguf(src_dir: Path, fmt: str) -> Path:
    """llama.cpp's own quantization of the bf16 GGUF (cached beside it, redone when older)."""
    import llama_cpp

    src = cached_gguf(src_dir)
    out = src_dir / f"model-{fmt}-embed-bf16.gguf"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    print(f"quantizing {src.name} -> {out.name} with llama_model_quantize ...", file=sys.stderr, flush=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.output_tensor_type = QUANT_TYPES[fmt]
    params.token_embedding_type = GGML_TYPE_BF16  # the embedding stays as stored, as ours does
    params.pure = fmt == "q4_k"  # every matrix Q4_K: no Q6_K / Q5_K mix of Q4_K_M / Q4_K_S
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {fmt}) returned {rc}")
    tmp.replace(out)
    return out


def check_q4_k_bytes(src_dir: Path, gguf_path: Path) -> dict:
    """Every matrix of llama.cpp's q4_k GGUF is Q4_K and holds the bytes this project's quantizer
    (quant/q4_k.py) makes of the same safetensors tensor: the same weights on both sides."""
    import gguf

    from dflash2_numba.quant.q4_k import quantize_q4_k

    cfg = read_target_config(src_dir)
    names = gguf_tensor_names(cfg.num_hidden_layers, cfg.tie_word_embeddings)
    ck = open_checkpoint(src_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    checked, differ = 0, []
    for hf_name, gg_name in names.items():
        if ck.info(hf_name).shape.__len__() != 2 or gg_name == "token_embd.weight":
            continue
        t = by_name[gg_name]
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_K:
            differ.append(f"{gg_name}: {t.tensor_type.name}")
            continue
        ours = quantize_q4_k(ck.get(hf_name), hf_name)
        if not np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), ours.reshape(-1)):
            differ.append(f"{gg_name}: bytes differ")
        checked += 1
    return {"matrices_checked": checked, "all_q4_k_and_bytes_equal": not differ, "differ": differ[:5]}


def weight_bytes_per_token(src_dir: Path, fmt: str = "bf16") -> int:
    """Bytes of weights every decoded token reads, at 2 bytes/param (q8_0: 34/32, q4_0: 18/32,
    llama.cpp's block sizes): every layer matrix and the head (a tied head is the embedding; an
    untied model's embedding contributes one row). A MoE layer counts its router (kept bf16 by
    this project, F32 by llama.cpp: counted at 2 bytes) and k of its E experts: the ACTIVE bytes."""
    from dflash2_numba.quant.formats import BYTES_PER_WEIGHT

    cfg = read_target_config(src_dir)
    ck = open_checkpoint(src_dir)
    moe = cfg.architecture == "Qwen3MoeForCausalLM"
    n = n_router = n_experts = 0
    for k in ck.names():
        shape = ck.info(k).shape
        if len(shape) != 2 or k == "model.embed_tokens.weight":
            continue
        size = int(np.prod(shape))
        if moe and k.endswith(".mlp.gate.weight"):
            n_router += size
        elif moe and ".mlp.experts." in k:
            n_experts += size
        else:
            n += size
    if cfg.tie_word_embeddings:
        n += int(np.prod(ck.info("model.embed_tokens.weight").shape))
    if moe:
        n += n_experts * cfg.num_experts_per_tok // cfg.num_experts
    return int(BYTES_PER_WEIGHT[fmt] * n + 2 * n_router)


# ---------------------------------------------------------------- engines
class NumbaEngine:
    name = "dflash2-numba"

    def __init__(self, src_dir: Path, args):
        import numba

        from dflash2_numba.families.qwen3 import TargetModel
        from dflash2_numba.families.qwen3_moe import Qwen3MoeModel

        self.numba = numba
        cls = Qwen3MoeModel if getattr(args, "model", "dense") == "moe" else TargetModel
        self.target = cls.load(src_dir, device="cpu", quantize=None if args.quantize == "bf16" else args.quantize)

    def set_threads(self, n: int) -> None:
        self.numba.set_num_threads(n)

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        return decode(self.target, np.asarray(prompt, dtype=np.int64), n)

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """The logits [V] after the prompt (what the first greedy token is picked from)."""
        logits, _ = self.target.forward(np.asarray(prompt, np.int64), self.target.new_cache(len(prompt) + 8),
                                        last_only=True)
        return np.asarray(logits[-1], np.float64)


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, src_dir: Path, args):
        import llama_cpp
        import llama_cpp.llama as llama_mod

        self.llama_cpp = llama_cpp
        t0 = time.perf_counter()
        path = cached_gguf(src_dir) if args.quantize == "bf16" else quantized_gguf(src_dir, args.quantize)
        self.gguf_s = time.perf_counter() - t0  # 0 unless written now
        self.same_bytes = check_q4_k_bytes(src_dir, path) if args.quantize == "q4_k" else None
        if self.same_bytes is not None and not self.same_bytes["all_q4_k_and_bytes_equal"]:
            raise RuntimeError(f"llama.cpp's q4_k GGUF is not this project's Q4_K: {self.same_bytes}")
        n0 = args.threads[0]
        n_ctx = max(512, args.prompt_len + max(args.tokens, args.check_tokens) + 16)
        kw = dict(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=n0, n_threads_batch=n0,
                  logits_all=False, verbose=False)
        low = llama_mod.llama_cpp  # the ctypes module Llama reads llama_model_default_params from
        orig = low.llama_model_default_params
        if args.llama_no_extra_bufts:
            print("llama.cpp: --llama-no-extra-bufts, so without its repacked weight kernels (not its default)",
                  file=sys.stderr)
            if "use_extra_bufts" not in dict(low.llama_model_params._fields_):
                raise RuntimeError("this llama-cpp-python has no use_extra_bufts model param")

            def no_extra():
                p = orig()
                p.use_extra_bufts = False
                return p
            low.llama_model_default_params = no_extra
        try:
            self.llm = llama_cpp.Llama(**kw)
        finally:
            low.llama_model_default_params = orig
        self.use_extra_bufts = bool(self.llm.model_params.use_extra_bufts)
        if args.llama_no_extra_bufts and self.use_extra_bufts:
            raise RuntimeError("use_extra_bufts = false did not reach llama.cpp's model params")
        self.n_vocab = self.llm.n_vocab()
        self.system_info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()

    def set_threads(self, n: int) -> None:
        self.llama_cpp.llama_set_n_threads(self.llm._ctx.ctx, n, n)
        got = self.llama_cpp.llama_n_threads(self.llm._ctx.ctx)
        if got != n:
            raise RuntimeError(f"llama_set_n_threads({n}) left llama.cpp at {got} threads")

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(prompt))
        return self._last_logits().astype(np.float64)

    def _last_logits(self) -> np.ndarray:
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        llm = self.llm
        llm.reset()  # n_tokens = 0: the next eval drops the whole KV cache
        llm.eval(list(prompt))
        tokens = []
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(self._last_logits()))
            tokens.append(tok)
            llm.eval([tok])
        return tokens, time.perf_counter() - t0


class TransformersEngine:
    name = "transformers"

    def __init__(self, src_dir: Path, args):
        import inspect

        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        self.torch, self.src_dir = torch, src_dir
        major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
        self.dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"  # renamed in 4.56
        self.model = AutoModelForCausalLM.from_pretrained(src_dir, **{self.dtype_kw: torch.bfloat16}).eval()
        # transformers 5.2x names the KV cache argument / output `cache` (`past_key_values` before)
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def set_threads(self, n: int) -> None:
        self.torch.set_num_threads(n)

    def reference_f32(self, prompt: list[int], n: int) -> list[int]:
        """Greedy tokens of the same checkpoint loaded in float32 (untimed): the same-model check.
        (bf16 compute rounds activations at every op: on random weights its greedy tokens part
        from any f32-accumulating engine after a few steps.)"""
        timed = self.model
        self.model = type(timed).from_pretrained(self.src_dir, **{self.dtype_kw: self.torch.float32}).eval()
        try:
            return self.decode(prompt, n)[0]
        finally:
            self.model = timed

    def decode(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        torch, kw = self.torch, self.cache_kw
        tokens = []
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([list(prompt)]), use_cache=True, logits_to_keep=1)
            cache, logits = getattr(out, kw), out.logits[0, -1]
            t0 = time.perf_counter()
            for _ in range(n):
                tok = int(torch.argmax(logits))
                tokens.append(tok)
                out = self.model(input_ids=torch.tensor([[tok]]), use_cache=True, **{kw: cache})
                cache, logits = getattr(out, kw), out.logits[0, -1]
            return tokens, time.perf_counter() - t0


ENGINE_CLASSES = {"dflash2-numba": NumbaEngine, "llama.cpp": LlamaCppEngine, "transformers": TransformersEngine}
REQUIRES = {"dflash2-numba": ("numba",), "llama.cpp": ("llama_cpp", "gguf"), "transformers": ("torch", "transformers")}


# ---------------------------------------------------------------- machine facts
def machine_facts() -> dict:
    facts = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), None)
        flags_line = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        facts["cpu_model"] = model
        facts["flags"] = {f: f in flags_line
                          for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")}
    except OSError:
        facts["cpu_model"] = platform.processor() or None
    try:
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        facts["mem_total_gib"] = round(int(mem.split()[1]) / (1 << 20), 1)
    except (OSError, StopIteration):
        pass
    return facts


def isa_facts() -> dict:
    from dflash2_numba.kernels import isa

    return isa.describe()


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("numba", "numpy", "llama-cpp-python", "gguf", "torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def agreement(ref: list[int], other: list[int], n: int) -> dict:
    a, b = ref[:n], other[:n]
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"compared": min(len(a), len(b)), "prefix_agree": prefix,
            "positions_agree": sum(x == y for x, y in zip(a, b)),
            "first_divergence": None if prefix == min(len(a), len(b)) else prefix,
            "ok": prefix >= min(MUST_AGREE, n)}


def engine_facts(e) -> dict:
    facts = {"load_s": e.load_s}
    if e.name == "llama.cpp":
        facts.update(gguf_check_or_write_s=e.gguf_s, use_extra_bufts=e.use_extra_bufts)
        if e.same_bytes is not None:
            facts["q4_k_gguf_vs_ours"] = e.same_bytes
    return facts


def loud(lines: list[str]) -> None:
    bar = "!" * 78
    print("\n".join([bar, *(f"!! {ln}" for ln in lines), bar]), file=sys.stderr, flush=True)


# ---------------------------------------------------------------- main
def main(args) -> int:
    import importlib.util

    import numba

    load_before = os.getloadavg()
    src = moe_model_dir(args.cache_dir) if args.model == "moe" else model_dir(args.cache_dir)
    shape = MOE_SHAPE if args.model == "moe" else SHAPE
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 1000, args.prompt_len)]
    n_warm = max(args.tokens, args.check_tokens)
    skipped, warnings = {}, []

    engines = []
    for name in args.engines:
        missing = [m for m in REQUIRES[name] if importlib.util.find_spec(m) is None]
        if missing:
            skipped[name] = f"not installed: {', '.join(missing)}"
            print(f"SKIPPING {name}: {', '.join(missing)} not installed "
                  f"(pip install -e '.[bench]' for llama.cpp, '.[test]' for transformers)", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        try:
            eng = ENGINE_CLASSES[name](src, args)
        except Exception as exc:  # an engine that cannot load is reported, the others still run
            if name == "dflash2-numba":
                raise
            skipped[name] = f"failed to load: {type(exc).__name__}: {exc}"
            loud([f"{name} failed to load: {type(exc).__name__}: {exc}"])
            continue
        eng.load_s = time.perf_counter() - t0
        engines.append(eng)
    names = [e.name for e in engines]

    wbytes = weight_bytes_per_token(src, args.quantize)
    print(f"measuring memory read bandwidth ({args.bw_gib:g} GiB array, threads {args.threads}) ...", file=sys.stderr)
    bw_before = read_bandwidth(args.threads, args.bw_gib)

    results, agree, reference, hf_f32, first_logits = {}, {}, {}, None, {}
    for t in args.threads:
        for e in engines:
            e.set_threads(t)
        # warm-up: one full untimed decode per engine (compilation, first-touch of pages); its
        # tokens are the agreement check
        warm = {}
        for e in engines:
            warm[e.name], _ = e.decode(prompt, n_warm)
            time.sleep(args.pause)
        ref = warm["dflash2-numba"]
        if not first_logits:  # how close the two engines' numbers are, beyond the argmax
            ours = engines[0].prompt_logits(prompt)
            for e in engines[1:]:
                if hasattr(e, "prompt_logits"):
                    first_logits[e.name] = logits_facts(ours, e.prompt_logits(prompt)[:ours.shape[0]])
        reference[str(t)] = ref[:args.check_tokens]
        agree[str(t)] = {n: agreement(ref, warm[n], args.check_tokens) for n in names if n != "dflash2-numba"}
        if "transformers" in warm:  # torch computes in bf16: the same-model check runs it in f32
            if hf_f32 is None:
                hf_f32 = next(e for e in engines if e.name == "transformers").reference_f32(prompt, args.check_tokens)
            vs = agreement(ref, hf_f32, args.check_tokens)
            agree[str(t)]["transformers"]["f32_vs_dflash2_numba"] = vs
            agree[str(t)]["transformers"]["ok"] = vs["ok"]  # bf16 compute may part early: reported only
        if str(args.threads[0]) != str(t) and ref[:args.check_tokens] != reference[str(args.threads[0])]:
            warnings.append(f"dflash2-numba's greedy tokens at {t} threads differ from those at {args.threads[0]}")
        rounds = []
        for r in range(args.rounds):
            for e in engines:
                tokens, secs = e.decode(prompt, args.tokens)
                rounds.append({"round": r, "engine": e.name, "seconds": secs, "tokens_per_s": args.tokens / secs,
                               "same_tokens_as_warmup": tokens == warm[e.name][:args.tokens],
                               "loadavg_1min": os.getloadavg()[0]})
                print(f"  threads {t} round {r} {e.name:14s} {args.tokens / secs:8.2f} tokens/s", file=sys.stderr,
                      flush=True)
                time.sleep(args.pause)
        results[str(t)] = {"rounds": rounds}
    load_after = os.getloadavg()
    print("measuring memory read bandwidth again ...", file=sys.stderr)
    bw_after = read_bandwidth(args.threads, args.bw_gib)
    bandwidth = {t: {"best_gbs": max(bw_before[t]["best_gbs"], bw_after[t]["best_gbs"]),
                     "before_gbs": bw_before[t]["runs_gbs"], "after_gbs": bw_after[t]["runs_gbs"]} for t in bw_before}

    for t, res in results.items():  # medians against the best read bandwidth of either pass
        rounds, bw = res["rounds"], bandwidth[t]["best_gbs"]
        med = {}
        for n in names:
            tps = statistics.median(x["tokens_per_s"] for x in rounds if x["engine"] == n)
            gbs = wbytes * tps / 1e9
            med[n] = {"tokens_per_s": tps, "ms_per_token": 1e3 / tps, "weight_gbs": gbs, "pct_read_bw": 100 * gbs / bw}
        ratios, paired = {}, {}
        for n in names:
            if n == "dflash2-numba":
                continue
            ratios[f"dflash2-numba/{n}"] = med["dflash2-numba"]["tokens_per_s"] / med[n]["tokens_per_s"]
            per_round = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(
                [x for x in rounds if x["engine"] == "dflash2-numba"], [x for x in rounds if x["engine"] == n])]
            paired[f"dflash2-numba/{n}"] = statistics.median(per_round)
        res.update(median=med, ratio_of_medians=ratios, median_of_paired_ratios=paired, read_bandwidth_gbs=bw)

    # ---- report
    failed = []
    same_weights = any(getattr(e, "same_bytes", None) for e in engines)  # q4_k: set only when equal
    for t, per in agree.items():
        for n, a in per.items():
            if not a["ok"]:
                if n == "llama.cpp" and same_weights:  # bytes proven equal: a parting, not a wrong file
                    warnings.append(f"llama.cpp at {t} threads parts from dflash2-numba after {a['prefix_agree']} "
                                    "greedy tokens; its Q4_K tensors are byte-identical to ours (checked before "
                                    "timing), so the difference is the computation (activation rounding, f16 KV "
                                    "cache, summation order) on this random model's flat logits")
                elif n == "llama.cpp" and a["prefix_agree"] == 0 and near_tie(first_logits.get(n)):
                    z = first_logits[n]
                    warnings.append(f"llama.cpp at {t} threads: its first greedy token differs from dflash2-numba's, "
                                    f"a near tie: our top-2 gap {z['our_top2_gap']:.4f} is within twice the engines' "
                                    f"99th-percentile logit difference ({z['abs_diff_p99']:.4f}); "
                                    f"logits correlation {z['correlation']:.5f}, so the same model (a wrong GGUF "
                                    "would not correlate); every later token follows the other branch")
                elif n == "llama.cpp":
                    failed.append(f"llama.cpp at {t} threads: its first greedy tokens differ from dflash2-numba's "
                                  f"(agree for {a['prefix_agree']} of the first {MUST_AGREE}) -> the GGUF conversion "
                                  "is WRONG")
                else:
                    b = a["f32_vs_dflash2_numba"]
                    failed.append(f"{n} in float32: its first greedy tokens differ from dflash2-numba's (agree for "
                                  f"{b['prefix_agree']} of the first {MUST_AGREE}) -> the engines do not compute the "
                                  "same model")
    print()
    print(f"isa path: {isa_facts()}")
    print(f"model: random {'Qwen3-MoE' if args.model == 'moe' else 'Qwen3'} {shape}, {args.quantize} weights "
          f"({wbytes / 1e6:.1f} MB {'of ACTIVE weights ' if args.model == 'moe' else ''}read per token); prompt "
          f"{args.prompt_len} ids, {args.tokens} timed single-token steps, median of {args.rounds} alternating rounds")
    print(f"cpu: {machine_facts().get('cpu_model')}; load average {load_before[0]:.2f} -> {load_after[0]:.2f}; "
          f"numba threading layer {numba.threading_layer()}")
    for n, why in skipped.items():
        print(f"skipped {n}: {why}")
    for t in args.threads:
        res = results[str(t)]
        print(f"\nthreads {t}: measured read bandwidth {res['read_bandwidth_gbs']:.2f} GB/s "
              "(best of the passes before and after the rounds)")
        print(f"  {'engine':15s} {'tokens/s':>9s} {'ms/token':>9s} {'weight GB/s':>12s} {'% read BW':>10s} "
              f"{'rounds (tokens/s)':s}")
        for n in names:
            m = res["median"][n]
            per = " ".join(f"{x['tokens_per_s']:.1f}" for x in res["rounds"] if x["engine"] == n)
            print(f"  {n:15s} {m['tokens_per_s']:9.2f} {m['ms_per_token']:9.2f} {m['weight_gbs']:12.2f} "
                  f"{m['pct_read_bw']:9.1f}% {per}")
        for k, v in res["ratio_of_medians"].items():
            print(f"  {k}: {v:.2f}x (median of per-round ratios {res['median_of_paired_ratios'][k]:.2f}x)")
    for t, per in agree.items():
        for n, a in per.items():
            print(f"greedy agreement with dflash2-numba at {t} threads, first {a['compared']} tokens: {n} "
                  f"{a['positions_agree']}/{a['compared']} positions, identical prefix {a['prefix_agree']}")
            if "f32_vs_dflash2_numba" in a:
                b = a["f32_vs_dflash2_numba"]
                print(f"    ({n} is timed in bf16; the same model loaded in float32 (untimed) agrees on "
                      f"{b['positions_agree']}/{b['compared']} positions, identical prefix {b['prefix_agree']})")
    for n, v in first_logits.items():
        print(f"logits after the prompt, {n} vs dflash2-numba: max|diff| {v['max_abs_diff_over_max_abs']:.3g} of "
              f"max|logit|, correlation {v['correlation']:.5f}, same argmax {v['same_argmax']}")
    for w in warnings:
        print(f"warning: {w}")
    not_same = sorted({(x["engine"], t) for t, r in results.items()
                       for x in r["rounds"] if not x["same_tokens_as_warmup"]})
    for n, t in not_same:
        print(f"warning: {n} at {t} threads: a timed round's tokens differ from its warm-up's")

    doc = {
        "machine": machine_facts(), "versions": versions(),
        "llama_cpp_system_info": next((e.system_info for e in engines if e.name == "llama.cpp"), None),
        "numba_threading_layer": numba.threading_layer(), "quantize": args.quantize, "isa": isa_facts(),
        "settings": {"rounds": args.rounds, "tokens": args.tokens, "threads": args.threads, "prompt_ids": prompt,
                     "check_tokens": args.check_tokens, "pause_s": args.pause, "bw_gib": args.bw_gib,
                     "llama_no_extra_bufts": args.llama_no_extra_bufts, "model": args.model, "model_shape": shape,
                     "model_dir": src.name,
                     "weight_bytes_per_token": wbytes, "gguf_layout": GGUF_LAYOUT},
        "engines": {e.name: engine_facts(e) for e in engines}, "skipped": skipped,
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "read_bandwidth": bandwidth, "results": results,
        "agreement": agree, "reference_tokens": reference, "transformers_f32_tokens": hf_f32,
        "agreement_failures": failed, "warnings": warnings, "prompt_logits_vs_ours": first_logits,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    if failed:
        loud(failed)
        return 1
    return 0


def logits_facts(ours: np.ndarray, z: np.ndarray) -> dict:
    """How close another engine's logits z [V] after the prompt are to ours [V]; for a different
    argmax also our top-2 gap and the two engines' difference at those two tokens."""
    top2, pair = np.sort(ours)[-2:], [int(ours.argmax()), int(z.argmax())]
    return {"max_abs_diff_over_max_abs": float(np.abs(z - ours).max() / np.abs(ours).max()),
            "abs_diff_p99": float(np.quantile(np.abs(z - ours), 0.99)),
            "correlation": float(np.corrcoef(z, ours)[0, 1]), "same_argmax": bool(pair[0] == pair[1]),
            "our_top2_gap": float(top2[1] - top2[0]),
            "their_argmax_ours_minus_theirs": [float(ours[i] - z[i]) for i in pair],
            "their_gap_between_the_two": float(z[pair[1]] - z[pair[0]])}


def near_tie(z: dict | None) -> bool:
    """The prompt's logits of the two engines (logits_facts): the same model (correlation >=
    0.999) whose first argmax differs only because our top-2 gap is within what the engines'
    difference moves two tokens apart: 2 x its 99th percentile over the vocabulary (a flip needs
    the two tokens' differences to add up past the gap)."""
    return bool(z) and z["correlation"] >= 0.999 and not z["same_argmax"] and \
        z["our_top2_gap"] <= 2 * z["abs_diff_p99"]


if __name__ == "__main__":
    sys.exit(main(ARGS))
