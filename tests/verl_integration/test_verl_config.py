"""The recipe's config (examples/verl/grpo_prefixflow.yaml) in verl's own config system: Hydra composes it over
verl's ppo_trainer, verl's dataclasses take it, and verl's engine registry then builds PrefixFlow's engine for the
actor and verl's own for everything else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("verl", minversion="0.9")

import verl_cpu as vc  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    model = tmp_path_factory.mktemp("qwen2-tiny")
    vc.save_tiny_model(model, "qwen2")
    overrides = [f"actor_rollout_ref.model.path={model}", "data.train_files=x", "data.val_files=x"]
    with initialize_config_dir(config_dir=str(EXAMPLES), version_base=None):
        return compose(config_name="grpo_prefixflow", overrides=overrides)


def test_recipe_composes_over_verl_ppo_trainer(config):
    arr = config.actor_rollout_ref
    assert config.algorithm.adv_estimator == "grpo"
    assert arr.model.external_lib == "prefixflow.integrations.verl"
    assert arr.rollout.name == "vllm"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR == "prefixflow"
    assert config.trainer.n_gpus_per_node >= 1  # the rest is verl's ppo_trainer
    # verl's GRPO defaults stay on: remove-padding, dynamic batch size, torch.compile, the model's attention
    assert arr.model.use_remove_padding and arr.actor.use_dynamic_bsz and arr.actor.use_torch_compile
    assert "attn_implementation" not in arr.model.override_config
    assert arr.actor.strategy == arr.ref.strategy == "fsdp2"


def test_recipe_selects_prefixflow_engine_in_verl(config, monkeypatch):
    """What verl's worker does with the config: its dataclasses, the model's external_lib import, the engine
    registry under the recipe's environment, and the engine's construction (no option refused)."""
    from verl.trainer.config import CheckpointConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    arr = config.actor_rollout_ref
    model_config = omega_conf_to_dataclass(arr.model)  # imports prefixflow.integrations.verl (external_lib)
    actor = omega_conf_to_dataclass(arr.actor)
    actor.model_config = model_config
    engine_config = actor.engine
    engine_config.use_dynamic_bsz = arr.actor.use_dynamic_bsz  # as engine_workers assigns them
    engine_config.micro_batch_size_per_gpu = arr.actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.use_remove_padding

    from prefixflow.integrations.verl import PrefixFlowFSDPEngine, actor_loss_config

    assert actor_loss_config(actor)["clip_ratio_c"] == 3.0
    assert actor_loss_config(actor)["kl_estimator"] == "low_var_kl"
    for key, value in config.ray_kwargs.ray_init.runtime_env.env_vars.items():
        monkeypatch.setenv(key, str(value))
    assert EngineRegistry.get_engine_cls("language_model", engine_config.strategy) is PrefixFlowFSDPEngine
    assert EngineRegistry.get_engine_cls("value_model", engine_config.strategy).__name__ == (
        "FSDPEngineWithValueHead"
    )
    vc.init_one_rank()
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=actor.optim,
        checkpoint_config=CheckpointConfig(),
    )
    assert isinstance(engine, PrefixFlowFSDPEngine)
    assert (
        model_config.hf_config._attn_implementation == "sdpa"
    )  # flash_attention_2 replaced (no flash-attn here)
    monkeypatch.delenv("VERL_ENGINE_VENDOR")
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__ == "FSDPEngineWithLMHead"
    assert os.environ.get("VERL_ENGINE_VENDOR") is None
