"""The ``leantrain`` command: train, compare, finetune, export, eval, generate, config.

    leantrain train --preset tiny --steps 300 --out runs/a
    leantrain train --preset tiny --baseline --out runs/base
    leantrain train --from HF_DIR --data my.txt --steps 100 --out runs/ft   (start from a Hugging Face model)
    leantrain compare --preset tiny --steps 300 --out runs/cmp
    leantrain finetune --from HF_DIR --data train.jsonl --eval-data val.jsonl --method full|forge|chunkft|mezo|grzo --out runs/ft
    leantrain export runs/a hf_out          (a Hugging Face model directory: from_pretrained loads it)
    leantrain eval --from runs/a|HF_DIR --data val.jsonl [--out DIR]   (loss and perplexity, or choice accuracy)
    leantrain generate --from runs/a|HF_DIR --prompt "def " --max-new-tokens 40 [--temperature 0.8 --top-k 40] [--chat]
    leantrain config --preset tiny [--section.field value ...]   (the resolved config, every field documented)

Every config field is settable as ``--section.field value`` (``--forge.state-dtype int8``,
``--comm.scape.density 0.01``); ``--forge``/``--agoq`` are shorthands for ``--forge.enabled
true``/``--agoq.enabled true``. Benchmarks are scripts: ``python benchmarks/bench_<topic>.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from leantrain import config as config_mod
from leantrain.config import ConfigError
from leantrain.runtime.checkpoint import CheckpointError

# name -> config overrides; the baseline is plain torch.optim.AdamW
RECIPES: dict[str, dict] = {
    "baseline": {},
    "reference": {},
    "forge": {"forge.enabled": "true"},
    "forge-bf16": {"forge.enabled": "true", "train.weights": "bf16"},
    "forge-bf16-int8": {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": "int8"},
    "forge-bf16-int8p": {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": "int8p"},
    "forge-bf16-fp8": {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": "fp8"},
    "agoq": {"agoq.enabled": "true"},
    "agoq+forge": {"agoq.enabled": "true", "forge.enabled": "true"},
}
_RECIPE_NEEDS = {"forge": "leantrain.forge", "agoq": "leantrain.agoq"}


FINETUNE_EPILOG = """methods (--method; the same run as leantrain train, with fine-tuning defaults):
  full      back-propagation into every weight, AdamW        forge   the same, FORGE's fused step
  chunkft   back-propagation into one chunk of the weights at a time (finetune.num_chunks)
  mezo      zeroth order: two forwards a step, no gradients, no optimizer state
  grzo      zeroth order with per-example signs (GRZO), norms included
data: --data FILE (text, or instruct / chat records: the prompt is masked from the loss) and
  --eval-data FILE (scored every train.eval_every steps: loss, or accuracy for {prompt, choices,
  answer} lines); or --task compare|lookup|parity, a generated smoke test scored by accuracy:
    compare   max(3, 7) ==  -> 7        lookup   d = {'a': 3, 'b': 7}; d['b'] ==  -> 7
    parity    sum([1, 0, 1, 1]) % 2 ==  -> 1
options: --finetune.num-chunks N --finetune.interval K (ChunkFT), --finetune.eps E (MeZO's eps,
  GRZO's sigma), --finetune.eval-examples N (--task), --agoq, and every --section.field of train.
defaults (each a config field you may set): optim.lr the method's (tuned on the tiny preset: set
  it for your model; MeZO's scales as 1/parameters, 3e-4 at 3.1M), optim.weight_decay 0, train.eval_every and train.ckpt_every the last step.
"""

TRAIN_EPILOG = """recipes (flags that turn techniques on; they compose):
  --forge                      FORGE: the optimizer step inside backward, no weight gradients
  --agoq                       AGoQ: ~4-bit saved activations
  --baseline                   plain PyTorch AdamW, nothing else
  --forge.state-dtype int8 --train.weights bf16    bf16 weights + 8-bit optimizer states
  --comm.method int8           8-bit gradient all-reduce (DDP) / reduce-scatter (FSDP), under torchrun
  --dist.mode sharded [--comm.method sdp4bit|scape]   sharded optimizer, compressed traffic
  --dist.mode fsdp [--comm.method sdp4bit|int8]   FSDP2; 4-bit / 8-bit gradient reduce-scatter
  --comm.method gift           FP8 all-reduce in K-FAC-whitened coordinates
config fields: every field is --section.field value; `leantrain config` prints them all with docs.
"""


def _available(recipe: str) -> bool:
    for key, mod in _RECIPE_NEEDS.items():
        if key in recipe and importlib.util.find_spec(mod) is None:
            return False
    return True


def default_recipes() -> list[str]:
    return [r for r in ("baseline", "reference", "forge", "forge-bf16", "agoq", "agoq+forge") if _available(r)]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help=f"one of {sorted(config_mod.PRESETS)}")
    p.add_argument("--config", help="TOML file of config overrides")
    p.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    p.add_argument("--data", help="text file or directory, records (.jsonl, .json, .parquet, a datasets "
                   "directory) of text / instruct / chat, or .bin tokens (default: the embedded corpus)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")


def _build_config(args, rest: list[str]) -> config_mod.Config:
    flags = []
    for a in rest:  # --forge / --agoq shorthands
        if a in ("--forge", "--agoq"):
            flags += [f"{a}.enabled", "true"]
        else:
            flags.append(a)
    overrides = config_mod.parse_overrides(flags)
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.data is not None:
        overrides["data.path"] = args.data
    if getattr(args, "init_from", None) is not None:
        overrides["train.init_from"] = args.init_from
    if overrides.get("train.init_from") or overrides.get("train.init-from"):  # (the model comes from it)
        from leantrain.train.init_from import build_config

        return build_config(args.preset, args.config, overrides)
    return config_mod.build(args.preset, args.config, overrides)


def cmd_train(args, rest) -> int:
    from leantrain.train.trainer import Trainer

    cfg = _build_config(args, rest)
    trainer = Trainer(cfg, args.out, baseline=args.baseline, resume=args.resume, overwrite=args.overwrite)
    summary = trainer.fit()
    # every rank samples (the same tokens): a forward of a sharded model (dist.mode fsdp) is collective
    sample = trainer.sample(tokens=cfg.train.sample_tokens) if cfg.train.sample_tokens > 0 else None
    if trainer.rank == 0:
        val = ""
        if summary["val_loss"] is not None:
            start = summary["initial_val_loss"]
            val = f"val loss {start:.4f} -> " if start is not None else "val loss "
            val += f"{summary['val_loss']:.4f}, "
        print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, {val}"
              f"{summary['tokens_per_second']:.0f} tokens/s; results in {args.out}")
        if sample is not None:
            print("sample:\n" + sample)
    return 0


def cmd_compare(args, rest) -> int:
    from leantrain.train.report import write_report
    from leantrain.train.trainer import Trainer

    recipes = args.recipes.split(",") if args.recipes else default_recipes()
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ConfigError(f"unknown recipe(s) {unknown}; choose from {sorted(RECIPES)}")
    if "baseline" not in recipes:
        recipes = ["baseline", *recipes]
    out = Path(args.out)
    results = {}
    for name in recipes:
        if not _available(name):
            print(f"[compare] skipping {name}: its technique is not installed")
            continue
        cfg = _build_config(args, rest)
        for k, v in RECIPES[name].items():
            config_mod.set_field(cfg, k, v)
        cfg.train.sample_tokens = 0
        print(f"[compare] {name}")
        tr = Trainer(cfg, out / name, baseline=name == "baseline", overwrite=args.overwrite)
        results[name] = tr.fit()
    path = write_report(out, results)
    print(f"report: {path}")
    return 0


def cmd_config(args, rest) -> int:
    """Print the resolved config tree (preset, TOML file, overrides), each field with its doc."""
    cfg = _build_config(args, rest)
    docs = config_mod.field_docs()

    def walk(obj, where: str) -> None:
        import dataclasses

        leaves = [f for f in dataclasses.fields(obj) if not dataclasses.is_dataclass(getattr(obj, f.name))]
        print(f"[{where}]")
        for f in leaves:
            doc = docs.get(f"{where}.{f.name}", "")
            print(f"  {f.name} = {getattr(obj, f.name)!r}" + (f"    # {doc}" if doc else ""))
        for f in dataclasses.fields(obj):
            if dataclasses.is_dataclass(getattr(obj, f.name)):
                walk(getattr(obj, f.name), f"{where}.{f.name}")

    import dataclasses

    print(f"# preset {cfg.preset}; set any field with --section.field value (dashes or underscores)")
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(getattr(cfg, f.name)):
            walk(getattr(cfg, f.name), f.name)
    return 0


def cmd_export(args, rest) -> int:
    """A run directory (its newest checkpoint) or one checkpoint directory as a Hugging Face model."""
    from leantrain.model.hf import save_hf_state
    from leantrain.runtime import checkpoint
    from leantrain.train.init_from import run_tokenizer

    src = Path(args.source)
    ckpt = checkpoint.resolve(src)
    if ckpt is None:
        raise ConfigError(f"{src}: neither a checkpoint directory nor a run directory with checkpoints")
    state, meta = checkpoint.load_model_state(ckpt)
    if "config" not in meta:
        raise ConfigError(f"checkpoint {ckpt} has no config in its meta.json")
    tok = run_tokenizer(ckpt, src)
    out = save_hf_state(config_mod.from_dict(meta["config"]).model, state, args.out, tokenizer=tok,
                        overwrite=args.overwrite)
    print(f"exported {ckpt} to {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_eval(args, rest) -> int:
    from leantrain.train.evaluate import evaluate

    result = evaluate(args.source, args.data, out=args.out, seq_len=args.seq_len, batch_size=args.batch_size,
                      device=args.device)
    print(json.dumps(result, indent=1))
    return 0


def cmd_generate(args, rest) -> int:
    from leantrain.train.evaluate import generate

    print(generate(args.source, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, device=args.device, chat=args.chat, system=args.system))
    return 0


# optim.lr of each method when none is given (tuned on the tiny preset and the generated tasks)
FINETUNE_LR = {"full": 1e-4, "forge": 1e-4, "chunkft": 1e-4, "mezo": 3e-4, "grzo": 1e-5}
# MeZO's default lr is this over the model's parameter count: a step along one random direction
# has a variance that grows with the dimension, so ZO-SGD's step shrinks as 1/d. 3e-4 at the tiny
# preset's 3.1M parameters; about 1e-7 at 13B, the lr MeZO's paper uses for OPT-13B.
MEZO_LR_TIMES_PARAMS = 944.0


def finetune_config(args, rest: list[str]) -> config_mod.Config:
    """The config of ``leantrain finetune``: the method as config fields, then the fine-tuning
    defaults (``FINETUNE_EPILOG``) for every field the command line leaves unset."""
    method = args.method or "full"
    if method not in FINETUNE_LR:
        raise ConfigError(f"--method must be one of {', '.join(FINETUNE_LR)}, got {method!r}")
    if (args.data is None) == (args.task is None):
        raise ConfigError("finetune needs --data FILE (your examples) or --task compare|lookup|parity (a generated "
                          "smoke test), one of the two")
    flags = {k.replace("-", "_"): v for k, v in
             config_mod.parse_overrides([a for a in rest if a not in ("--forge", "--agoq")]).items()}
    given = set(flags)
    extra = ["--forge.enabled", "true"] if method == "forge" else ["--finetune.method", method]
    if args.task is not None:
        extra += ["--finetune.task", args.task]
    if args.eval_data is not None:
        extra += ["--data.eval-path", args.eval_data]
    steps = args.steps if args.steps is not None else int(flags.get("train.steps", 300))
    defaults = {"optim.lr": FINETUNE_LR[method], "optim.weight_decay": 0.0, "train.eval_every": steps,
                "train.ckpt_every": steps, "train.sample_tokens": 0}
    if args.task is not None:  # (the tasks' prompts are short; the figures they were tuned with)
        defaults.update({"data.seq_len": 64, "optim.schedule": "constant", "optim.warmup_steps": 0, "train.seed": 0})
    else:
        defaults["optim.warmup_steps"] = min(30, steps // 10)
    extra += [x for k, v in defaults.items() if k not in given for x in (f"--{k}", str(v))]
    args.steps = steps
    cfg = _build_config(args, rest + extra)
    if method == "mezo" and "optim.lr" not in given:
        from leantrain.train.budget import parameter_count

        cfg.optim.lr = MEZO_LR_TIMES_PARAMS / parameter_count(cfg)
    return cfg


def cmd_finetune(args, rest) -> int:
    from leantrain.train.trainer import Trainer

    cfg = finetune_config(args, rest)
    trainer = Trainer(cfg, args.out, resume=args.resume, overwrite=args.overwrite)
    s = trainer.fit()
    if trainer.rank == 0:
        val = ""
        for key in ("loss", "accuracy"):
            before, after = s.get(f"initial_val_{key}"), s.get(f"val_{key}")
            if after is not None:
                val += f"val {key} {before:.4f} -> {after:.4f}, " if before is not None else f"val {key} {after:.4f}, "
        print(f"done: {s['recipe']}, {s['steps']} steps, final loss {s['final_loss']:.4f}, {val}"
              f"{s['tokens_per_second']:.0f} tokens/s; results in {args.out} (leantrain export {args.out} HF_DIR)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``leantrain`` command line: one sub-command a verb (config fields are parsed apart)."""
    parser = argparse.ArgumentParser(prog="leantrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=TRAIN_EPILOG)
    _common(p)
    p.add_argument("--baseline", action="store_true", help="plain PyTorch AdamW, no technique")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--from", dest="init_from", help="start from this model: a Hugging Face model directory or a "
                   "leantrain run / checkpoint directory (train.init_from)")
    p = sub.add_parser("compare", help="baseline and every technique side by side")
    _common(p)
    p.add_argument("--recipes", help=f"comma-separated, from {sorted(RECIPES)}")
    p = sub.add_parser("finetune", help="fine-tune a model on your data: full, forge, chunkft, mezo or grzo",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=FINETUNE_EPILOG)
    _common(p)
    p.add_argument("--from", dest="init_from", help="the model: a Hugging Face model directory or a leantrain run / "
                   "checkpoint directory (default: random weights of --preset)")
    p.add_argument("--method", help=f"{' | '.join(FINETUNE_LR)} (default full)")
    p.add_argument("--task", help="compare | lookup | parity: a generated task in place of --data")
    p.add_argument("--eval-data", help="held-out file scored every train.eval_every steps (data.eval_path)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p = sub.add_parser("export", help="write a run or checkpoint as a Hugging Face model directory")
    p.add_argument("source", help="run directory (its newest checkpoint) or checkpoint directory")
    p.add_argument("out", help="the Hugging Face model directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p = sub.add_parser("eval", help="loss and perplexity, or multiple-choice accuracy, of a run or HF model")
    p.add_argument("--from", dest="source", required=True, help="a run, checkpoint or Hugging Face model directory")
    p.add_argument("--data", required=True, help="text, .jsonl of text / instruct / chat / {prompt, choices, answer}")
    p.add_argument("--out", default=".", help="directory for eval.json (default: the current directory)")
    p.add_argument("--seq-len", type=int, help="tokens a window (default: the model's max_seq_len, at most 2048)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p = sub.add_parser("generate", help="continue a prompt with a run or HF model (KV cache)")
    p.add_argument("--from", dest="source", required=True, help="a run, checkpoint or Hugging Face model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message, rendered by the tokenizer's chat template with the "
                        "assistant's turn opened (a model fine-tuned on chat records)")
    p.add_argument("--system", help="with --chat: a system message before it")
    p = sub.add_parser("config", help="print the resolved config tree with each field's doc")
    p.add_argument("--preset", default="tiny", help=f"one of {sorted(config_mod.PRESETS)}")
    p.add_argument("--config", help="TOML file of config overrides")
    p.set_defaults(steps=None, data=None)
    return parser


COMMANDS = {"train": cmd_train, "compare": cmd_compare, "finetune": cmd_finetune, "export": cmd_export,
            "eval": cmd_eval, "generate": cmd_generate, "config": cmd_config}


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    together = False  # every rank ended the same way (runtime.distributed.close)
    try:
        if args.command in ("eval", "generate", "export") and rest:
            raise ConfigError(f"unexpected arguments {' '.join(rest)}; see leantrain {args.command} --help")
        together = COMMANDS[args.command](args, rest) == 0
        return 0 if together else 1
    except (ConfigError, CheckpointError) as e:
        print(f"leantrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leantrain: interrupted (a second Ctrl-C): nothing written since the last checkpoint", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        from leantrain.train.trainer import Interrupted, NonFiniteLoss

        if isinstance(e, NonFiniteLoss):
            print(f"leantrain: error: {e}", file=sys.stderr)
            return 3
        if isinstance(e, Interrupted):
            from leantrain.runtime import collectives

            if collectives.rank() == 0:  # (every rank stops; one says so)
                print(f"leantrain: {e}", file=sys.stderr)
            together = True
            return 130
        raise
    finally:
        if "torch" in sys.modules:  # (a command that never imported torch made no process group)
            from leantrain.runtime import distributed

            distributed.close(together)


if __name__ == "__main__":
    sys.exit(main())
