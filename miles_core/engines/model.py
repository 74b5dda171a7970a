"""A compact torch forward for the causal LMs the CPU engine serves, with a slot-based KV cache.

Two layouts, read straight from an HF-format directory (config.json + safetensors):
- `gpt2`: learned absolute positions, LayerNorm, fused c_attn (Conv1D weights are [in, out]), gelu_new;
- `llama` (also `qwen2`, `mistral`): RoPE (default rope type), RMSNorm, GQA, SwiGLU; qwen2 has q/k/v bias.

The cache holds one row ("slot") per running request: `[layers, 2, slots, kv_heads, positions, head_dim]`.
The caller keeps running requests in slots 0..B-1 (it compacts when requests leave), so a decode step
reads a view of the cache and never gathers. Everything is float32: the engine's log-probs must match a
float32 teacher-forced forward pass of the trainer within 1e-4.

transformers is deliberately not imported: it costs seconds of start-up per engine process and a
restarted engine should be back quickly.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_core.models.safetensors_dir import MissingWeights, load_safetensors_dir


class ModelLoadError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "gpt2" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_config(cfg: dict, source: str) -> "ModelSpec":
        mtype = cfg.get("model_type", "")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if mtype == "gpt2":
            h, nh = cfg["n_embd"], cfg["n_head"]
            if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
                raise ModelLoadError(f"{source}: GPT-2 attention variants (scale_attn_by_inverse_layer_idx, "
                                     "reorder_and_upcast_attn) are not supported by the CPU engine.")
            return ModelSpec("gpt2", cfg["vocab_size"], h, cfg["n_layer"], nh, nh, h // nh, cfg["n_positions"],
                             cfg.get("layer_norm_epsilon", 1e-5), 0.0, cfg.get("tie_word_embeddings", True), eos_ids)
        if mtype in ("llama", "qwen2", "mistral"):
            for field in ("rope_parameters", "rope_scaling"):  # transformers 5 form, then the legacy one
                rope = cfg.get(field) or {}
                for key in ("rope_type", "type"):  # `type`: the legacy spelling of rope_type
                    if rope.get(key, "default") != "default":
                        raise ModelLoadError(f"{source}: {field}.{key}={rope[key]!r} is not supported by the CPU "
                                             "engine (only the default RoPE); serve this model with "
                                             "--engine-backend sglang.")
            theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
            h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
            return ModelSpec("llama", cfg["vocab_size"], h, cfg["num_hidden_layers"], nh,
                             cfg.get("num_key_value_heads") or nh, cfg.get("head_dim") or h // nh,
                             cfg.get("max_position_embeddings", 2048), cfg.get("rms_norm_eps", 1e-6), float(theta),
                             cfg.get("tie_word_embeddings", False), eos_ids)
        raise ModelLoadError(f"{source}: model_type={mtype!r} is not supported by the CPU engine; "
                             "supported: gpt2, llama, qwen2, mistral.")


def read_spec(model_dir: str) -> ModelSpec:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: no config.json; --model-path must be an HF-format model directory.") from e
    return ModelSpec.from_config(cfg, path)


def read_eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """EOS ids as SGLang gathers them: config.json's `eos_token_id` plus generation_config.json's (an
    int or a list in either), in that order, without repeats."""
    ids = list(read_spec(model_dir).eos_token_ids)
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (FileNotFoundError, json.JSONDecodeError):
        eos = None
    for t in eos if isinstance(eos, list) else [eos] if eos is not None else []:
        if int(t) not in ids:
            ids.append(int(t))
    return tuple(ids)


def read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load_safetensors_dir(model_dir)
    except MissingWeights as e:
        raise ModelLoadError(f"{e} (the CPU engine reads safetensors only).") from e
    return {k: v.float() for k, v in tensors.items()}


class CausalLM:
    """Weights of one model plus `prefill` and `decode` over a slot-based KV cache (no autograd)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], source: str = "?"):
        self.spec = spec
        _check_shapes(spec, tensors, source)
        try:
            self.layers, self.top = (_gpt2_weights if spec.family == "gpt2" else _llama_weights)(spec, tensors)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing tensor {e.args[0]!r} for a {spec.family} model.") from e
        if spec.family == "llama":
            inv = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
            freqs = torch.outer(torch.arange(spec.max_positions, dtype=torch.float32), inv)  # [positions, hd/2]
            self.cos, self.sin = freqs.cos(), freqs.sin()

    @staticmethod
    def load(model_dir: str) -> "CausalLM":
        spec = read_spec(model_dir)
        return CausalLM(spec, read_safetensors(model_dir), model_dir)

    def same_architecture(self, other: "CausalLM") -> bool:
        a, b = self.spec, other.spec
        return (a.family, a.vocab_size, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == \
               (b.family, b.vocab_size, b.hidden_size, b.num_layers, b.num_heads, b.num_kv_heads, b.head_dim)

    # ---- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, cache: torch.Tensor, first_slot: int, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Run right-padded `tokens` [N, T] from position 0, write their K/V into slots
        first_slot..first_slot+N-1, return the logits at each row's last real position [N, vocab]."""
        n, t = tokens.shape
        pos = torch.arange(t)
        x = self._embed(tokens, pos.expand(n, t))
        rows = slice(first_slot, first_slot + n)
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, pos.expand(n, t))  # [N, heads, T, hd]
            cache[li, 0, rows, :, :t] = k
            cache[li, 1, rows, :, :t] = v
            attn = _causal_attention(q, k, v, self.spec.num_heads // self.spec.num_kv_heads)
            x = self._finish_layer(w, x, attn)
        last = x[torch.arange(n), lengths - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per running request in slots 0..B-1 at `positions` [B]; returns logits [B, vocab]."""
        b = tokens.shape[0]
        x = self._embed(tokens[:, None], positions[:, None])
        span = int(positions.max()) + 1
        rows = torch.arange(b)
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, span]
        gqa = self.spec.num_kv_heads != self.spec.num_heads
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, positions[:, None])  # [B, heads, 1, hd]
            cache[li, 0, rows, :, positions] = k[:, :, 0]
            cache[li, 1, rows, :, positions] = v[:, :, 0]
            kc, vc = cache[li, 0, :b, :, :span], cache[li, 1, :b, :, :span]  # [B, kvh, span, hd]
            out = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=gqa)  # [B, heads, 1, hd]
            x = self._finish_layer(w, x, out.reshape(b, 1, -1))
        return self._logits(x[:, 0])

    def new_cache(self, slots: int, positions: int) -> torch.Tensor:
        s = self.spec
        return torch.zeros(s.num_layers, 2, slots, s.num_kv_heads, positions, s.head_dim)

    # ---- pieces --------------------------------------------------------------------------------
    def _embed(self, tokens, pos):
        if self.spec.family == "gpt2":
            return self.top["wte"][tokens] + self.top["wpe"][pos]
        return self.top["wte"][tokens]

    def _qkv(self, w, x, pos):
        s = self.spec
        n, t, _ = x.shape
        if s.family == "gpt2":
            hdn = F.layer_norm(x, (s.hidden_size,), w["ln1_w"], w["ln1_b"], s.norm_eps)
        else:
            hdn = _rms_norm(x, w["ln1_w"], s.norm_eps)
        qkv = F.linear(hdn, w["qkv_w"], w.get("qkv_b"))
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        v = qkv[..., q_dim + kv_dim:].view(n, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        qk = qkv[..., :q_dim + kv_dim].view(n, t, s.num_heads + s.num_kv_heads, s.head_dim)
        if s.family == "llama":  # RoPE on q and k at once; HF's rotate_half convention
            cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # [n, t, 1, hd/2]
            x1, x2 = qk.chunk(2, dim=-1)
            qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        q = qk[:, :, :s.num_heads].transpose(1, 2)
        k = qk[:, :, s.num_heads:].transpose(1, 2)
        return q, k, v

    def _finish_layer(self, w, x, attn):
        s = self.spec
        n, t = x.shape[:2]
        if attn.dim() == 4:  # [n, heads, t, hd] -> [n, t, heads*hd]
            attn = attn.transpose(1, 2).reshape(n, t, -1)
        x = x + F.linear(attn, w["o_w"], w.get("o_b"))
        if s.family == "gpt2":
            hdn = F.layer_norm(x, (s.hidden_size,), w["ln2_w"], w["ln2_b"], s.norm_eps)
            return x + F.linear(F.gelu(F.linear(hdn, w["fc_w"], w["fc_b"]), approximate="tanh"), w["proj_w"], w["proj_b"])
        hdn = _rms_norm(x, w["ln2_w"], s.norm_eps)
        gate_up = F.linear(hdn, w["gate_up_w"])
        gate, up = gate_up.chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w["down_w"])

    def _logits(self, h):
        s = self.spec
        if s.family == "gpt2":
            h = F.layer_norm(h, (s.hidden_size,), self.top["lnf_w"], self.top["lnf_b"], s.norm_eps)
        else:
            h = _rms_norm(h, self.top["lnf_w"], s.norm_eps)
        return F.linear(h, self.top["lm_head"])


def _rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _causal_attention(q, k, v, groups):
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` (along dim 0), without the copy when the parts already lie one after another in
    one storage (received into `fused_layout` buffers): then the result is a view of that storage."""
    first = parts[0]
    offset, rows, row = first.storage_offset(), 0, math.prod(first.shape[1:])
    ptr = first.untyped_storage().data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset + rows * row):
            return torch.cat(parts)
        rows += p.shape[0]
    return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), offset, (rows, *first.shape[1:]))


def fused_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors of the names, shapes and dtypes of `tensors`, where each group that the model
    concatenates (q/k/v weights and biases, gate/up weights) are consecutive row ranges of one buffer,
    in the order `_llama_weights` concatenates them: a model built from them concatenates by viewing
    (`_cat_rows`), so weights received into them are served without another copy."""
    out: dict[str, torch.Tensor] = {}
    groups = ([".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight"],
              [".self_attn.q_proj.bias", ".self_attn.k_proj.bias", ".self_attn.v_proj.bias"],
              [".mlp.gate_proj.weight", ".mlp.up_proj.weight"])
    for name in tensors:
        for group in groups:
            if name.endswith(group[0]):
                names = [name[:-len(group[0])] + g for g in group]
                parts = [tensors.get(n) for n in names]
                if all(p is not None and p.dtype == parts[0].dtype and p.shape[1:] == parts[0].shape[1:]
                       for p in parts):
                    buf = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
                    for n, piece in zip(names, buf.split([p.shape[0] for p in parts])):
                        out[n] = piece
    for name, t in tensors.items():
        if name not in out:
            out[name] = torch.empty(t.shape, dtype=t.dtype)
    return out


def _strip(tensors: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tensors.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def _check_shapes(spec: ModelSpec, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every weight has the shape config.json implies. A snapshot with other shapes would load and then
    fail mid-generation with an opaque broadcast error; it is refused at load, naming the tensor."""
    t = _strip(tensors, ("transformer.", "model."))
    for name, want in _expected_shapes(spec, t).items():
        got = tuple(t[name].shape) if name in t else want  # a missing tensor is named when the weights are built
        if got != want:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {list(got)}, but config.json implies "
                                 f"{list(want)}; the weights do not match their config.")


def _expected_shapes(spec: ModelSpec, t: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Shapes by (prefix-stripped) HF name; the MLP width, which ModelSpec does not hold, from layer 0."""
    h, v = spec.hidden_size, spec.vocab_size
    want = {"lm_head.weight": (v, h)}
    if spec.family == "gpt2":  # Conv1D weights are [in, out]
        f = t["h.0.mlp.c_fc.weight"].shape[-1] if "h.0.mlp.c_fc.weight" in t else 4 * h
        want |= {"wte.weight": (v, h), "wpe.weight": (spec.max_positions, h), "ln_f.weight": (h,), "ln_f.bias": (h,)}
        layer, per_layer = "h.{}.", {
            "ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
            "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,), "attn.c_proj.weight": (h, h),
            "attn.c_proj.bias": (h,), "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h),
            "mlp.c_proj.bias": (h,)}
    else:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        f = t["layers.0.mlp.gate_proj.weight"].shape[0] if "layers.0.mlp.gate_proj.weight" in t else 4 * h
        want |= {"embed_tokens.weight": (v, h), "norm.weight": (h,)}
        layer, per_layer = "layers.{}.", {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,), "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    for i in range(spec.num_layers):
        want |= {layer.format(i) + name: shape for name, shape in per_layer.items()}
    return want


def _gpt2_weights(spec: ModelSpec, tensors):
    t = _strip(tensors, ("transformer.",))
    layers = []
    for i in range(spec.num_layers):
        p = f"h.{i}."
        layers.append({
            "ln1_w": t[p + "ln_1.weight"], "ln1_b": t[p + "ln_1.bias"],
            "qkv_w": t[p + "attn.c_attn.weight"].t().contiguous(), "qkv_b": t[p + "attn.c_attn.bias"],
            "o_w": t[p + "attn.c_proj.weight"].t().contiguous(), "o_b": t[p + "attn.c_proj.bias"],
            "ln2_w": t[p + "ln_2.weight"], "ln2_b": t[p + "ln_2.bias"],
            "fc_w": t[p + "mlp.c_fc.weight"].t().contiguous(), "fc_b": t[p + "mlp.c_fc.bias"],
            "proj_w": t[p + "mlp.c_proj.weight"].t().contiguous(), "proj_b": t[p + "mlp.c_proj.bias"],
        })
    lm_head = t["wte.weight"] if spec.tie_word_embeddings or "lm_head.weight" not in t else t["lm_head.weight"]
    top = {"wte": t["wte.weight"], "wpe": t["wpe.weight"], "lnf_w": t["ln_f.weight"], "lnf_b": t["ln_f.bias"],
           "lm_head": lm_head}
    return layers, top


def _llama_weights(spec: ModelSpec, tensors):
    t = _strip(tensors, ("model.",))
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        w = {
            "ln1_w": t[p + "input_layernorm.weight"], "ln2_w": t[p + "post_attention_layernorm.weight"],
            "qkv_w": _cat_rows([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]]),
            "o_w": t[a + "o_proj.weight"],
            "gate_up_w": _cat_rows([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]),
            "down_w": t[p + "mlp.down_proj.weight"],
        }
        if a + "q_proj.bias" in t:
            w["qkv_b"] = _cat_rows([t[a + "q_proj.bias"], t[a + "k_proj.bias"], t[a + "v_proj.bias"]])
        if a + "o_proj.bias" in t:
            w["o_b"] = t[a + "o_proj.bias"]
        layers.append(w)
    lm_head = t["lm_head.weight"] if "lm_head.weight" in t else t["embed_tokens.weight"]
    top = {"wte": t["embed_tokens.weight"], "lnf_w": t["norm.weight"], "lm_head": lm_head}
    return layers, top
