"""``launch.accelerate_config``: only data-parallel accelerate configs are accepted (issue #31, item 5). FSDP and
DeepSpeed shard the parameters that LoRA merges, state dicts and evaluations need whole, so they are refused when
the config is read, naming the file, the key and what is supported."""

import json

import pytest
import yaml

from foresight.config import ConfigError, parse_config


def _launch(path) -> dict:
    return {"launch": {"num_processes": 2, "accelerate_config": str(path)}}


@pytest.mark.parametrize("distributed_type", ["NO", "MULTI_GPU", "MULTI_CPU"])
def test_data_parallel_configs_are_accepted(tmp_path, distributed_type):
    """DDP configs, as ``accelerate config`` writes them (empty sharding sections included), in YAML and JSON."""
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed_type, "num_machines": 2,
              "machine_rank": 0, "main_process_ip": "10.0.0.1", "main_process_port": 29500, "fsdp_config": {},
              "deepspeed_config": {}, "megatron_lm_config": {}}
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "ddp.json").write_text(json.dumps(config))
    for name in ("ddp.yaml", "ddp.json"):
        cfg = parse_config(_launch(tmp_path / name))
        assert cfg.path(cfg.launch.accelerate_config) == tmp_path / name


def test_a_relative_config_resolves_against_the_params_folder(tmp_path):
    (tmp_path / "multi_gpu.yaml").write_text("distributed_type: MULTI_GPU\n")
    parse_config(_launch("multi_gpu.yaml"), root=tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(_launch("multi_gpu.yaml"), root=tmp_path / "elsewhere")


@pytest.mark.parametrize("config, problem", [
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}}, "distributed_type 'FSDP'"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}, "distributed_type 'DEEPSPEED'"),
    ({"distributed_type": "MULTI_GPU", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}}, "fsdp_config"),
    ({"distributed_type": "MULTI_GPU", "deepspeed_config": {"zero_stage": 3}}, "deepspeed_config"),
    ({"distributed_type": "MEGATRON_LM"}, "distributed_type 'MEGATRON_LM'"),
    ({"compute_environment": "LOCAL_MACHINE"}, "distributed_type None"),
])
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_sharding_configs_are_refused(tmp_path, config, problem, suffix):
    """FSDP / DeepSpeed (by distributed_type, or by a non-empty sharding section) → a ConfigError naming the file,
    the key and the supported set."""
    path = tmp_path / f"accelerate{suffix}"
    path.write_text(json.dumps(config) if suffix == ".json" else yaml.safe_dump(config))
    with pytest.raises(ConfigError) as err:
        parse_config(_launch(path))
    message = str(err.value)
    assert problem in message and str(path) in message and "launch.accelerate_config" in message
    assert "MULTI_GPU" in message and "launch.num_processes" in message


def test_a_missing_or_malformed_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"launch.accelerate_config: accelerate config file .*missing.yaml does not "
                                          "exist"):
        parse_config(_launch(tmp_path / "missing.yaml"))
    (tmp_path / "broken.json").write_text("{distributed_type: MULTI_GPU")
    with pytest.raises(ConfigError, match="broken.json is not a valid accelerate config file"):
        parse_config(_launch(tmp_path / "broken.json"))
    (tmp_path / "list.yaml").write_text("- MULTI_GPU\n")
    with pytest.raises(ConfigError, match="list.yaml is not a valid accelerate config file"):
        parse_config(_launch(tmp_path / "list.yaml"))
