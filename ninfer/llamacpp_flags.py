"""What ``ninfer serve`` calls the options of llama.cpp's ``llama-server`` and of ``vllm serve``:
a user who passes one of those gets its ninfer name in the error instead of only "unrecognized
arguments"."""
from __future__ import annotations

_CTX = "--max-context N (the context of each lane; llama.cpp's -c is shared by its -np slots)"
_KV = ("--kv-dtype (one type for K and V: fp32, fp16, int8 (llama.cpp's q8_0), rk8v4, rk4v4, "
       "rk4v4-e8, rk2v4-e8)")
_ALWAYS = "nothing: ninfer always does this"
_THREADS = "the numpy backend's BLAS threads: set OMP_NUM_THREADS (or OPENBLAS_NUM_THREADS)"
_HF = ("the model path as the first argument: a local GGUF, .ninfer or Hugging Face checkpoint "
       "folder (ninfer downloads nothing)")
_GPU = "nothing: every layer runs on the GPU (--backend cupy, the default where one is usable)"
FLAGS = {
    "-c": _CTX, "--ctx-size": _CTX,
    "-np": "--max-concurrency N", "--parallel": "--max-concurrency N",
    "-m": "the model path as the first argument", "--model": "the model path as the first argument",
    "-hf": _HF, "--hf-repo": _HF, "-hff": _HF, "--hf-file": _HF,
    "--temp": "--temperature",
    "-ctk": _KV, "--cache-type-k": _KV, "-ctv": _KV, "--cache-type-v": _KV,
    "-ngl": _GPU, "--n-gpu-layers": _GPU,
    "-fa": _ALWAYS + " (flash attention on the GPU)",
    "--flash-attn": _ALWAYS + " (flash attention on the GPU)",
    "--jinja": _ALWAYS + " (the model's chat template)",
    "--cache-reuse": _ALWAYS + " (prefix reuse; --no-prefix-reuse turns it off)",
    "--ctx-checkpoints": "--turn-checkpoints N (hybrid models)",
    "--cache-ram": "--continuation-cache-l2-mib",
    "-n": "--default-max-tokens", "--n-predict": "--default-max-tokens",
    "--alias": "--model-id",
    "-b": "--prefill-chunk", "--batch-size": "--prefill-chunk",
    "-ub": "--prefill-chunk", "--ubatch-size": "--prefill-chunk",
    "-s": "--seed",
    "-a": "--model-id",
    "--cont-batching": _ALWAYS + " (lanes are batched continuously)",
    "--mlock": "nothing: ninfer has no such option (on the GPU the weights live in device memory)",
    "--min_p": "--min-p", "--top_k": "--top-k", "--top_p": "--top-p",
    "-t": _THREADS, "--threads": _THREADS,
}
VLLM_FLAGS = {
    "--kv-cache-dtype": _KV + "; for vLLM's fp8: int8 or rk8v4",
    "--gpu-memory-utilization": "--gpu-memory SIZE (a budget such as 120GiB, not a fraction)",
    "--max-model-len": _CTX, "--max-num-seqs": "--max-concurrency N",
    "--max-num-batched-tokens": "--prefill-chunk", "--served-model-name": "--model-id",
    "--enable-prefix-caching": _ALWAYS + " (prefix reuse; --no-prefix-reuse turns it off)",
    "--speculative-config": "--spec mtp --draft-tokens K (the model's MTP head)",
    "--disable-log-requests": "--no-log-requests (a line per request on stderr is the default)",
    "--enable-log-requests": _ALWAYS + " (a line per request on stderr; --no-log-requests "
                             "turns it off)",
}


# ``ninfer bench perplexity``'s names for llama-perplexity's options
PERPLEXITY_FLAGS = {
    "-c": "--ctx N", "--ctx-size": "--ctx N", "-f": "--text FILE", "--file": "--text FILE",
    "--chunks": "--windows N",
    "--kl-divergence": "--kl (the reference configuration runs in the same command)",
    "--kl-divergence-base": "--kl (the reference configuration runs in the same command)",
    "-b": "--chunk N", "--batch-size": "--chunk N",
    "-ub": "--chunk N", "--ubatch-size": "--chunk N",
    "-ctk": _KV, "--cache-type-k": _KV, "-ctv": _KV, "--cache-type-v": _KV,
    "-ngl": _GPU, "--n-gpu-layers": _GPU, "-m": "the model path as the first argument",
    "--model": "the model path as the first argument",
}


PEERS = {   # a command's peers, whose options it names
    "serve": (("llama-server", FLAGS), ("vLLM", VLLM_FLAGS)),
    "bench perplexity": (("llama-perplexity", PERPLEXITY_FLAGS),),
}


def hints(unknown: list[str], command: str = "serve") -> list[str]:
    """``FLAG: use ...`` for each of ``unknown`` (as given, ``--flag=value`` too) that is an
    option of one of ``command``'s peers (``PEERS``; none for other commands) that ninfer names
    otherwise."""
    out = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        for peer, flags in PEERS.get(command, ()):
            if flag in flags:
                out.append(f"{flag} is {peer}'s; ninfer {command}: {flags[flag]}")
    return out
