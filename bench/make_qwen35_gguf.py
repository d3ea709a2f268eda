"""Write a synthetic Qwen3.5 GGUF (llama.cpp architecture ``qwen35``) with random Q4_0 weights,
for speed tests of ninfer against llama.cpp on the same bytes.

Usage: python bench/make_qwen35_gguf.py OUT.gguf [27b|tiny] [--chat-template-from MODEL.gguf]
[--mtp]

- ``27b``: the Qwen3.5-27B shape: vocab 248320, hidden 5120, 64 layers (every 4th gated full
  attention, 24 query / 4 KV heads of 256, rotary 64), Gated DeltaNet 16 key / 48 value heads of
  128, conv 4, FFN 17408, untied output. About 15 GB.
- ``tiny``: the same structure at hidden 256, 8 layers, vocab 1024 (a CPU test loads it).
- ``--mtp``: also the MTP head, as llama.cpp writes it (``nextn_predict_layers`` 1): one more
  block, a gated full-attention layer with ``nextn.eh_proj`` (H x 2H) and its three norms,
  sharing the trunk's embedding and output (``ninfer serve --spec mtp`` drafts with it).
- ``--chat-template-from``: copy another GGUF's ``tokenizer.chat_template`` (none by default,
  and then ninfer and llama-server fall back to different ChatML renderings: the agent traces
  give both SmolLM2's, so that both servers see the same prompt tokens).

Tensor names, shapes and metadata are what llama.cpp's ``convert_hf_to_gguf.py`` writes and its
loader reads (``ninfer.store.gguf_qwen35`` holds the names; this script checks it writes exactly
those). Every matrix is Q4_0 (an fp16 scale and 16 bytes of random nibbles per 32 weights)
with the scale ``1 / (4.6 sqrt(K))``, so a matrix keeps unit-RMS activations at unit RMS and
logits stay finite; norm weights are 1 (GGUF stores zero-centred norms as ``1 + w``), ``ssm_a``
-1, ``ssm_dt`` 0, ``conv1d`` 0.1, all F32. Weights are drawn with numpy's fastest generator
and written one tensor at a time (never the whole file in memory).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import gguf
import numpy as np

from ninfer.store import gguf_qwen35 as names

SHAPES = {
    "27b": dict(vocab=248320, hidden=5120, layers=64, heads=24, kv=4, head_dim=256, ffn=17408,
                k_heads=16, v_heads=48, head_k=128, conv=4, context=262144),
    "tiny": dict(vocab=1024, hidden=256, layers=8, heads=4, kv=2, head_dim=64, ffn=512,
                 k_heads=2, v_heads=4, head_k=32, conv=4, context=4096),
}
Q4_0 = gguf.GGMLQuantizationType.Q4_0
_SPREAD = 4.6   # RMS of a Q4_0 code (q - 8 for q uniform in 0..15)


def layer_tensors(s: dict, full_attention: bool) -> dict[str, tuple[tuple[int, ...], float | None]]:
    """GGUF kind -> (numpy shape, F32 fill value or None for a random Q4_0 matrix)."""
    h, f, hd = s["hidden"], s["ffn"], s["head_dim"]
    key_dim, value_dim = s["head_k"] * s["k_heads"], s["head_k"] * s["v_heads"]
    out = {"attn_norm.weight": ((h,), 1.0), "post_attention_norm.weight": ((h,), 1.0),
           "ffn_gate.weight": ((f, h), None), "ffn_up.weight": ((f, h), None),
           "ffn_down.weight": ((h, f), None)}
    if full_attention:
        out.update({"attn_q.weight": ((2 * s["heads"] * hd, h), None),   # query | gate per head
                    "attn_k.weight": ((s["kv"] * hd, h), None),
                    "attn_v.weight": ((s["kv"] * hd, h), None),
                    "attn_output.weight": ((h, s["heads"] * hd), None),
                    "attn_q_norm.weight": ((hd,), 1.0), "attn_k_norm.weight": ((hd,), 1.0)})
        want = set(names.COMMON) | set(names.ATTENTION)
    else:
        out.update({"attn_qkv.weight": ((2 * key_dim + value_dim, h), None),
                    "attn_gate.weight": ((value_dim, h), None),
                    "ssm_beta.weight": ((s["v_heads"], h), None),
                    "ssm_alpha.weight": ((s["v_heads"], h), None),
                    "ssm_conv1d.weight": ((2 * key_dim + value_dim, s["conv"]), 0.1),
                    "ssm_dt.bias": ((s["v_heads"],), 0.0), "ssm_a": ((s["v_heads"],), -1.0),
                    "ssm_norm.weight": ((s["head_k"],), 1.0),
                    "ssm_out.weight": ((h, value_dim), None)})
        want = set(names.COMMON) | set(names.GDN)
    assert set(out) == want, sorted(set(out) ^ want)
    return out


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """Random Q4_0 payload of a ``(rows, cols)`` matrix: uint8 ``(rows, cols / 32 * 18)``."""
    nblk = rows * cols // 32
    blk = np.empty((nblk, 18), dtype=np.uint8)
    blk[:, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    blk[:, 2:] = np.frombuffer(rng.bytes(nblk * 16), dtype=np.uint8).reshape(nblk, 16)
    return blk.reshape(rows, cols // 32 * 18)


def _vocab(w: gguf.GGUFWriter, n: int) -> None:
    """A byte-level BPE vocabulary of ``n`` tokens (256 bytes, two merges, Qwen's control
    tokens, unused fillers), as ``tokenizer.ggml.*`` with the ``qwen35`` pre-tokenizer."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    toks = sorted(byte_chars) + ["\u0120t", "he"]   # GPT-2's byte-to-unicode alphabet
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(toks) + [3] * len(control)
    toks += control
    types += [5] * (n - len(toks))
    toks += [f"[PAD{i}]" for i in range(len(toks), n)]
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen35")
    w.add_token_list(toks); w.add_token_types(types); w.add_token_merges(["\u0120 t", "h e"])
    w.add_eos_token_id(toks.index("<|im_end|>")); w.add_pad_token_id(toks.index("<|endoftext|>"))
    w.add_add_bos_token(False)


def chat_template_of(path: str) -> str:
    """``tokenizer.chat_template`` of the GGUF at ``path``."""
    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def write(out: str, shape: str = "27b", seed: int = 0,
          chat_template: str | None = None, context: int | None = None,
          mtp: bool = False) -> None:
    s = dict(SHAPES[shape], **({"context": context} if context else {}))
    rng = np.random.Generator(np.random.SFC64(seed))
    h, a = s["hidden"], "qwen35"
    kinds = [(i + 1) % 4 == 0 for i in range(s["layers"])] + [True] * mtp   # (MTP: attention)
    w = gguf.GGUFWriter(out, a)
    w.add_name(f"synthetic-qwen35-{shape}-q4_0"); w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_block_count(len(kinds)); w.add_context_length(s["context"])
    if mtp:
        w.add_uint32(f"{a}.nextn_predict_layers", 1)
    w.add_embedding_length(h); w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"]); w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"]); w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(10000000.0); w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(s["head_dim"] // 4)
    w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_uint32(f"{a}.ssm.conv_kernel", s["conv"]); w.add_uint32(f"{a}.ssm.state_size", s["head_k"])
    w.add_uint32(f"{a}.ssm.group_count", s["k_heads"])
    w.add_uint32(f"{a}.ssm.time_step_rank", s["v_heads"])
    w.add_uint32(f"{a}.ssm.inner_size", s["head_k"] * s["v_heads"])
    w.add_array(f"{a}.attention.recurrent_layers", [not k for k in kinds])
    w.add_uint32(f"{a}.full_attention_interval", 4)
    _vocab(w, s["vocab"])
    if chat_template:
        w.add_chat_template(chat_template)

    plan: list[tuple[str, tuple[int, ...], float | None]] = [
        ("token_embd.weight", (s["vocab"], h), None)]
    for i, full in enumerate(kinds):
        plan += [(f"blk.{i}.{k}", shp, v) for k, (shp, v) in layer_tensors(s, full).items()]
    if mtp:
        n = s["layers"]
        plan += [(f"blk.{n}.nextn.eh_proj.weight", (h, 2 * h), None)]
        plan += [(f"blk.{n}.nextn.{k}.weight", (h,), 1.0)
                 for k in ("enorm", "hnorm", "shared_head_norm")]
    plan += [("output_norm.weight", (h,), 1.0), ("output.weight", (s["vocab"], h), None)]
    for name, shp, fill in plan:
        if fill is None:
            w.add_tensor_info(name, (shp[0], shp[1] // 32 * 18), np.dtype(np.uint8),
                              shp[0] * shp[1] // 32 * 18, raw_dtype=Q4_0)
        else:
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
    for name, shp, fill in plan:
        if fill is not None:
            w.write_tensor_data(np.full(shp, fill, np.float32))
            continue
        # the embedding is gathered (unit entries); every other matrix keeps unit RMS
        scale = 1.0 / _SPREAD if name == "token_embd.weight" else 1.0 / (_SPREAD * shp[1] ** 0.5)
        w.write_tensor_data(q4_0_blocks(rng, shp[0], shp[1], scale))
    w.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Write a synthetic Qwen3.5 GGUF (random Q4_0).")
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("shape", nargs="?", default="27b", choices=sorted(SHAPES),
                    help="27b (about 15 GB) or tiny (default 27b)")
    ap.add_argument("--chat-template-from", metavar="MODEL.gguf", default=None,
                    help="copy this GGUF's tokenizer.chat_template")
    ap.add_argument("--mtp", action="store_true", help="also write the MTP head")
    ap.add_argument("--context", type=int, default=None, metavar="TOKENS",
                    help="the trained context length to record (default: the shape's; "
                         "llama-server caps a slot's context at it)")
    a = ap.parse_args(argv)
    template = chat_template_of(a.chat_template_from) if a.chat_template_from else None
    t0 = time.perf_counter()
    write(a.out, a.shape, chat_template=template, context=a.context, mtp=a.mtp)
    size = os.path.getsize(a.out)
    print(f"{a.out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
