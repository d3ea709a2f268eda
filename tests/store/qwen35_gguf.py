"""Helpers for the qwen35 GGUF tests: a tiny random Qwen3.5 checkpoint (with an MTP head),
llama.cpp's own ``convert_hf_to_gguf.py`` (found or fetched, run in a subprocess), and an
independent GGUF writer that applies the converter's transforms with the ``gguf`` package (so
the import is also tested where llama.cpp's sources are not at hand, and with Q4_0 / Q4_K)."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

LLAMA_CPP_PY_VERSION = "0.3.36"   # llama-cpp-python sdist that vendors llama.cpp (qwen35 support)
V = 320
CFG = dict(vocab_size=V, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=64,
           linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
           rms_norm_eps=1e-6, tie_word_embeddings=False, mtp_num_hidden_layers=1,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25})
_MEMBERS = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/")


def _randomize(model, seed: int) -> None:
    """Every parameter re-drawn at a scale where norms, gates and decays all matter (as
    ``tests/engine/test_qwen35_vs_transformers.py``)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 7.5 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(r * 0.5 + 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + r * 0.2)
            elif "norm" in name:
                p.copy_(r * 0.2)
            elif "conv1d" in name:
                p.copy_(r * 0.4)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)


def make_checkpoint(folder: Path):
    """Save a random tiny Qwen3.5 (4 layers, Hv = 2 Hk, untied) plus ``mtp.*`` tensors and a
    byte-level tokenizer to ``folder``; return the float32 transformers model and the full
    state dict (MTP included) as numpy."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CFG))
    _randomize(model, 0)
    model = model.eval().float()
    model.save_pretrained(str(folder))
    sd = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    h, i, nh, nkv, hd = 256, 256, 4, 2, 64

    def r(*shape, s=None):
        return torch.randn(*shape, generator=g) * (s if s is not None else shape[-1] ** -0.5)

    p = "mtp.layers.0."
    sd.update({"mtp.fc.weight": r(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": r(h, s=0.2),
               "mtp.pre_fc_norm_hidden.weight": r(h, s=0.2), "mtp.norm.weight": r(h, s=0.2),
               p + "input_layernorm.weight": r(h, s=0.2),
               p + "post_attention_layernorm.weight": r(h, s=0.2),
               p + "self_attn.q_proj.weight": r(2 * nh * hd, h),
               p + "self_attn.k_proj.weight": r(nkv * hd, h),
               p + "self_attn.v_proj.weight": r(nkv * hd, h),
               p + "self_attn.o_proj.weight": r(h, nh * hd),
               p + "self_attn.q_norm.weight": r(hd, s=0.2), p + "self_attn.k_norm.weight": r(hd, s=0.2),
               p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
               p + "mlp.down_proj.weight": r(h, i)})
    sd = {k: v.contiguous() for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={t: n for n, t in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>"])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>"
                                         ).save_pretrained(str(folder))
    return model, {k: v.numpy() for k, v in sd.items()}


# --------------------------------------------------------------------------------------------
# llama.cpp's converter
# --------------------------------------------------------------------------------------------

def _extract(tgz: Path, prefix: str, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".part")
    with tarfile.open(tgz) as tf:
        members = []
        for m in tf.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel and rel.startswith(_MEMBERS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tf.extractall(tmp, members=members, filter="data")
    tmp.rename(dst)


def llama_cpp_sources(cache: Path) -> tuple[Path | None, str]:
    """A folder with llama.cpp's ``convert_hf_to_gguf.py``, ``gguf-py/`` and ``conversion/``,
    and where it came from: ``$NINFER_LLAMA_CPP`` (a source folder or tarball), the repo's
    ignored ``.peer/llama.cpp.tgz``, a per-user cache, or the llama-cpp-python sdist downloaded
    with pip (once, into the cache). ``(None, reason)`` when none can be had."""
    env = os.environ.get("NINFER_LLAMA_CPP")
    if env and Path(env).is_dir():
        return Path(env), env
    cached = cache / f"llama.cpp-{LLAMA_CPP_PY_VERSION}"
    if (cached / "convert_hf_to_gguf.py").is_file():
        return cached, str(cached)
    cache.mkdir(parents=True, exist_ok=True)
    for tgz in ([Path(env)] if env else []) + [Path(__file__).parents[2] / ".peer" / "llama.cpp.tgz"]:
        if tgz.is_file():
            _extract(tgz, "./", cached)
            return cached, str(tgz)
    dl = cache / "sdist"
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "-d", str(dl),
                        f"llama-cpp-python=={LLAMA_CPP_PY_VERSION}"],
                       check=True, capture_output=True, timeout=120)
    except (subprocess.SubprocessError, OSError) as e:
        return None, f"llama.cpp sources unavailable (no NINFER_LLAMA_CPP, no .peer/llama.cpp.tgz, pip download failed: {e})"
    sdist = next(dl.glob("llama_cpp_python-*.tar.gz"))
    _extract(sdist, f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}/vendor/llama.cpp/", cached)
    sdist.unlink()
    return cached, f"pip sdist llama-cpp-python=={LLAMA_CPP_PY_VERSION}"


# The tiny tokenizer's pre-tokenizer hash is not in the converter's table of known tokenizers
# (it hashes the ids of a fixed text); we answer "qwen35", what it answers for Qwen3.5's own.
_RUNNER = """import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def run_converter(src: Path, folder: Path, out: Path, outtype: str) -> None:
    """``convert_hf_to_gguf.py FOLDER --outfile OUT --outtype OUTTYPE`` in a subprocess."""
    res = subprocess.run([sys.executable, "-c", _RUNNER, str(src), str(folder), "--outfile",
                          str(out), "--outtype", outtype], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "NO_LOCAL_GGUF": "1"})
    if res.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{res.stderr[-3000:]}")


# --------------------------------------------------------------------------------------------
# the converter's transforms, written independently with the gguf package
# --------------------------------------------------------------------------------------------

def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (ggml ``block_q4_K``: f16 d, f16 dmin, 12 bytes of 6-bit
    scales/mins for 8 sub-blocks of 32, 128 bytes of nibbles) for ``(N, K)``, K % 256 == 0;
    returns the uint8 ``(N, K / 256 * 144)`` GGUF payload."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    d = np.maximum(scale.max(-1), 1e-12) / 63.0
    dmin = np.maximum((-lo).max(-1), 1e-12) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    eff_s = d16.astype(np.float32)[:, None] * sc
    eff_m = dmin16.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((x + eff_m[..., None]) / eff_s[..., None]), 0, 15).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2),
                          scales, qs], axis=1)
    return out.reshape(n, k // 256 * 144)


def _tiled(a: np.ndarray, axis: int, hk: int, hv: int, d: int) -> np.ndarray:
    """``_LinearAttentionVReorderBase._reorder_v_heads``: grouped -> tiled V heads."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(hk, hv // hk, d, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def write_like_converter(sd: dict[str, np.ndarray], path: Path, qtype: str = "F32") -> None:
    """Write ``sd`` (the HF state dict, float32) as ``convert_hf_to_gguf.py`` would for
    Qwen3.5, with 2-D weights in ``qtype`` ("F32", "F16", "Q8_0", "Q4_0" or "Q4_K"; a tensor
    whose K does not fit the block stays Q8_0 or F32, norms / ssm / conv stay F32)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    c = CFG
    n, hk, hv = c["num_hidden_layers"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    w = gguf.GGUFWriter(str(path), "qwen35")
    a = "qwen35"
    w.add_block_count(n + 1); w.add_context_length(32768); w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"]); w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"]); w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6); w.add_key_length(64); w.add_value_length(64)
    w.add_uint32(f"{a}.nextn_predict_layers", 1); w.add_uint32(f"{a}.ssm.conv_kernel", 4)
    w.add_uint32(f"{a}.ssm.state_size", dk); w.add_uint32(f"{a}.ssm.group_count", hk)
    w.add_uint32(f"{a}.ssm.time_step_rank", hv); w.add_uint32(f"{a}.ssm.inner_size", hv * dv)
    w.add_array(f"{a}.attention.recurrent_layers", [True, True, True, False, False])
    w.add_uint32(f"{a}.full_attention_interval", 4); w.add_rope_dimension_count(16)
    w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen35")
    w.add_token_list([f"t{i}" for i in range(V)]); w.add_token_types([1] * V)
    w.add_eos_token_id(256)

    def add(name: str, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        kind = qtype if x.ndim == 2 and "norm" not in name and "ssm_conv1d" not in name else "F32"
        if kind == "Q4_K" and x.shape[1] % 256:
            kind = "Q8_0"
        if kind in ("Q8_0", "Q4_0") and x.shape[1] % 32:
            kind = "F32"
        if kind == "F32":
            w.add_tensor(name, x)
        elif kind == "F16":
            w.add_tensor(name, x.astype(np.float16))
        elif kind == "Q4_K":
            w.add_tensor(name, quantize_q4_k(x), raw_dtype=T.Q4_K)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, T[kind]), raw_dtype=T[kind])

    def layer(bid: int, hf: str, gdn: bool) -> None:
        g = lambda k: sd[hf + k]  # noqa: E731
        b = f"blk.{bid}."
        add(b + "attn_norm.weight", g("input_layernorm.weight") + 1)
        add(b + "post_attention_norm.weight", g("post_attention_layernorm.weight") + 1)
        for k in ("gate", "up", "down"):
            add(b + f"ffn_{k}.weight", g(f"mlp.{k}_proj.weight"))
        if gdn:
            t = lambda x, axis=0, d=dv: _tiled(x, axis, hk, hv, d)  # noqa: E731
            qkv = g("linear_attn.in_proj_qkv.weight")
            add(b + "attn_qkv.weight", np.concatenate([qkv[:2 * hk * dk], t(qkv[2 * hk * dk:])]))
            add(b + "attn_gate.weight", t(g("linear_attn.in_proj_z.weight")))
            add(b + "ssm_beta.weight", t(g("linear_attn.in_proj_b.weight"), d=1))
            add(b + "ssm_alpha.weight", t(g("linear_attn.in_proj_a.weight"), d=1))
            conv = g("linear_attn.conv1d.weight").squeeze(1)
            add(b + "ssm_conv1d.weight", np.concatenate([conv[:2 * hk * dk], t(conv[2 * hk * dk:])]))
            add(b + "ssm_dt.bias", t(g("linear_attn.dt_bias"), d=1))
            add(b + "ssm_a", t(-np.exp(g("linear_attn.A_log")), d=1))
            add(b + "ssm_norm.weight", g("linear_attn.norm.weight"))
            add(b + "ssm_out.weight", t(g("linear_attn.out_proj.weight"), axis=1))
        else:
            for k, v in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
                add(b + f"attn_{k}.weight", g(f"self_attn.{v}.weight"))
            add(b + "attn_q_norm.weight", g("self_attn.q_norm.weight") + 1)
            add(b + "attn_k_norm.weight", g("self_attn.k_norm.weight") + 1)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(n):
        layer(i, f"model.layers.{i}.", gdn=(i + 1) % 4 != 0)
    layer(n, "mtp.layers.0.", gdn=False)
    add(f"blk.{n}.nextn.eh_proj.weight", sd["mtp.fc.weight"])
    add(f"blk.{n}.nextn.enorm.weight", sd["mtp.pre_fc_norm_embedding.weight"] + 1)
    add(f"blk.{n}.nextn.hnorm.weight", sd["mtp.pre_fc_norm_hidden.weight"] + 1)
    add(f"blk.{n}.nextn.shared_head_norm.weight", sd["mtp.norm.weight"] + 1)
    add("output_norm.weight", sd["model.norm.weight"] + 1)
    add("output.weight", sd["lm_head.weight"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
