"""Typed run configuration: YAML file, then dotted command-line overrides, then validation.

One direction, no circle: `schema` (the sections, each field with its default and comment, and
`ConfigError`) <- `checks` (cross-field `validate`) <- `load` (`load_config`: YAML, overrides, convert,
validate). This package re-exports what users import, so `from offpolicy.config import load_config`
is the one entry. Only msgspec and yaml are imported, so entry points parse their config before heavy
imports.

May import: nothing of offpolicy (docs/architecture.md, "Dependency rule").
"""

from offpolicy.config.load import apply_override, load_config
from offpolicy.config.schema import (
    AlgoConfig,
    ChaosConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    LearnerConfig,
    MegatronConfig,
    MetricsConfig,
    MlflowConfig,
    ModelConfig,
    ReasoningGymConfig,
    RelayConfig,
    RolloutConfig,
    RunConfig,
    SGLangConfig,
    SuperviseConfig,
    SyntheticConfig,
    TensorBoardConfig,
    TransportConfig,
    VLLMConfig,
    WandbConfig,
    WeightsConfig,
    learner_host,
    sample_message_limit,
    to_yaml,
)

__all__ = [
    "AlgoConfig", "ChaosConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "LearnerConfig",
    "MegatronConfig", "MetricsConfig", "MlflowConfig", "ModelConfig", "ReasoningGymConfig", "RelayConfig",
    "RolloutConfig", "RunConfig", "SGLangConfig", "SuperviseConfig", "SyntheticConfig", "TensorBoardConfig", "TransportConfig",
    "VLLMConfig", "WandbConfig", "WeightsConfig", "apply_override", "learner_host", "load_config",
    "sample_message_limit", "to_yaml",
]
