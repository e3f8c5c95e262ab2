import pytest

from leantrain import config as C
from leantrain.config import ConfigError


def test_presets_build_and_have_the_documented_shapes():
    for name in C.PRESETS:
        cfg = C.build(name)
        assert cfg.preset == name
    b = C.preset("1b").model
    assert (b.dim, b.n_layers, b.n_heads, b.n_kv_heads, b.ffn_dim) == (2048, 22, 32, 4, 5632)


def test_overrides_are_typed():
    cfg = C.build("tiny", overrides={"model.dim": "96", "optim.betas": "0.8,0.9", "forge.enabled": "true",
                                     "forge.state-dtype": "int8", "data.path": "none", "forge.fast-math": "true"})
    assert cfg.model.dim == 96 and cfg.optim.betas == (0.8, 0.9) and cfg.forge.enabled is True
    assert cfg.forge.state_dtype == "int8" and cfg.data.path is None and cfg.forge.fast_math is True


@pytest.mark.parametrize("key,value,match", [
    ("model.dimm", "3", r"valid keys of \[model\].*'dim'"),
    ("modle.dim", "3", "valid sections"),
    ("optim.name", "adam", r"choose one of \['adamw'"),
    ("train.steps", "ten", "expected an integer"),
    ("forge.enabled", "maybe", "true or false"),
    ("optim.betas", "0.9", "2 comma-separated"),
    ("model.loss-chunk", "-1", "loss_chunk must be >= 0"),
    ("agoq.derive", "silu,gelu", "agoq.derive must be a comma list"),
    ("agoq.unpack-mib", "-1", "unpack_mib must be >= 0"),
])
def test_bad_keys_and_values_name_the_valid_choices(key, value, match):
    from leantrain.train import techniques

    with pytest.raises(ConfigError, match=match):  # (a technique's own fields: checked with the run's techniques)
        techniques.validate(C.build("tiny", overrides={key: value, "agoq.enabled": "true"}))


def test_toml_then_cli(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\ndim = 96\n[optim]\nlr = 0.01\nbetas = [0.8, 0.9]\n')
    cfg = C.build("tiny", str(f), {"optim.lr": "0.02"})
    assert cfg.model.dim == 96 and cfg.optim.lr == 0.02 and cfg.optim.betas == (0.8, 0.9)
    (tmp_path / "bad.toml").write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="width"):
        C.build("tiny", str(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="does not exist"):
        C.build("tiny", str(tmp_path / "missing.toml"))


def test_unknown_preset_and_inconsistent_values():
    with pytest.raises(ConfigError, match="unknown preset"):
        C.build("huge")
    with pytest.raises(ConfigError, match="max_seq_len"):
        C.build("tiny", overrides={"data.seq_len": "100000"})


def test_roundtrip_through_dict():
    cfg = C.build("small", overrides={"optim.lr": "0.5"})
    again = C.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def test_parse_overrides():
    assert C.parse_overrides(["--a.b", "1", "--c.d=2"]) == {"a.b": "1", "c.d": "2"}
    with pytest.raises(ConfigError, match="needs a value"):
        C.parse_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        C.parse_overrides(["--verbose"])


def test_every_advertised_submodule_imports():
    """``dir(leantrain)`` lists only submodules that exist (they are imported on first access)."""
    import leantrain

    for name in leantrain._SUBMODULES:
        assert getattr(leantrain, name).__name__ == f"leantrain.{leantrain._ALIASES.get(name, name)}"


def test_recipe_names_of_the_gift_all_reduces():
    from leantrain.train.trainer import recipe_name

    names = {}
    for fmt in ("e4m3", "nvfp4"):
        for whiten in ("true", "false"):
            cfg = C.build("tiny", overrides={"comm.method": "gift", "comm.gift.format": fmt, "comm.gift.whiten": whiten})
            names[fmt, whiten] = recipe_name(cfg, baseline=False)
    assert names == {("e4m3", "true"): "ddp-gift", ("e4m3", "false"): "ddp-fp8",
                     ("nvfp4", "true"): "ddp-gift-nvfp4", ("nvfp4", "false"): "ddp-nvfp4"}
    with pytest.raises(ConfigError):
        C.build("tiny", overrides={"comm.gift.format": "fp4"})


def test_gift_transform_dtype_and_min_gain_fields():
    import torch

    from leantrain.comm.technique import Gift

    cfg = C.build("tiny", overrides={"comm.method": "gift", "dist.mode": "ddp", "comm.gift.transform_dtype": "bfloat16",
                                     "comm.gift.min_gain": "1.5"})
    assert cfg.comm.gift.transform_dtype == "bfloat16" and cfg.comm.gift.min_gain == 1.5
    Gift.check(cfg, device=torch.device("cpu"), world=2)
    with pytest.raises(ConfigError):
        C.build("tiny", overrides={"comm.gift.transform_dtype": "float16"})
    cfg.comm.gift.min_gain = -1.0
    with pytest.raises(ConfigError):
        Gift.check(cfg, device=torch.device("cpu"), world=2)


def test_techniques_check_and_build_in_the_builtin_order_whatever_was_imported_first():
    """A technique module imported first (a test, a user's script) registers first; the checks and the
    build still run in ``BUILTIN``'s order, so a run's first refusal does not depend on import order."""
    import subprocess
    import sys

    code = ("import leantrain.comm.technique\n"  # (registers GIFT before FSDP)
            "from leantrain import config\nfrom leantrain.train import techniques as T\n"
            "cfg = config.build('tiny', overrides={'dist.mode': 'fsdp', 'comm.method': 'gift'})\n"
            "print(' '.join(c.__module__ for c in T.wanted(cfg)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    from leantrain.train.techniques import BUILTIN

    assert out == sorted(out, key=BUILTIN.index) and out.index("leantrain.parallel.fsdp") < out.index(
        "leantrain.comm.technique"), out
