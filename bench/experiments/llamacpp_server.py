"""llama.cpp's ``llama-server`` as a reference for next-token distributions: start it on a GGUF,
ask ``/completion`` for the full softmax of the raw logits after a prompt of token ids, stop it.

Used by ``llamacpp_logits_qwen35.py``. The server reports ``n_probs`` probabilities computed
from the context's raw logits (``post_sampling_probs: false`` skips the sampler chain), so with
``n_probs`` = the vocabulary size it returns the whole distribution: the logits up to one
additive constant per position.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from ninfer.ports import free_ports


def add_merges_if_missing(src: Path, dst: Path) -> Path:
    """``src``, or a copy at ``dst`` with one dummy BPE merge: llama.cpp refuses a ``gpt2``
    tokenizer without ``tokenizer.ggml.merges`` (the tiny byte-level test tokenizer has none);
    the merge only changes tokenization of text, never the logits of given token ids."""
    import gguf
    r = gguf.GGUFReader(src)
    if "tokenizer.ggml.merges" in r.fields:
        return src
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, list(f.contents()))
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    w.add_token_merges(["\u0120 \u0120"])   # "Ġ Ġ": two byte-level spaces
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data),
                     raw_dtype=None if t.tensor_type in plain else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


class LlamaServer:
    """A ``llama-server`` child process on ``gguf`` (context ``ctx``, one slot, KV cache type
    ``kv_type``); ``extra``: more arguments (``--no-repack`` avoids a crash in the CPU AMX repack
    code on some hosts). Its shared libraries are looked for next to the binary."""

    def __init__(self, binary: str, gguf: Path, ctx: int = 4096, kv_type: str = "f32",
                 threads: int = 2, extra: tuple[str, ...] = ("--no-repack",),
                 log: Path | None = None):
        self.port = free_ports()
        env = dict(os.environ)
        libdir = str(Path(binary).resolve().parent)
        env["LD_LIBRARY_PATH"] = libdir + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        cmd = [binary, "-m", str(gguf), "-c", str(ctx), "-np", "1", "-t", str(threads),
               "--host", "127.0.0.1", "--port", str(self.port), "-ctk", kv_type, "-ctv", kv_type,
               *extra]
        self.log = open(log or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(60.0)

    def _post(self, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}"
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data), timeout=timeout) as r:
            return json.load(r)

    def _wait_ready(self, limit: float) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                if self._post("/health", timeout=2.0).get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("llama-server not ready in time")

    def logprobs(self, prompt: list[int], vocab: int, safe_token: int) -> np.ndarray:
        """Log-probabilities ``(vocab,)`` of the token after ``prompt`` (token ids, no BOS
        added), from one ``n_predict: 1`` request with the prompt recomputed (no cache).

        The server only reports probabilities of a token whose text is complete UTF-8, so a
        large ``logit_bias`` makes the sampled token ``safe_token`` (an ASCII byte); the bias
        acts in the sampler, after the raw logits the reported probabilities come from."""
        d = self._post("/completion", {
            "prompt": prompt, "n_predict": 1, "n_probs": vocab, "post_sampling_probs": False,
            "temperature": 0, "cache_prompt": False, "logit_bias": [[safe_token, 1e4]]})
        if d["timings"]["prompt_n"] != len(prompt):
            raise RuntimeError(f"server evaluated {d['timings']['prompt_n']} prompt tokens, "
                               f"sent {len(prompt)} (a BOS added?)")
        top = d["completion_probabilities"][0]["top_logprobs"]
        if len(top) != vocab:
            raise RuntimeError(f"{len(top)} probabilities returned, vocabulary {vocab}")
        out = np.full(vocab, np.nan)
        for e in top:
            out[e["id"]] = e["logprob"]
        return out

    def token_id(self, text: str) -> int:
        """The single token id of ``text`` (``/tokenize``)."""
        ids = self._post("/tokenize", {"content": text})["tokens"]
        if len(ids) != 1:
            raise RuntimeError(f"{text!r} is {len(ids)} tokens")
        return ids[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
