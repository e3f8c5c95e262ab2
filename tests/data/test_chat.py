"""Instruction and chat data: rendering, loss masks, packing, malformed lines, and a run on them."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from leantrain import cli
from leantrain import data as data_mod
from leantrain.config import ConfigError, DataConfig
from leantrain.data.examples import ChatTemplate, encode_example
from leantrain.data.packing import pack_rows
from leantrain.model.hf import HFTokenizer
from leantrain.model.llama import Packed

# a Llama-3-like template: a header per turn, <eot> after each message, the bos token first
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<hdr>{{ m['role'] }}</hdr>{{ m['content'] }}<eot>{% endfor %}"
            "{% if add_generation_prompt %}<hdr>assistant</hdr>{% endif %}")


def _word_tokenizer(template=TEMPLATE) -> HFTokenizer:
    """Words and specials as whole tokens: what each token is, is plain in the tests."""
    words = "<s> </s> <hdr> </hdr> <eot> user assistant system hi there how are you fine thanks what is 2 + 3 5 ? , !"
    vocab = {w: i for i, w in enumerate(["[UNK]", *words.split()])}
    tok = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<hdr>", "</hdr>", "<eot>"])
    return HFTokenizer(tok, bos_id=vocab["<s>"], eos_id=vocab["</s>"], chat_template=template)


def _tokens(tok, ids):
    return [tok.tokenizer.id_to_token(i) for i in ids]


def test_instruct_trains_on_the_completion_and_eos_only():
    tok = _word_tokenizer()
    ids, train = encode_example({"prompt": "what is 2 + 3 ?", "completion": "5"}, "instruct", tok, None, "f:1")
    assert _tokens(tok, ids) == ["<s>", "what", "is", "2", "+", "3", "?", "5", "</s>"]
    assert train == [False] * 7 + [True, True]
    ids2, _ = encode_example({"prompt": "what is 2 + 3 ?", "response": "5"}, "instruct", tok, None, "f:1")
    assert ids2 == ids  # ("response" is the completion)


def test_chat_trains_on_each_assistant_turn_as_the_template_renders_it():
    tok = _word_tokenizer()
    msgs = [{"role": "system", "content": "hi"}, {"role": "user", "content": "how are you ?"},
            {"role": "assistant", "content": "fine , thanks !"}, {"role": "user", "content": "what is 2 + 3 ?"},
            {"role": "assistant", "content": "5"}]
    ids, train = encode_example({"messages": msgs}, "chat", tok, ChatTemplate.of(tok), "f:1")
    trained = [t for t, keep in zip(_tokens(tok, ids), train) if keep]
    assert trained == ["fine", ",", "thanks", "!", "<eot>", "5", "<eot>"]
    assert _tokens(tok, ids)[:3] == ["<s>", "<hdr>", "system"]


def test_chat_without_a_template_uses_the_documented_default():
    template = ChatTemplate()
    text = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nthere<|im_end|>\n"
    prompt = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")


def test_packing_keeps_examples_apart():
    examples = [([1, 2, 3, 4], [False, False, True, True]), ([5, 6, 7], [False, True, True]),
                ([8, 9, 10, 11, 12, 13], [False] * 3 + [True] * 3)]
    rows = pack_rows(examples, 6, pack=True, pad_id=0)
    # row 0: example 0 (3 pairs) + example 1 (2 pairs), 1 of padding; row 1: example 2 (5 pairs)
    assert rows.tokens.tolist() == [[1, 2, 3, 5, 6, 0], [8, 9, 10, 11, 12, 0]]
    assert rows.targets.tolist() == [[-100, 3, 4, 6, 7, -100], [-100, -100, 11, 12, 13, -100]]
    assert rows.documents.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 1]]
    one = pack_rows(examples, 6, pack=False, pad_id=0)
    assert len(one.tokens) == 3 and one.tokens[1].tolist() == [5, 6, 0, 0, 0, 0]
    cut = pack_rows([(list(range(1, 11)), [True] * 10)], 4, pack=True, pad_id=0)
    assert cut.tokens.tolist() == [[1, 2, 3, 4]] and cut.targets.tolist() == [[2, 3, 4, 5]]


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("lines, message", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], r"x.jsonl:2: an instruct line needs a string "
                                                             r"'completion' \(missing\)"),
    ([{"prompt": "a", "completion": "b"}, "", {"prompt": 3, "completion": "d"}],
     r"x.jsonl:3: an instruct line needs a string 'prompt' \(a int\)"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}],
     r"x.jsonl:1: message 1 needs a string 'content' \(missing\)"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], r"x.jsonl:1: a chat line needs at least one 'assistant'"),
    ([{"messages": []}], r"x.jsonl:1: a chat line needs 'messages'"),
    ([{"prompt": "a", "completion": "b"}, "{not json"], r"x.jsonl:2: not valid JSON"),
    ([{"question": "a"}], r"x.jsonl:1: no known fields \(question\)"),
    ([{"prompt": "a", "choices": ["x", "y"], "answer": 0}], "multiple-choice records"),
])
def test_malformed_lines_name_the_file_line_and_field(tmp_path, lines, message):
    cfg = DataConfig(path=str(_write(tmp_path / "x.jsonl", lines)), seq_len=16)
    with pytest.raises(ConfigError, match=message):
        data_mod.load(cfg, log=lambda *a: None, tokenizer=_word_tokenizer())


def _chat_file(path, n=40):
    lines = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        lines.append({"messages": [{"role": "user", "content": f"what is {a} + {b} ?"},
                                   {"role": "assistant", "content": f"{a} + {b} is {a + b} ."}]})
    return _write(path, lines)


def test_chat_file_loads_as_packed_rows_with_masked_targets(tmp_path):
    tok = _word_tokenizer()
    path = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "how are you ?"},
                                                       {"role": "assistant", "content": "fine"}]}] * 12)
    data = data_mod.load(DataConfig(path=str(path), seq_len=24, val_fraction=0.2), log=lambda *a: None,
                         tokenizer=tok)
    x, y = data.batch("train", 24, 2, seed=0, step=0)
    assert isinstance(x, Packed) and x.tokens.shape == (2, 24) and y.shape == (2, 24)
    kept = [tok.tokenizer.id_to_token(i) for i in y[y != -100].tolist()]
    assert set(kept) == {"fine", "<eot>"}  # (only the assistant's tokens are targets)
    again = data.batch("train", 24, 2, seed=0, step=0)
    assert torch.equal(again[0].tokens, x.tokens)  # (batches: a function of seed and step)
    with pytest.raises(ConfigError, match="packed for data.seq_len 24"):
        data.batch("train", 16, 2, seed=0, step=0)
    unmasked = data_mod.load(DataConfig(path=str(path), seq_len=24, mask_prompt=False, pack=False),
                             log=lambda *a: None, tokenizer=tok)
    x, y = unmasked.batch("train", 24, 2, seed=0, step=0)
    assert isinstance(x, torch.Tensor) and int((y != -100).sum(1)[0]) == 13  # (14 tokens: 13 targets)


def test_train_on_chat_data_from_scratch(tmp_path):
    path = _chat_file(tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    rc = cli.main(["train", "--data", str(path), "--steps", "3", "--out", str(run), "--model.dim", "48",
                   "--model.n-layers", "2", "--model.n-heads", "4", "--data.seq-len", "64", "--data.batch-size", "4",
                   "--data.tokenizer-vocab", "300", "--train.progress", "false", "--train.sample-tokens", "0",
                   "--train.eval-batches", "1"])
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert np.isfinite(summary["final_loss"]) and summary["initial_val_loss"] is not None
