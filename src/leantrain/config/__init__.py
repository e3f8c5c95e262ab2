"""One tree of typed dataclasses: the whole configuration of a leantrain run.

``Config`` has one section per concern (``model``, ``data``, ``optim``, ``train``, ``forge``,
``agoq``, ``dist``, ``comm`` with ``comm.scape`` and ``comm.gift``, ``finetune``;
:mod:`leantrain.config.tree`). Presets are functions returning a full ``Config``
(:mod:`leantrain.config.presets`); a TOML file or ``--section.field value`` arguments override
fields of a preset (:mod:`leantrain.config.fields`). Unknown keys and ill-typed values are
rejected with a message that lists the valid choices.
"""

from leantrain.config.fields import (
    RENAMED,
    apply_dict,
    build,
    field_docs,
    from_dict,
    load_toml,
    parse_overrides,
    set_field,
    validate,
)
from leantrain.config.presets import PRESETS, b1, b7, b8, m125, preset, small, tiny
from leantrain.config.tree import (
    LOGGERS,
    AgoqConfig,
    CommConfig,
    Config,
    ConfigError,
    DataConfig,
    DistConfig,
    FinetuneConfig,
    ForgeConfig,
    GiftConfig,
    ModelConfig,
    OptimConfig,
    ScapeConfig,
    Sdp4bitConfig,
    TrainConfig,
    logger_names,
)

__all__ = [
    "AgoqConfig", "CommConfig", "Config", "ConfigError", "DataConfig", "DistConfig", "FinetuneConfig", "ForgeConfig",
    "GiftConfig", "LOGGERS", "ModelConfig", "OptimConfig", "PRESETS", "RENAMED", "ScapeConfig", "Sdp4bitConfig",
    "TrainConfig", "apply_dict", "b1", "b7", "b8", "build", "field_docs", "from_dict", "load_toml", "logger_names",
    "m125", "parse_overrides", "preset", "set_field", "small", "tiny", "validate",
]
