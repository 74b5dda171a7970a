"""The MoE families on CUDA in bf16 (run on a GPU machine: `tests/gpu/check.sh`; deselected in CI).

What the CPU tests (fp32, tests/unit/test_families_trainer.py) cannot reach: Megatron's MoE layer,
router and allgather token dispatcher on a CUDA device with bf16 weights, the expert bias kept in
fp32 beside them, and a Trainer step through Megatron's mixed-precision optimizer. Pins, per MoE
family (a tiny random Qwen3-MoE and GLM-4.5-style model, transformers' own classes, no download):
the trainer's per-token log-probs agree with transformers' bf16 forward on the same GPU within
bf16's tolerance; one training step on the builtin tiny MoE model changes its weights and keeps
them finite.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = ("qwen3_moe", "glm4_moe")


def _hf_model(case: str):
    from transformers import AutoModelForCausalLM, Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=2,
                  max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    cfg = (Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=True) if case == "qwen3_moe" else
           Glm4MoeConfig(**common, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5))
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("case", CASES)
def test_moe_bf16_logprobs_agree_with_transformers(case, tmp_path):
    from miles_core.train import hf_convert, hf_shards
    from miles_core.train.megatron_model import ModelSpec, build_model, masked_token_logprobs

    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    spec = ModelSpec.from_hf_config(hf_convert.read_hf_config(str(tmp_path)))
    model = build_model(spec, bf16=True)
    hf_shards.load_hf_checkpoint([model], spec, str(tmp_path))
    tokens = torch.randint(0, 64, (4, 48), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        ours, _ = masked_token_logprobs(model.eval(), tokens, torch.ones(4, 47, device="cuda"))
        ref = hf.to("cuda", torch.bfloat16)(input_ids=tokens).logits.float().log_softmax(-1)
    ref = ref[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    gap = float((ours - ref).abs().mean())
    print(f"{case}: bf16 mean |logp gap| vs transformers {gap:.3e}")
    assert gap < 0.05


def test_tiny_moe_trains_a_step_in_bf16(tmp_path):
    from miles_core.config import parse_flags
    from miles_core.models.builtin import materialize_checkpoint
    from miles_core.train.trainer import Trainer
    from tests.unit.test_train import make_groups

    ckpt = materialize_checkpoint("builtin:tiny-qwen3-moe", 0, str(tmp_path / "hf"))
    cfg = parse_flags(["--preset", "tiny-reverse4", "--run-id", "gpu", "--storage-root", f"file://{tmp_path}", "--engine-backend", "sglang",
                       "--hf-checkpoint", "builtin:tiny-qwen3-moe", "--lr", "1e-3", "--save", "",
                       "--save-interval", "none", "--eval-interval", "none", "--eval-prompt-data"])
    with Trainer(cfg.train, ckpt) as tr:
        before = {k: v.float().clone() for k, v in tr.hf_state_dict().items()}
        metrics = tr.train_step(0, make_groups(2, 4))
        after = tr.hf_state_dict()
    changed = sum(int(not torch.equal(before[k], after[k].float())) for k in before)
    assert changed > len(before) // 2 and all(torch.isfinite(v.float()).all() for v in after.values())
    assert "train/moe_aux_loss" in metrics
