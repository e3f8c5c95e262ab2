"""``leantrain finetune --from HF_DIR --data train.jsonl --eval-data val.jsonl --method M``: tiny
random Llama, Qwen2, Qwen3 and Mistral models saved by ``transformers`` (no download) fine-tuned by
every method on instruct examples; the held-out loss falls, the run keeps the model's tokenizer
files, and its export loads in ``transformers`` with no missing or unexpected key and the run's
logits."""

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")

from helpers import make_hf_model  # noqa: E402
from leantrain import cli  # noqa: E402
from leantrain.train.evaluate import load_model  # noqa: E402

FLAGS = ["--steps", "12", "--data.seq-len", "32", "--data.batch-size", "8", "--train.progress", "false",
         "--train.eval-every", "12"]
METHODS = {  # method flags -> optim.lr (the tiny model learns the pattern in a dozen steps at these)
    ("full",): "1e-3", ("forge",): "1e-3", ("forge", "--agoq"): "1e-3", ("chunkft",): "3e-3", ("mezo",): "1e-3",
    ("grzo",): "3e-5",
}


FAMILIES = ["llama", "qwen2", "mistral", pytest.param("qwen3", marks=pytest.mark.skipif(
    not hasattr(transformers, "Qwen3Config"), reason="this transformers has no Qwen3"))]


@pytest.fixture(scope="module", params=FAMILIES)
def hf_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / request.param
    make_hf_model(out, family=request.param)
    return out


def _add(rng) -> tuple[str, int]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"def add():\n    return {a} + {b}  # =", a + b


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d, rng = tmp_path_factory.mktemp("data"), random.Random(0)
    with open(d / "train.jsonl", "w") as f:
        for _ in range(64):
            prompt, total = _add(rng)
            f.write(json.dumps({"prompt": prompt, "response": f" {total}"}) + "\n")
    with open(d / "val.jsonl", "w") as f:
        for _ in range(16):
            prompt, total = _add(rng)
            f.write(json.dumps({"prompt": prompt, "choices": [f" {total}", f" {total + 1}"], "answer": 0}) + "\n")
    return d


@pytest.mark.parametrize("method", list(METHODS), ids=["+".join(m).replace("--", "") for m in METHODS])
def test_every_method_fine_tunes_an_hf_model_and_exports_it(hf_dir, data, tmp_path, method):
    run, exported = tmp_path / "run", tmp_path / "hf_out"
    rc = cli.main(["finetune", "--from", str(hf_dir), "--data", str(data / "train.jsonl"), "--eval-data",
                   str(data / "val.jsonl"), "--method", method[0], *method[1:], "--optim.lr", METHODS[method],
                   "--out", str(run), *FLAGS])
    assert rc == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["val_loss"] < s["initial_val_loss"], s  # the right answers' log-likelihood rose
    assert 0 <= s["val_accuracy"] <= 1 and s["steps"] == 12
    if method[0] == "grzo":  # every trainable weight but the embedding is perturbed, the norms included
        assert s["grzo_frozen"] == ["embed_tokens.weight"]
    if method[0] in ("mezo", "grzo"):
        assert s["memory"]["grads"] == 0 and s["memory"]["optimizer_states"] == 0
    src_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert json.loads((run / "tokenizer_config.json").read_text())["eos_token"] == src_cfg["eos_token"]

    assert cli.main(["export", str(run), str(exported)]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert transformers.AutoTokenizer.from_pretrained(exported).eos_token == src_cfg["eos_token"]
    ours, _ = load_model(str(run))
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, ours(x), rtol=1e-4, atol=1e-4)
        start = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()(x).logits
    assert not torch.allclose(start, ours(x))  # (the weights moved)
