"""The .ninfer container: round trip, SHA-256 identity with sidecar, and error reporting."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from ninfer.store.artifact import (
    MAGIC, Artifact, ArtifactError, describe, file_sha256, load_model_file, sidecar_path,
    write_artifact,
)
from ninfer.store.quant import QuantTensor, dequantize, quantize_q8


def _header(arch: str = "llama") -> dict:
    return {
        "architecture": arch,
        "config": {"hidden_size": 64, "num_hidden_layers": 1, "rope_theta": 10000.0},
        "tokenizer": {"model": "gpt2", "pre": "gpt2", "tokens": ["a", "b", "ab"],
                      "token_types": [1, 1, 1], "merges": ["a b"], "bos_token_id": None,
                      "eos_token_id": 2, "pad_token_id": None, "unk_token_id": None,
                      "add_bos_token": False},
        "chat_template": "{{ messages[0]['content'] }}",
        "source": {"format": "test"},
    }


def _random_tensors(seed: int = 0) -> dict[str, QuantTensor]:
    rng = np.random.default_rng(seed)
    n, k, g = 24, 96, 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    q4 = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    return {
        "f32.2d": QuantTensor("f32", (n, k), data=w),
        "f32.1d": QuantTensor("f32", (k,), data=rng.standard_normal(k).astype(np.float32)),
        "f16.3d": QuantTensor("f16", (2, 3, 5),
                              data=rng.standard_normal((2, 3, 5)).astype(np.float16)),
        "bf16": QuantTensor("bf16", (n, k),
                            data=rng.integers(0, 2**16, size=(n, k), dtype=np.uint16)),
        "q8": quantize_q8(w, g),
        "q4.mins": QuantTensor("q4", (n, k), codes=q4,
                               scales=rng.standard_normal((n, k // g)).astype(np.float16),
                               mins=rng.standard_normal((n, k // g)).astype(np.float16), group=g),
        "q4.nomins": QuantTensor("q4", (n, k), codes=q4[::-1].copy(),
                                 scales=rng.standard_normal((n, k // g)).astype(np.float16),
                                 group=g),
        "empty": QuantTensor("f32", (0,), data=np.zeros((0,), np.float32)),
    }


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[8:16], "little")
    return json.loads(raw[16:16 + hlen]), raw[16 + hlen:]


def _rewrite(path: Path, header: dict, data: bytes) -> None:
    """Write a file with the given header and payload, bypassing write_artifact's checks."""
    blob = json.dumps(header).encode()
    blob += b" " * ((-(16 + len(blob))) % 64)
    path.write_bytes(MAGIC + len(blob).to_bytes(8, "little") + blob + data)


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "model.ninfer"
    tensors = _random_tensors()
    sha = write_artifact(path, _header(), tensors)
    return path, tensors, sha


def test_round_trip_identical(written):
    path, tensors, sha = written
    art = Artifact.open(path)
    assert art.path == path
    assert art.architecture == "llama"
    assert art.config == _header()["config"]
    assert art.tokenizer == _header()["tokenizer"]
    assert art.chat_template == _header()["chat_template"]
    assert art.header["format_version"] == 1
    assert art.header["source"] == {"format": "test"}
    assert art.size_bytes == path.stat().st_size
    assert list(art.tensors) == list(tensors)
    for name, t in tensors.items():
        got = art.tensors[name]
        assert (got.scheme, tuple(got.shape), got.group) == (t.scheme, tuple(t.shape), t.group)
        assert set(got.parts()) == set(t.parts())
        for part, arr in t.parts().items():
            g = got.parts()[part]
            assert g.dtype == arr.dtype and g.shape == arr.shape, (name, part)
            assert g.tobytes() == arr.tobytes(), (name, part)
        np.testing.assert_array_equal(dequantize(got).view(np.uint32),
                                      dequantize(t).view(np.uint32))
    # payloads are 64-byte aligned mmap views, read-only
    hlen = int.from_bytes(path.read_bytes()[8:16], "little")
    assert (16 + hlen) % 64 == 0
    for entry in art.header["tensors"].values():
        for part in entry["parts"].values():
            assert part["offset"] % 64 == 0
    assert not art.tensors["q8"].codes.flags.writeable


def test_sha256_matches_hashlib_and_sidecar(written):
    path, _, sha = written
    assert sha == _sha(path)
    assert Artifact.open(path).sha256 == sha
    assert file_sha256(path) == sha
    side = json.loads(sidecar_path(path).read_text())
    st = path.stat()
    assert side == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    assert sidecar_path(path).name == "model.ninfer.sha256"


def test_sidecar_reused_when_fresh(written):
    path, _, sha = written
    st = path.stat()
    fake = "0" * 64
    sidecar_path(path).write_text(json.dumps(
        {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": fake}))
    # A fresh sidecar is trusted (that is the point of the cache) ...
    assert Artifact.open(path).sha256 == fake
    assert file_sha256(path) == fake


def test_sidecar_recomputed_after_touch(written):
    path, _, sha = written
    st = path.stat()
    sidecar_path(path).write_text(json.dumps(
        {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": "0" * 64}))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert Artifact.open(path).sha256 == sha
    side = json.loads(sidecar_path(path).read_text())
    assert side["sha256"] == sha and side["mtime_ns"] == path.stat().st_mtime_ns


def test_sidecar_recomputed_after_modification(written):
    path, _, sha = written
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
    new = Artifact.open(path).sha256
    assert new == _sha(path) != sha
    assert file_sha256(path) == new


def test_sidecar_garbage_ignored(written):
    path, _, sha = written
    sidecar_path(path).write_text("{not json")
    assert Artifact.open(path).sha256 == sha
    sidecar_path(path).write_text(json.dumps(["x"]))
    assert file_sha256(path) == sha


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path, written):
    path, tensors, sha = written
    before = path.read_bytes()
    bad = dict(tensors)
    bad["broken"] = QuantTensor("q8", (4, 64), codes=np.zeros((4, 64), np.int8),
                                scales=np.zeros((4, 3), np.float16), group=32)  # wrong scales
    with pytest.raises(ArtifactError, match="model.ninfer"):
        write_artifact(path, _header(), bad)
    assert path.read_bytes() == before
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
    # Overwriting with new content replaces the file and its identity.
    sha2 = write_artifact(path, _header(), _random_tensors(seed=1))
    assert sha2 == _sha(path) != sha
    assert Artifact.open(path).sha256 == sha2


def test_write_rejects_unknown_scheme(tmp_path):
    with pytest.raises(ArtifactError, match="x.ninfer"):
        write_artifact(tmp_path / "x.ninfer", _header(),
                       {"t": QuantTensor("q3", (2, 2), data=np.zeros((2, 2), np.float32))})


# ---------------------------------------------------------------- errors name the file

def _expect_error(path: Path, *words: str) -> ArtifactError:
    with pytest.raises(ArtifactError) as ei:
        Artifact.open(path)
    msg = str(ei.value)
    assert path.name in msg, msg
    for w in words:
        assert w in msg, msg
    return ei.value


def test_truncated_file(written):
    path, _, _ = written
    raw = path.read_bytes()
    for cut in (len(raw) - 1, len(raw) // 2, 100, 12, 3):
        bad = path.with_name(f"cut{cut}.ninfer")
        bad.write_bytes(raw[:cut])
        _expect_error(bad, "truncated")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.ninfer"
    p.write_bytes(b"")
    _expect_error(p)
    with pytest.raises(ArtifactError, match="empty.ninfer"):
        load_model_file(p)


def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match="nope.ninfer"):
        Artifact.open(tmp_path / "nope.ninfer")
    with pytest.raises(ArtifactError, match="nope.ninfer"):
        load_model_file(tmp_path / "nope.ninfer")


def test_wrong_magic(written):
    path, _, _ = written
    raw = bytearray(path.read_bytes())
    raw[:8] = b"NOTMODEL"
    bad = path.with_name("magic.ninfer")
    bad.write_bytes(bytes(raw))
    _expect_error(bad, "magic")
    with pytest.raises(ArtifactError, match="magic.ninfer.*magic"):
        load_model_file(bad)


def test_corrupt_json_header(written):
    path, _, _ = written
    raw = bytearray(path.read_bytes())
    raw[16:26] = b"{not json!"
    bad = path.with_name("json.ninfer")
    bad.write_bytes(bytes(raw))
    _expect_error(bad, "corrupt header")


def test_header_not_an_object_or_missing_keys(written):
    path, _, _ = written
    header, data = _split(path)
    bad = path.with_name("list.ninfer")
    _rewrite(bad, [1, 2, 3], data)  # type: ignore[arg-type]
    _expect_error(bad, "corrupt header")
    h = dict(header)
    del h["config"]
    _rewrite(bad, h, data)
    _expect_error(bad, "corrupt header", "config")
    h = dict(header, format_version=99)
    _rewrite(bad, h, data)
    _expect_error(bad, "format_version")


def test_tensor_out_of_bounds(written):
    path, _, _ = written
    header, data = _split(path)
    header["tensors"]["q8"]["parts"]["codes"]["offset"] = header["data_size"] + 64
    bad = path.with_name("oob.ninfer")
    _rewrite(bad, header, data)
    _expect_error(bad, "out of bounds", "q8")
    # also without the optional data_size key: bounded by the file
    del header["data_size"]
    _rewrite(bad, header, data)
    _expect_error(bad, "out of bounds")


def test_tensor_entry_inconsistent(written):
    path, _, _ = written
    header, data = _split(path)
    header["tensors"]["q4.mins"]["parts"]["scales"]["shape"] = [24, 2]
    header["tensors"]["q4.mins"]["parts"]["scales"]["nbytes"] = 24 * 2 * 2
    bad = path.with_name("shape.ninfer")
    _rewrite(bad, header, data)
    _expect_error(bad, "q4.mins")
    header, data = _split(path)
    header["tensors"]["f32.1d"]["parts"]["data"]["nbytes"] = 4
    _rewrite(bad, header, data)
    _expect_error(bad, "nbytes")
    header, data = _split(path)
    header["tensors"]["f32.1d"]["parts"]["data"]["dtype"] = "object"
    _rewrite(bad, header, data)
    _expect_error(bad, "not allowed")


def test_unknown_architecture(tmp_path):
    p = tmp_path / "arch.ninfer"
    write_artifact(p, _header(arch="foo"), _random_tensors())
    e = _expect_error(p, "architecture", "foo")
    assert "unknown architecture" in str(e)


# ---------------------------------------------------------------- entry points

def test_load_model_file_detects_by_magic_not_extension(tmp_path, written):
    path, tensors, sha = written
    odd = tmp_path / "weights.gguf"  # a .ninfer with a misleading extension
    odd.write_bytes(path.read_bytes())
    art = load_model_file(odd)
    assert art.file_format == "ninfer"
    assert art.sha256 == sha
    np.testing.assert_array_equal(art.tensors["f32.2d"].data, tensors["f32.2d"].data)
    junk = tmp_path / "junk.ninfer"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ArtifactError, match="junk.ninfer"):
        load_model_file(junk)


def test_describe(written):
    path, _, sha = written
    text = describe(path)
    assert "architecture:  llama" in text
    assert sha in text
    assert "tensors:       8" in text
    assert "q4: 2" in text and "q8: 1" in text and "f32: 3" in text
    assert "3 tokens" in text
    assert "chat template: yes" in text
    assert "hidden_size: 64" in text
