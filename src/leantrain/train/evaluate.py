"""``leantrain eval`` and ``leantrain generate``: a trained run or a Hugging Face model, scored or sampled.

    leantrain eval --from runs/ft --data val.jsonl --out runs/ft/eval
    leantrain eval --from HF_DIR --data mc.jsonl            (multiple choice: accuracy)
    leantrain generate --from HF_DIR --prompt "def add(a, b):" --max-new-tokens 40

``--from``: :mod:`leantrain.train.init_from` (an HF directory, a run or a checkpoint directory).

Scoring (:func:`evaluate`), by what ``--data`` holds: a text file or directory, or records in a
``.jsonl``, ``.json`` or ``.parquet`` file or a Hugging Face ``datasets`` directory
(:mod:`leantrain.data.records`; a ``DatasetDict`` directory through its validation, else test, split):

- text (a text file, a directory of them, ``{"text"}`` records): the documents' tokens, each
  followed by the end-of-text id, cut into windows of ``seq_len + 1`` tokens that overlap by one
  (every token after the first is predicted once, from at most ``seq_len`` tokens before it
  within its window);
- instruct / chat records: the examples as training sees them (:mod:`leantrain.data.packing`, one
  example a row), the loss on their completion / assistant tokens only;
- multiple choice (``{"prompt", "choices", "answer"}`` records, ``answer`` the index or the text of
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
from pathlib import Path

import torch

from leantrain.config import ConfigError
from leantrain.data.examples import ChatTemplate, record_format_of
from leantrain.data.records import EVAL_SPLITS, dataset_split
from leantrain.model import Llama
from leantrain.train.evalset import ChoiceEval, RowsEval, example_rows, text_rows
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


def evaluate(source: str, data: str, *, out: str | Path | None = None, seq_len: int | None = None,
             batch_size: int = 8, device: str | None = None, log=print) -> dict:
    """Score ``source`` on ``data`` (module docstring); writes ``out/eval.json`` when ``out`` is given."""
    dev = _device(device)
    model, tok = load_model(source, dev, log=log)
    path = Path(data).expanduser()
    if not path.exists():
        raise ConfigError(f"--data {data} does not exist")
    seq_len = min(seq_len or 2048, model.cfg.max_seq_len)
    path = dataset_split(path, EVAL_SPLITS)
    fmt = record_format_of(path)
    with torch.no_grad():
        if fmt == "choice":
            result = ChoiceEval(path, tok, device=dev).score(model)
            del result["loss"]  # (accuracy is what such a file measures)
        elif fmt in ("instruct", "chat"):
            result = RowsEval(example_rows(path, fmt, tok, seq_len), batch_size, device=dev).score(model)
        else:
            result = RowsEval(text_rows(path, tok, seq_len), batch_size, device=dev).score(model)
    result = {**result, "source": str(source), "data": str(path), "format": fmt}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "eval.json").write_text(json.dumps(result, indent=1))
    return result


def generate(source: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, device: str | None = None, chat: bool = False,
             system: str | None = None, log=print) -> str:
    """The text ``source`` continues ``prompt`` with (bos first when the tokenizer has one; greedy at
    temperature 0; stops at an end-of-sequence token), by :meth:`leantrain.model.Llama.generate`
    with its KV cache. ``chat``: ``prompt`` is a user's message (after ``system``'s, when given), rendered
    by the tokenizer's chat template with the assistant's turn opened, as fine-tuning on chat records
    renders a conversation; the reply is the assistant's message."""
    dev = _device(device)
    if system is not None and not chat:
        raise ConfigError("--system is a chat message: give --chat too")
    model, tok = load_model(source, dev, log=log)
    bos = getattr(tok, "bos_id", None)
    if chat:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        text = ChatTemplate.of(tok).render(messages, add_generation_prompt=True, where="--chat")
        ids = tok.encode(text)  # (the template wrote the special tokens)
    else:
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
