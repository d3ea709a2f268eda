"""A model file whose chat template or special-token ids are damaged is refused at load with
one line naming the file (exit 2 from the CLI), instead of a traceback from deep inside the
server's start-up."""
from __future__ import annotations

import pytest

from ninfer.engine.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def gen(bench_script):
    return bench_script("make_qwen35_gguf")


@pytest.mark.parametrize("name, value", [("eos", 5000), ("bos", -1), ("pad", "3"),
                                         ("unk", True)])
def test_a_special_token_id_outside_the_vocabulary_is_refused(name, value):
    with pytest.raises(TokenizerError, match=f"{name}_token_id {value!r} is not a token id of "
                                             f"this 4-token vocabulary"):
        Tokenizer.from_dict({"tokens": ["a", "b", "c", "d"], f"{name}_token_id": value})
    import numpy as np
    assert Tokenizer.from_dict({"tokens": ["a", "b"], "eos_token_id": np.uint32(1)}).eos_id == 1


def test_a_broken_chat_template_is_one_line_at_start(gen, tmp_path, capsys):
    from ninfer.cli import main
    from ninfer.server import load_runtime
    path = tmp_path / "bad-template.gguf"
    gen.write(str(path), "tiny", chat_template="{% fxr m in messages %}{{ m }}{% endfor %}")
    with pytest.raises(ValueError, match="its chat template syntax error at line 1"):
        load_runtime(str(path))
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ninfer: {path}: its chat template syntax error at line 1")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
