"""``leantrain train --from HF_DIR``: a tiny random Llama saved by ``transformers`` (no download)
trains from its own weights with its own tokenizer, and its export loads back in ``transformers``.

Tolerance: the step-1 loss is the mean fp32 cross-entropy of the same weights on the same batch
in both libraries: equal to 1e-5 relative (the same math; summation orders differ)."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")

from helpers import MODEL_VOCAB, TOKENIZER_VOCAB, make_hf_model  # noqa: E402
from helpers import hf_text as _text  # noqa: E402
from leantrain import cli  # noqa: E402
from leantrain import config as config_mod  # noqa: E402
from leantrain import data as data_mod  # noqa: E402
from leantrain.config import ConfigError  # noqa: E402
from leantrain.model.hf import load_tokenizer  # noqa: E402
from leantrain.train import init_from  # noqa: E402

RUN_FLAGS = ["--data.seq-len", "32", "--data.batch-size", "4", "--train.eval-batches", "2", "--train.progress",
             "false", "--train.sample-tokens", "0", "--optim.warmup-steps", "1", "--train.log-every", "1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_model(out)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "some.txt"
    path.write_text(_text())
    return path


def test_train_from_hf_dir_starts_at_the_hf_models_loss_and_exports(hf_dir, text_file, tmp_path):
    run = tmp_path / "run"
    rc = cli.main(["train", "--from", str(hf_dir), "--data", str(text_file), "--steps", "3", "--out", str(run),
                   *RUN_FLAGS])
    assert rc == 0
    cfg = config_mod.from_dict(json.loads((run / "config.json").read_text()))
    assert cfg.model.vocab_size == MODEL_VOCAB and cfg.model.max_seq_len == 64  # (the model's, not the data's)
    assert cfg.model.dim == 32 and cfg.train.init_from == str(hf_dir)
    # the batch of step 1, drawn again, scored by the transformers model
    tok = load_tokenizer(hf_dir)
    data = data_mod.load(cfg.data, log=lambda *a: None, tokenizer=tok)
    assert data.vocab_size == TOKENIZER_VOCAB  # (no BPE trained: the model's tokenizer)
    x, y = data.batch("train", 32, 4, seed=cfg.train.seed, step=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1
    assert rows[0]["loss"] == pytest.approx(hf_loss, rel=1e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["initial_val_loss"] is not None
    # the run exports as an HF directory that transformers loads whole
    out = tmp_path / "exported"
    assert cli.main(["export", str(run), str(out)]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert back.config.vocab_size == MODEL_VOCAB
    trained = {k: v for k, v in back.state_dict().items() if "layers.0.self_attn.q_proj" in k}
    original = {k: v for k, v in hf.state_dict().items() if "layers.0.self_attn.q_proj" in k}
    assert any(not torch.equal(trained[k], original[k]) for k in trained)  # (three steps changed the weights)


def test_from_a_run_directory_continues_its_weights_and_tokenizer(hf_dir, text_file, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert cli.main(["train", "--from", str(hf_dir), "--data", str(text_file), "--steps", "2", "--out", str(first),
                     *RUN_FLAGS]) == 0
    assert cli.main(["train", "--from", str(first), "--data", str(text_file), "--steps", "1", "--out", str(second),
                     *RUN_FLAGS]) == 0
    pre = init_from.open_source(first)
    assert pre.checkpoint is not None and pre.model.vocab_size == MODEL_VOCAB
    cfg = json.loads((second / "config.json").read_text())
    assert cfg["model"]["dim"] == 32 and cfg["model"]["vocab_size"] == MODEL_VOCAB


def test_runtime_fields_and_max_seq_len_stay_the_users(hf_dir):
    cfg = config_mod.build("tiny", overrides={"model.max_seq_len": "48", "model.fused_loss": "false",
                                              "data.seq_len": "32"})
    init_from.apply_model(cfg, init_from.open_source(hf_dir))
    assert cfg.model.max_seq_len == 48 and cfg.model.fused_loss is False and cfg.model.dim == 32


def test_bad_inputs_are_one_sentence(hf_dir, tmp_path, capsys):
    cfg = config_mod.build("tiny", overrides={"model.dim": "96"})
    with pytest.raises(ConfigError, match="model.dim 96 disagrees"):
        init_from.apply_model(cfg, init_from.open_source(hf_dir))
    cfg = config_mod.build("tiny", overrides={"data.seq_len": "128"})
    with pytest.raises(ConfigError, match=r"data.seq_len \(128\) exceeds the model's max_seq_len \(64\)"):
        init_from.apply_model(cfg, init_from.open_source(hf_dir))
    assert cli.main(["train", "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")]) == 2
    assert "no such directory" in capsys.readouterr().err
    # (the source's positions, not the preset's, bound data.seq_len; a user's max_seq_len wins)
    rc = cli.main(["config", "--preset", "tiny", "--train.init-from", str(hf_dir), "--data.seq-len", "300",
                   "--model.max-seq-len", "512"])
    assert rc == 0 and "max_seq_len = 512" in capsys.readouterr().out


def test_data_tokenizer_encodes_the_data_without_training_a_bpe(hf_dir, text_file, tmp_path):
    from leantrain.config import DataConfig

    for source in (hf_dir, hf_dir / "tokenizer.json"):
        cfg = DataConfig(path=str(text_file), tokenizer=str(source))
        logged = []
        data = data_mod.load(cfg, log=logged.append)
        assert data.vocab_size == TOKENIZER_VOCAB and not any("training" in line for line in logged)
        assert data.train[:20].tolist() == load_tokenizer(hf_dir).encode(_text())[:20]
    with pytest.raises(ConfigError, match="data.tokenizer .*: neither a tokenizer.json file nor a directory"):
        data_mod.load(DataConfig(path=str(text_file), tokenizer=str(tmp_path)))
