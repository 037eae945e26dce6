"""Megatron-Bridge 0.6.2's run configuration, reduced to the fields its training code reads (test support).

Bridge's own ``ConfigContainer`` (``megatron/bridge/training/config.py``) cannot be imported here: it pulls
every model provider and dataset builder (transformers, datasets...). Its sections are Megatron's own
dataclasses (``megatron/training/config/training_config.py``, shipped in megatron-core's wheel) with a few
fields added by Bridge; this module builds them from the same two sources:

* ``LoggerConfig``, ``TrainingConfig``, ``ValidationConfig``: Megatron's real dataclasses, loaded from
  megatron-core's ``training_config.py`` by file (``megatron.training``'s ``__init__`` needs Python 3.12),
  subclassed with exactly the fields Bridge 0.6.2 adds (``mlflow_*``, ``comet_*``, ``skip_train_metrics_log``;
  ``check_optimizer_step_success``, ``skip_sync_grad_norm_across_mp``), with Bridge's defaults;
* the other sections Bridge's ``gpt_step``, ``train_step``, ``training_log``, ``evaluate`` and ``GlobalState``
  read (model, dataset, optimizer, ddp, dist, checkpoint, rerun state machine): namespaces holding only those
  fields, at Bridge's defaults for a pretraining run without distillation, checkpoints or CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import megatron.core


def _megatron_training_config() -> types.ModuleType:
    """megatron-core's ``megatron/training/config/training_config.py`` (standard library imports only)."""
    path = Path(megatron.core.__file__).parents[1] / "training" / "config" / "training_config.py"
    spec = importlib.util.spec_from_file_location("megatron_training_config_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_MEGATRON = _megatron_training_config()


@dataclass(kw_only=True)
class LoggerConfig(_MEGATRON.LoggerConfig):
    """Bridge's ``LoggerConfig``: Megatron's, plus the fields Bridge 0.6.2 adds (its defaults)."""

    skip_train_metrics_log: bool = False
    mlflow_experiment: Optional[str] = None
    mlflow_run_name: Optional[str] = None
    mlflow_tracking_uri: Optional[str] = None
    mlflow_tags: Optional[dict[str, str]] = None
    mlflow_description: Optional[str] = None
    mlflow_log_artifacts: bool = True
    comet_project: Optional[str] = None
    comet_experiment_name: Optional[str] = None
    comet_workspace: Optional[str] = None
    comet_api_key: Optional[str] = None
    comet_tags: Optional[list[str]] = None


@dataclass(kw_only=True)
class TrainingConfig(_MEGATRON.TrainingConfig):
    """Bridge's ``TrainingConfig``: Megatron's, plus the fields Bridge 0.6.2 adds (its defaults)."""

    check_optimizer_step_success: bool = True
    skip_sync_grad_norm_across_mp: bool = False


ValidationConfig = _MEGATRON.ValidationConfig


@dataclass
class ModelSettings:
    """The model fields Bridge's step, loop and logging read (the rest of its ``GPTModelProvider`` is the
    model the tests build themselves)."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_layout: Any = None
    seq_length: int = 0
    num_moe_experts: Optional[int] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_z_loss_coeff: Optional[float] = None
    num_layers: Optional[int] = None
    moe_expert_rank_capacity_factor: Optional[float] = None
    cuda_graph_impl: str = "none"


@dataclass
class ConfigContainer:
    """Bridge's run configuration: the sections above, and namespaces for the fields read elsewhere."""

    model: ModelSettings = field(default_factory=ModelSettings)
    micro_batch_size: int = 1
    data_parallel_size: int = 1
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    validation: Any = None
    checkpoint_save: Optional[str] = None
    train_iters: int = 1

    def __post_init__(self) -> None:
        ns = types.SimpleNamespace
        self.train = TrainingConfig(micro_batch_size=self.micro_batch_size, train_iters=self.train_iters)
        self.validation = self.validation or ValidationConfig(eval_iters=1)
        self.dataset = ns(skip_getting_attention_mask_from_dataset=True, dataloader_type="single",
                          enable_offline_packing=False, enable_in_batch_packing=False,
                          seq_length=self.model.seq_length)
        self.rerun_state_machine = ns(check_for_nan_in_loss=True, check_for_spiky_loss=False)
        self.optimizer = ns(barrier_with_L1_time=False, log_num_zeros_in_grad=False, decoupled_lr=None,
                            reuse_grad_buf_for_mxfp8_param_ag=False)
        self.ddp = ns(overlap_param_gather=False)
        self.dist = ns(use_decentralized_pg=True)  # no ModelOpt distillation shapes
        self.checkpoint = ns(save=self.checkpoint_save, async_save=False)
        self.profiling = None
        self.nvrx_straggler = None

    def to_dict(self) -> dict:
        """What Bridge's loggers record as the run's configuration (W&B config, MLflow params)."""
        return {"logger": dataclasses.asdict(self.logger), "micro_batch_size": self.micro_batch_size,
                "data_parallel_size": self.data_parallel_size, "seq_length": self.model.seq_length}
