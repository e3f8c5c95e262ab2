"""Small corpora and configs that keep trainer tests to seconds on 2 cores."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from leantrain import config as C

TINY_OVERRIDES = {
    "model.dim": "48", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2", "model.ffn_dim": "96",
    "model.max_seq_len": "64", "data.seq_len": "32", "data.batch_size": "4", "data.tokenizer_vocab": "400",
    "train.eval_every": "5", "train.eval_batches": "2", "train.ckpt_every": "5", "train.progress": "false",
    "train.sample_tokens": "0", "optim.warmup_steps": "2", "train.log_every": "1000",
}


def write_corpus(dir_: Path, kb: int = 120) -> Path:
    """A directory of real text: a few standard-library modules (train/val split by file)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = dir_ / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in ["textwrap.py", "fractions.py", "shlex.py", "colorsys.py", "heapq.py", "bisect.py", "string.py",
                 "glob.py", "fnmatch.py", "keyword.py", "numbers.py", "calendar.py", "difflib.py", "argparse.py"]:
        f = root / name
        if f.exists() and total < kb * 1024:
            (out / (name + ".txt")).write_text(f.read_text())
            total += f.stat().st_size
    return out


def tiny_config(corpus: Path, **extra) -> C.Config:
    return C.build("tiny", overrides={**TINY_OVERRIDES, "data.path": str(corpus), **extra})


class CharTok:
    """A character tokenizer (digits, letters, punctuation) standing in for a run's BPE in the
    fine-tuning tests: the generated tasks' prompts and answers, one token a character."""

    def __init__(self):
        self.chars = sorted(set("0123456789abcdefgh ()[]{},:='%\nmaxsud=+-"))
        self.eot_id = len(self.chars)

    def encode(self, s):
        return [self.chars.index(c) for c in s]

    def encode_batch(self, ss):
        return [self.encode(s) for s in ss]


# ---------------------------------------------------------------- Hugging Face models (tests that need transformers)

TOKENIZER_VOCAB, MODEL_VOCAB = 300, 320  # (the model's embedding larger than its tokenizer, as Llama-3's is)


def hf_text() -> str:
    import textwrap

    return textwrap.dedent(open(textwrap.__file__).read()) * 2


def make_hf_model(out, seed: int = 0, family: str = "llama", **config):
    """A tiny random HF model with a byte-level BPE tokenizer (bos <s>, eos </s>), saved to ``out``:
    ``family`` llama, qwen2 (q/k/v biases), qwen3 (q/k norms, head_dim apart) or mistral (a sliding
    window longer than its positions)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([hf_text()], trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    kinds = {"llama": (transformers.LlamaConfig, {}), "qwen2": (transformers.Qwen2Config, {}),
             "qwen3": (getattr(transformers, "Qwen3Config", None), {"head_dim": 16}),
             "mistral": (transformers.MistralConfig, {"sliding_window": 64})}
    config_class, extra = kinds[family]
    hf_cfg = config_class(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, **{**extra, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return model


def train_fsdp_rank(rank, world, corpus, out, over, resume=False):
    """One rank's trainer run (for :func:`dist_utils.run_distributed`): (losses on rank 0, the
    summary, this rank's weight shards as numpy arrays)."""
    import json

    from leantrain.train.trainer import Trainer

    tr = Trainer(tiny_config(corpus, **over), out, resume=resume)
    summary = tr.fit()
    losses = [json.loads(x)["loss"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()] \
        if rank == 0 else None
    shards = {n: p.to_local().detach().numpy().copy() for n, p in tr.model.named_parameters()}
    return losses, summary, shards

