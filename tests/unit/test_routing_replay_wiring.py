"""--use-rollout-routing-replay's wiring up to the sample: the flag's rules, the launch option both
engine servers get, the producer keeping each sample's MoE-layer routes (the trainer's side:
test_routing_replay_trainer.py).

Pins: the flag is refused by name for a dense model and with full recomputation; the engines
are launched with --enable-return-routed-experts only when the flag is set; `fill_sample` keeps the
MoE layers of SGLang's [positions, all layers, k] layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.config.rules import moe_flag_problems
from miles_core.engines.launcher import EngineLaunchSpec, server_command
from miles_core.models.families import spec_of
from miles_core.rollout.producer import RouteLayout, fill_sample
from miles_core.samples import Sample


def _llama():
    from transformers import LlamaConfig

    return spec_of(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2).to_dict())


def test_the_flag_is_refused_by_name_where_it_cannot_work():
    train = parse_flags(["--preset", "tiny-reverse4", "--use-rollout-routing-replay"]).train
    assert train.use_rollout_routing_replay
    assert any("--use-rollout-routing-replay" in p and "dense" in p for p in moe_flag_problems(_llama(), train))
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay with --recompute-granularity=full is not "
                                          "supported"):
        parse_flags(["--preset", "tiny-reverse4", "--use-rollout-routing-replay", "--recompute-granularity", "full", "--recompute-method",
                     "uniform", "--recompute-num-layers", "1"])
    parse_flags(["--preset", "tiny-reverse4", "--use-rollout-routing-replay", "--recompute-granularity", "selective"])  # core attention only


def test_both_engine_servers_are_launched_capturing_routes_only_with_the_flag():
    for backend in ("cpu", "sglang"):
        on = EngineLaunchSpec(backend=backend, model_path="/m", return_routed_experts=True)
        assert "--enable-return-routed-experts" in server_command(on, "/m", 0, 1234)
        off = EngineLaunchSpec(backend=backend, model_path="/m")
        assert "--enable-return-routed-experts" not in server_command(off, "/m", 0, 1234)
    engine = parse_flags(["--preset", "tiny-reverse4"]).engine
    assert EngineLaunchSpec.from_config(engine, "/m", routed_experts=True).return_routed_experts


def test_fill_sample_keeps_the_moe_layers_of_sglangs_layout():
    """SGLang answers [positions, num_hidden_layers, k] (dense layers zeros); a sample keeps the MoE layers."""
    layout = RouteLayout(num_layers=3, moe_layers=(1, 2), topk=2)
    ids = [0, 0, 1, 2, 3, 4, 0, 0, 5, 6, 7, 0]  # 2 positions x 3 layers x 2
    out = SimpleNamespace(output_ids=[7], output_logprobs=[-0.1], token_versions=[0], finish_reason="stop",
                          seconds=0.1, routed_experts=ids)
    s = Sample("g", 0, 0, [1, 2])
    fill_sample(s, out, 0.1, layout)
    assert s.routed_experts == [1, 2, 3, 4, 5, 6, 7, 0]
    plain = Sample("g", 0, 0, [1, 2])
    fill_sample(plain, out, 0.1)  # replay off: nothing kept
    assert plain.routed_experts == []


def test_the_producer_asks_the_engine_for_routes_only_with_a_layout():
    from miles_core.rollout.producer import _routes_kwargs

    assert _routes_kwargs(RouteLayout(2, (0, 1), 2)) == {"return_routed_experts": True}
    assert _routes_kwargs(None) == {}
