"""``leantrain eval`` and ``leantrain generate``, and the KV cache behind generation.

Tolerances: fp32 logits of magnitude ~10 (weights scaled up: no near-ties) through the cache (the
same products over the same keys, one query at a time) agree with the whole-sequence forward to
atol 1e-4, rtol 1e-5; losses and
log-likelihoods with transformers' to 1e-5 relative (the same math, other summation orders)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from leantrain import cli
from leantrain.config import ModelConfig
from leantrain.model import Llama
from leantrain.model.llama import KVCache

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")

from helpers import make_hf_model  # noqa: E402  (the tiny HF Llama with its tokenizer)
from leantrain.model.hf import load_tokenizer  # noqa: E402
from leantrain.train.evaluate import evaluate, generate  # noqa: E402

CFG = ModelConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=48)


def _model(**options) -> Llama:
    torch.manual_seed(0)
    model = Llama(ModelConfig(**{**CFG.__dict__, **options})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # (sharper logits: no near-ties between the likeliest tokens)
    return model


@pytest.mark.parametrize("options", [{}, {"fused_rope": False, "n_kv_heads": 4}])
def test_cached_forward_equals_the_whole_sequence(options):
    model = _model(**options)
    idx = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(idx)
        cache = KVCache(CFG.n_layers, 20)
        parts = [model(idx[:, :7], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(7, 12)]
        parts.append(model(idx[:, 12:], cache=cache))
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-4, rtol=1e-5)


def test_cached_greedy_generation_equals_uncached():
    model = _model()
    prompt = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(2))
    cached = model.generate(prompt, 30, temperature=0, use_cache=True)
    plain = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert cached.shape == (1, 35) and torch.equal(cached, plain)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampled = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=g1)
    assert torch.equal(sampled, model.generate(prompt, 10, temperature=1.0, top_k=5, generator=g2))
    stopped = model.generate(prompt, 30, temperature=0, stop_ids=(int(cached[0, 8]),))
    assert stopped.shape[1] <= 9


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_model(out)
    return out


def test_generate_equals_transformers_greedy_generate(hf_dir, capsys):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = load_tokenizer(hf_dir)
    prompt = "def wrap(text, width):"
    ids = [tok.bos_id] + tok.encode(prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                          pad_token_id=tok.eos_id)[0, len(ids):].tolist()
    text = generate(str(hf_dir), prompt, max_new_tokens=20, device="cpu", log=lambda *a: None)
    ours = tok.encode(text)
    assert tok.eos_id not in ref  # (so no early stop: the 20 tokens compare whole)
    assert tok.decode(ref) == text and len(ours) > 0
    assert cli.main(["generate", "--from", str(hf_dir), "--prompt", prompt, "--max-new-tokens", "20",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == text.strip()


LLAMA3_LIKE_TEMPLATE = (  # (a Llama-3-style template: a header per turn, the system's first)
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] | trim }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]\n{% endif %}")


def test_generate_chat_prompts_as_transformers_apply_chat_template(hf_dir, tmp_path, capsys):
    """``--chat``: the prompt as a user's message (after ``--system``'s) through the model's own chat
    template with the assistant's turn opened, the ids transformers' ``apply_chat_template`` gives;
    the reply is the one transformers' greedy generate continues them with."""
    import shutil

    chat_dir = tmp_path / "chat"
    shutil.copytree(hf_dir, chat_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(chat_dir)
    hf_tok.chat_template = LLAMA3_LIKE_TEMPLATE
    hf_tok.save_pretrained(chat_dir)
    messages = [{"role": "system", "content": "Code."}, {"role": "user", "content": "def f(x):"}]
    ids = transformers.AutoTokenizer.from_pretrained(chat_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_dir).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=hf_tok.eos_token_id)[0, len(ids):].tolist()
    assert hf_tok.eos_token_id not in ref
    assert len(ids) + 16 <= 64  # (the tiny model's positions)
    text = generate(str(chat_dir), "def f(x):", max_new_tokens=16, device="cpu", chat=True, system="Code.",
                    log=lambda *a: None)
    assert text == hf_tok.decode(ref) and text != generate(str(chat_dir), "def f(x):", max_new_tokens=16,
                                                           device="cpu", log=lambda *a: None)
    assert cli.main(["generate", "--from", str(chat_dir), "--prompt", "x", "--system", "y", "--device", "cpu"]) == 2
    assert "give --chat too" in capsys.readouterr().err


def test_eval_text_loss_equals_transformers(hf_dir, tmp_path):
    text = "def wrap(text, width=70, **kwargs):\n    return text\n"
    (tmp_path / "t.txt").write_text(text)
    result = evaluate(str(hf_dir), str(tmp_path / "t.txt"), out=tmp_path / "ev", device="cpu", log=lambda *a: None)
    tok = load_tokenizer(hf_dir)
    ids = tok.encode(text) + [tok.eos_id]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        ref = F.cross_entropy(hf(torch.tensor([ids[:-1]])).logits[0], torch.tensor(ids[1:])).item()
    assert result["tokens"] == len(ids) - 1 and result["format"] == "text"
    assert result["loss"] == pytest.approx(ref, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(ref), rel=1e-5)
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["tokens"] == len(ids) - 1


def test_eval_multiple_choice_scores_as_lm_eval_does(hf_dir, tmp_path):
    questions = [("def wrap(", ["text", "width, x"], 0), ("return", [" text", " self.width"], 1),
                 ("import", [" os", " textwrap", " re"], " re"), ("class", [" A", " TextWrapper"], 1)]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "choices": c, "answer": a}) + "\n" for p, c, a in questions))
    assert cli.main(["eval", "--from", str(hf_dir), "--data", str(path), "--out", str(tmp_path / "ev"),
                     "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    tok = load_tokenizer(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    right = right_norm = 0
    for prompt, choices, answer in questions:
        answer = answer if isinstance(answer, int) else choices.index(answer)
        context, lls = tok.encode(prompt), []
        for choice in choices:
            whole = tok.encode(prompt + choice)
            cont = whole[len(context):]
            with torch.no_grad():
                logp = F.log_softmax(hf(torch.tensor([whole[:-1]])).logits[0], dim=-1)
            lls.append(sum(logp[len(context) - 1 + k, t].item() for k, t in enumerate(cont)))
        right += max(range(len(lls)), key=lambda i: lls[i]) == answer
        right_norm += max(range(len(lls)), key=lambda i: lls[i] / len(choices[i])) == answer
    assert result["examples"] == 4 and result["format"] == "choice"
    assert result["accuracy"] == right / 4 and result["accuracy_norm"] == right_norm / 4


def test_eval_reads_multiple_choice_parquet_as_jsonl(hf_dir, tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install -e '.[dev]')")
    import pyarrow.parquet as pq

    rows = [{"prompt": "def wrap(", "choices": ["text", "width, x"], "answer": 0},
            {"prompt": "return", "choices": [" text", " self.width"], "answer": 1},
            {"prompt": "class", "choices": [" A", " TextWrapper", " B"], "answer": 1}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val.parquet")
    scores = {}
    for name in ("val.jsonl", "val.parquet"):
        assert cli.main(["eval", "--from", str(hf_dir), "--data", str(tmp_path / name), "--out",
                         str(tmp_path / name.replace(".", "_")), "--device", "cpu"]) == 0
        scores[name] = json.loads((tmp_path / name.replace(".", "_") / "eval.json").read_text())
        assert scores[name].pop("data") == str(tmp_path / name)
    assert scores["val.parquet"] == scores["val.jsonl"] and scores["val.jsonl"]["format"] == "choice"


def test_eval_of_a_run_on_chat_data(hf_dir, tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [{"messages": [{"role": "user", "content": "wrap this"}, {"role": "assistant", "content": f"text {i}"}]}
             for i in range(6)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = evaluate(str(hf_dir), str(path), device="cpu", log=lambda *a: None)
    assert result["format"] == "chat" and result["tokens"] > 0 and math.isfinite(result["loss"])
