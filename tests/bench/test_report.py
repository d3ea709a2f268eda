"""The lines ``ninfer bench`` prints from its measurements."""
from ninfer.bench.report import emit, serve_lines


def _res(engine: float, client: float, server_engine: float) -> dict:
    return {"engine_graph": {"tok_s": engine},
            "server": {"client_tok_s": client, "server_engine_tok_s": server_engine,
                       "ready_s": 1.5},
            "overhead_client": round(1 - client / engine, 4),
            "overhead_server_engine": round(1 - server_engine / engine, 4)}


def test_serve_lines_give_the_overhead_and_flag_a_negative_one():
    lines = serve_lines(_res(1000.0, 980.0, 990.0))
    assert lines == ["server overhead b1: engine-only 1000.0 tok/s, server 980.0 client-observed "
                     "(2.0 %), 990.0 by its engine (1.0 %); ready in 1.5 s"]
    noisy = serve_lines(_res(3.2, 16.7, 16.0))
    assert "(-421.9 %)" in noisy[0] and noisy[1].startswith("note: negative overhead")


def test_the_header_names_the_kv_cache_dtype(capsys):
    res = {"kind": "prefill", "model": "/models/m.gguf", "device": "CPU", "backend": "numpy",
           "kv_dtype": "int8", "prefill": {"128": {"tok_s": 50.0}}}
    emit(res, None)
    assert capsys.readouterr().out.splitlines() == [
        "# prefill m.gguf on CPU (numpy), KV cache int8", "prefill 128: 50.0 tok/s"]
