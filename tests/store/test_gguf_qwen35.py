"""GGUF import of llama.cpp's ``qwen35`` architecture (Qwen3.5 / Qwen3.6): a tiny random
Qwen3.5 with an MTP head is converted by llama.cpp's own ``convert_hf_to_gguf.py`` (F32, F16,
Q8_0) and, independently, written with the converter's transforms by the ``gguf`` package (F32,
Q4_0, Q4_K); ninfer's import must give transformers' logits on the original weights, the HF
import's tensors, and clear errors on bad files."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from qwen35_gguf import V, llama_cpp_sources, make_checkpoint, run_converter, write_like_converter

from ninfer.cli import main as cli_main
from ninfer.engine.models import load_model
from ninfer.engine.models.llama import ForwardBatch
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model
from ninfer.kernels import get_ops
from ninfer.store import gguf_qwen35
from ninfer.store.artifact import ArtifactError, load_model_file
from ninfer.store.gguf_import import import_gguf
from ninfer.store.hf_import import import_hf
from ninfer.store.quant import dequantize

pytestmark = pytest.mark.slow
PROMPT = np.random.default_rng(7).integers(0, V, 80).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, state dict, transformers logits of PROMPT, HF-imported tensors)."""
    import torch
    folder = tmp_path_factory.mktemp("qwen35_hf")
    model, sd = make_checkpoint(folder)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    return folder, sd, ref, import_hf(folder, "f32")[1]


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    src, why = llama_cpp_sources(Path.home() / ".cache" / "ninfer")
    if src is None:
        pytest.skip(why)
    return src


def ninfer_logits(tensors, cfg) -> np.ndarray:
    model = Qwen35Model(Qwen35Config.from_dict(cfg), tensors, get_ops("numpy"))
    kv = model.new_kv_cache(16, 16, max_lanes=1)
    batch = ForwardBatch.from_sequences([PROMPT], [0], [list(range(8))], 16, state_slots=[0])
    return model.forward(batch, kv, all_logits=True)


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def check_against_hf(path, checkpoint, tol_logits, tol_tensor):
    _, _, ref, hf_tensors = checkpoint
    header, tensors = import_gguf(path)
    cfg = header["config"]
    assert header["architecture"] == "qwen35"
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["layer_types"] == [
        "linear_attention"] * 3 + ["full_attention"]
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["head_dim"],
            cfg["partial_rotary_factor"], cfg["rope_theta"]) == (2, 4, 64, 0.25, 10000.0)
    assert set(tensors) == set(hf_tensors)   # every HF name, MTP head included
    for name, t in hf_tensors.items():
        want = dequantize(t)
        err = np.abs(dequantize(tensors[name]) - want).max() / max(np.abs(want).max(), 1e-6)
        assert err < tol_tensor, name
    got = ninfer_logits(tensors, cfg)
    assert np.abs(ref).max() > 1.0
    err = rel_err(got, ref)
    assert err < tol_logits
    return err, header


# f16 / 8-bit errors are those of the weights' rounding on this deliberately sensitive random
# model (ninfer's own bf16 / int8 import of the same folder: 2.3e-2 / 4.5e-2); f32 is exact.
@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("f16", 5e-3), ("q8_0", 6e-2)])
def test_llama_cpp_converter_logits_match_transformers(tmp_path, checkpoint, converter,
                                                       outtype, tol):
    out = tmp_path / f"tiny-{outtype}.gguf"
    run_converter(converter, checkpoint[0], out, outtype)
    tensor_tol = {"f32": 1e-6, "f16": 1e-3, "q8_0": 2e-2}[outtype]
    err, header = check_against_hf(out, checkpoint, tol, tensor_tol)
    print(f"convert_hf_to_gguf --outtype {outtype}: logits rel err {err:.2e} "
          f"({header['source']['gguf_types']})")
    assert header["tokenizer"]["pre"] == "qwen35" and header["tokenizer"]["eos_token_id"] == 256


@pytest.mark.parametrize("qtype,tol", [("F32", 1e-4), ("F16", 5e-3), ("Q8_0", 6e-2)])
def test_converter_transforms_written_with_gguf_package(tmp_path, checkpoint, qtype, tol):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_like_converter(checkpoint[1], path, qtype)
    tensor_tol = {"F32": 1e-6, "F16": 1e-3, "Q8_0": 2e-2}[qtype]
    err, header = check_against_hf(path, checkpoint, tol, tensor_tol)
    print(f"gguf writer {qtype}: logits rel err {err:.2e} ({header['source']['gguf_types']})")


# 4-bit weights move this random model's logits ~60 % (ninfer's own int4: 54 %), so a 4-bit
# file is checked against the F32 GGUF of exactly its dequantized values (same transforms):
# Q8_0 / Q4_0 are repacked losslessly (0 difference); Q4_K is requantized to q8 group 32,
# which moves logits as much as Q8_0 vs F32 does.
@pytest.mark.parametrize("qtype,tol", [("Q8_0", 1e-5), ("Q4_0", 1e-5), ("Q4_K", 6e-2)])
def test_quantized_file_loads_what_it_stores(tmp_path, checkpoint, qtype, tol):
    path, twin = tmp_path / f"tiny-{qtype}.gguf", tmp_path / "twin.gguf"
    write_like_converter(checkpoint[1], path, qtype)
    _rewrite(path, twin, dequantize_all=True)
    header, tensors = import_gguf(path)
    twin_header, twin_tensors = import_gguf(twin)
    assert set(twin_header["source"]["gguf_types"]) == {"F32"}
    assert header["source"]["gguf_types"][qtype] >= 10
    got, ref = ninfer_logits(tensors, header["config"]), ninfer_logits(twin_tensors, twin_header["config"])
    err = rel_err(got, ref)
    print(f"gguf writer {qtype}: logits rel err vs its dequantized twin {err:.2e}, vs "
          f"transformers {rel_err(got, checkpoint[2]):.2e}")
    assert err < tol


def test_v_head_order_inverts_the_converter_reorder():
    hk, hv, d = 2, 6, 3
    grouped = np.arange(hv * d)
    tiled = grouped.reshape(hk, hv // hk, d).swapaxes(0, 1).reshape(-1)
    order = gguf_qwen35.v_head_order(hk, hv)
    assert (tiled.reshape(hv, d)[order].reshape(-1) == grouped).all()


def test_convert_cli_and_serve_path(tmp_path, checkpoint):
    src = tmp_path / "tiny.gguf"
    write_like_converter(checkpoint[1], src, "Q8_0")
    dst = tmp_path / "tiny.ninfer"
    assert cli_main(["convert", str(src), str(dst)]) == 0
    for path in (src, dst):   # `ninfer serve X.gguf` loads through load_model_file
        art = load_model_file(path)
        assert art.architecture == "qwen35" and art.config["mtp_num_hidden_layers"] == 1
        model = load_model(art, get_ops("numpy"))
        assert model.mtp is not None and art.chat_template
        kv = model.new_kv_cache(16, 16, max_lanes=1)
        b = ForwardBatch.from_sequences([PROMPT[:5]], [0], [[0]], 16, state_slots=[0])
        assert np.isfinite(model.forward(b, kv)).all()


def _rewrite(src: Path, dst: Path, drop: str = "", reshape: str = "", meta_drop: str = "",
             dequantize_all: bool = False):
    """Copy a GGUF without tensor ``drop`` / metadata ``meta_drop``, with ``reshape`` given one
    row less, or with every tensor dequantized to F32."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "qwen35")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k == meta_drop:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(k, list(f.contents()))
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        if t.name == drop:
            continue
        a = np.asarray(t.data)
        if dequantize_all:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            a = gguf.quants.dequantize(a, t.tensor_type).reshape(shape).astype(np.float32)
            w.add_tensor(t.name, a)
        else:
            w.add_tensor(t.name, a[:-1] if t.name == reshape else a,
                         raw_dtype=None if t.tensor_type in (gguf.GGMLQuantizationType.F32,
                                                             gguf.GGMLQuantizationType.F16)
                         else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.mark.parametrize("kw,msg", [
    (dict(drop="blk.1.ssm_a"), "lacks tensor"),
    (dict(reshape="blk.0.attn_gate.weight"), "has shape"),
    (dict(meta_drop="qwen35.ssm.group_count"), "ssm.group_count"),
])
def test_bad_files_raise_artifact_error(tmp_path, checkpoint, kw, msg):
    src = tmp_path / "ok.gguf"
    write_like_converter(checkpoint[1], src, "F32")
    bad = tmp_path / "bad.gguf"
    _rewrite(src, bad, **kw)
    with pytest.raises(ArtifactError, match=msg):
        import_gguf(bad)
