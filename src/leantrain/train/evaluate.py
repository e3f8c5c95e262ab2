"""``leantrain eval`` and ``leantrain generate``: a trained run or a Hugging Face model, scored or sampled.

    leantrain eval --from runs/ft --data val.jsonl --out runs/ft/eval
    leantrain eval --from HF_DIR --data mc.jsonl            (multiple choice: accuracy)
    leantrain generate --from HF_DIR --prompt "def add(a, b):" --max-new-tokens 40

``--from``: :mod:`leantrain.train.init_from` (an HF directory, a run or a checkpoint directory).

Scoring (:func:`evaluate`), by what ``--data`` holds:

- text (a text file, a directory of them, ``{"text"}`` JSONL): the documents' tokens, each
  followed by the end-of-text id, cut into windows of ``seq_len + 1`` tokens that overlap by one
  (every token after the first is predicted once, from at most ``seq_len`` tokens before it
  within its window);
- instruct / chat JSONL: the examples as training sees them (:mod:`leantrain.data.packing`, one
  example a row), the loss on their completion / assistant tokens only;
- multiple choice (``{"prompt", "choices", "answer"}`` JSONL, ``answer`` the index or the text of
  the right choice): as lm-eval-harness scores such tasks, each choice's log-likelihood is the
  sum of the log-probabilities of its tokens after the prompt (the tokens of ``prompt + choice``
  beyond those of ``prompt``; no bos added; a prompt of no tokens is preceded by the end-of-text
  id); ``accuracy``: the likeliest choice is the answer; ``accuracy_norm``: the likeliest per
  character of the choice (lm-eval's ``acc_norm``).

``eval.json``: ``loss`` (mean per predicted token), ``perplexity`` (its exp) and ``tokens``
(predicted tokens), or ``accuracy``, ``accuracy_norm`` and ``examples``; with ``source``,
``data`` and ``format``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from leantrain.config import ConfigError
from leantrain.data.examples import ChatTemplate, detect_format, encode_example, records
from leantrain.data.packing import pack_rows
from leantrain.data.sources import user_source
from leantrain.model import Llama
from leantrain.model.llama import Packed
from leantrain.train.init_from import open_source


def load_model(source: str, device: str | torch.device = "cpu", log=print) -> tuple[Llama, object]:
    """(the model in eval mode on ``device``, its tokenizer) of a run, checkpoint or HF directory."""
    pre = open_source(source, log=log)
    if pre.tokenizer is None:
        raise ConfigError(f"--from {source}: no tokenizer found (tokenizer.json) to encode text with")
    model = Llama(pre.model)
    model.load_state_dict(pre.weights())
    return model.eval().to(device), pre.tokenizer


def _device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@torch.no_grad()
def _loss_over_rows(model: Llama, rows, batch_size: int, packed: bool, device) -> dict:
    total, count = 0.0, 0
    for i in range(0, len(rows.tokens), batch_size):
        x = torch.from_numpy(rows.tokens[i:i + batch_size]).to(device)
        y = torch.from_numpy(rows.targets[i:i + batch_size]).to(device)
        n = int((y != -100).sum())
        if n == 0:
            continue
        inputs = Packed(x, torch.from_numpy(rows.documents[i:i + batch_size]).to(device)) if packed else x
        total += model(inputs, y).double().item() * n
        count += n
    if count == 0:
        raise ConfigError("the data has no token to score")
    return {"loss": total / count, "perplexity": math.exp(min(total / count, 700.0)), "tokens": count}


def _text_rows(path: Path, tok, seq_len: int):
    """Windows of ``seq_len + 1`` tokens of the documents' ids (module docstring) as rows."""
    ids: list[int] = []
    for doc in user_source(path, log=lambda *a: None).documents():
        for piece_ids in tok.encode_batch(list(doc.pieces())):
            ids.extend(piece_ids)
        if tok.eot_id is not None:
            ids.append(tok.eot_id)
    windows = [(ids[s:s + seq_len + 1], [True] * len(ids[s:s + seq_len + 1])) for s in range(0, len(ids) - 1, seq_len)]
    return pack_rows([w for w in windows if len(w[0]) > 1], seq_len, pack=False, pad_id=0)


def _choice_loglikelihoods(model: Llama, tok, prompt: str, choices: list[str], device) -> list[float]:
    """Each choice's summed log-probability after ``prompt`` (module docstring)."""
    context = tok.encode(prompt) or [tok.eot_id if tok.eot_id is not None else 0]
    limit = model.cfg.max_seq_len + 1
    seqs, starts = [], []
    for choice in choices:
        whole = tok.encode(prompt + choice) if tok.encode(prompt) else context + tok.encode(choice)
        cont = whole[len(context):] if whole[:len(context)] == context else tok.encode(choice)
        seq = (context + cont)[-limit:]
        seqs.append(seq)
        starts.append(len(seq) - len(cont))
    width = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        x[r, :len(s) - 1] = torch.tensor(s[:-1])
    logp = F.log_softmax(model(x.to(device)).float(), dim=-1)
    out = []
    for r, (s, start) in enumerate(zip(seqs, starts)):
        targets = torch.tensor(s[start:], device=device)
        out.append(logp[r, start - 1:len(s) - 1].gather(-1, targets[:, None]).sum().item())
    return out


@torch.no_grad()
def multiple_choice(model: Llama, tok, path: Path, device) -> dict:
    right = right_norm = n = 0
    for _, rec in records(path, "choice"):
        choices = rec["choices"]
        answer = rec["answer"] if isinstance(rec["answer"], int) else choices.index(rec["answer"])
        ll = _choice_loglikelihoods(model, tok, rec["prompt"], choices, device)
        right += max(range(len(ll)), key=lambda i: ll[i]) == answer
        right_norm += max(range(len(ll)), key=lambda i: ll[i] / max(len(choices[i]), 1)) == answer
        n += 1
    return {"accuracy": right / n, "accuracy_norm": right_norm / n, "examples": n}


def evaluate(source: str, data: str, *, out: str | Path | None = None, seq_len: int | None = None,
             batch_size: int = 8, device: str | None = None, log=print) -> dict:
    """Score ``source`` on ``data`` (module docstring); writes ``out/eval.json`` when ``out`` is given."""
    dev = _device(device)
    model, tok = load_model(source, dev, log=log)
    path = Path(data).expanduser()
    if not path.exists():
        raise ConfigError(f"--data {data} does not exist")
    seq_len = min(seq_len or 2048, model.cfg.max_seq_len)
    fmt = detect_format(path) if path.suffix == ".jsonl" and path.is_file() else "text"
    if fmt == "choice":
        result = multiple_choice(model, tok, path, dev)
    elif fmt in ("instruct", "chat"):
        template = ChatTemplate.of(tok) if fmt == "chat" else None
        examples = [encode_example(rec, fmt, tok, template, f"{path}:{i}") for i, rec in records(path, fmt)]
        result = _loss_over_rows(model, pack_rows(examples, seq_len, pack=False, pad_id=0), batch_size, False, dev)
    else:
        result = _loss_over_rows(model, _text_rows(path, tok, seq_len), batch_size, False, dev)
    result = {**result, "source": str(source), "data": str(path), "format": fmt}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "eval.json").write_text(json.dumps(result, indent=1))
    return result


def generate(source: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, device: str | None = None, log=print) -> str:
    """The text ``source`` continues ``prompt`` with (bos first when the tokenizer has one; greedy at
    temperature 0; stops at an end-of-sequence token), by :meth:`leantrain.model.Llama.generate`
    with its KV cache."""
    dev = _device(device)
    model, tok = load_model(source, dev, log=log)
    bos = getattr(tok, "bos_id", None)
    ids = ([bos] if bos is not None else []) + tok.encode(prompt)
    if not ids:
        raise ConfigError("--prompt encodes to no tokens and the tokenizer has no bos token to start from")
    stop = tuple(getattr(tok, "eos_ids", ()) or ((tok.eot_id,) if tok.eot_id is not None else ()))
    g = torch.Generator(device=dev).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=dev), max_new_tokens, temperature=temperature, top_k=top_k,
                         generator=g, stop_ids=stop)
    new = out[0, len(ids):].tolist()
    if new and new[-1] in stop:
        new = new[:-1]
    return tok.decode(new)
