"""Each TP rank reads only its shard of an HF checkpoint (miles_core.train.hf_shards), and loads
exactly what the whole-checkpoint path (hf_convert.load_hf_state + load_into_megatron) loads.

Pins, on a real TP=2 group (two processes, torch.distributed over gloo, the strict device harness)
for a GQA llama (untied, written as a sharded checkpoint with model.safetensors.index.json), a
Qwen2 (qkv bias, tied) and gpt2 (tied and untied; Conv1D [in, out] weights): the Megatron state
each rank loads through the lazy reader, into the policy and a second (KL reference) model in one
read, is bit-identical to what the full-load path gives; and the bytes a rank takes from the
checkpoint files (every tensor safetensors hands out, whole or sliced, counted by wrapping
`safe_open`) are at most 1/TP of the TP-sharded tensors plus the replicated ones.

Guards: a rank reading whole tensors and slicing in memory (the old path: it takes every byte,
which this test also measures and shows over the bound), a fused qkv/fc1 built from the wrong
slices of q/k/v or gate/up, rows and columns swapped (gpt2's transposed layout), a tensor read
twice for the two models. Norms and biases are randomised so a wrong mapping of them shows.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from miles_core.models.safetensors_dir import MissingWeights, SafetensorsReader
from miles_core.train import hf_convert, hf_shards
from miles_core.train.megatron_model import ModelSpec
from tests.support.ranks import fork_ranks
from tests.support import strict_device as strict

TP = 2
SLACK = 0.01  # of the sharded bytes; the split is exact for these shapes
CASES = ("llama_gqa_untied_sharded", "qwen2_bias_tied", "gpt2_untied", "gpt2_tied")
REPLICATED = ("norm", "ln_", "wpe.weight", "c_proj.bias")  # HF names of tensors Megatron keeps whole


def _hf_config(case: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    tied = case.endswith("tied") and "untied" not in case
    if case.startswith("gpt2"):
        return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                          activation_function="gelu_new", tie_word_embeddings=tied)
    cls = LlamaConfig if case.startswith("llama") else Qwen2Config
    return cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied)


def _write_checkpoint(case: str, out_dir: str) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(CASES.index(case))
    model = AutoModelForCausalLM.from_config(_hf_config(case))
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise so their mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    shard = "8KB" if case.endswith("sharded") else "50MB"
    model.save_pretrained(out_dir, max_shard_size=shard)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {c: _write_checkpoint(c, str(root / c)) for c in CASES}


# ---------------------------------------------------------------------------- counting reads

class _CountingOpen:
    """`safe_open` that counts the bytes of every tensor it hands out, whole or sliced."""

    def __init__(self, real):
        self.real, self.bytes = real, 0

    def __call__(self, *args, **kwargs):
        return _CountingFile(self, self.real(*args, **kwargs))

    def count(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        return t


class _CountingFile:
    def __init__(self, counter: _CountingOpen, f):
        self.counter, self.f = counter, f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        return self.counter.count(self.f.get_tensor(name))

    def get_tensors(self):
        return {k: self.counter.count(v) for k, v in self.f.get_tensors().items()}

    def get_slice(self, name):
        return _CountingSlice(self.counter, self.f.get_slice(name))


class _CountingSlice:
    def __init__(self, counter: _CountingOpen, sl):
        self.counter, self.sl = counter, sl

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        return self.counter.count(self.sl[index])


def _counted(module, fn):
    """Run `fn()` with `module.safe_open` counting; the bytes it handed out."""
    real = module.safe_open
    module.safe_open = counter = _CountingOpen(real)
    try:
        fn()
    finally:
        module.safe_open = real
    return counter.bytes


def _checkpoint_bytes(hf_dir: str) -> tuple[int, int]:
    """(bytes of the tensors Megatron shards over TP, bytes of the replicated ones)."""
    sharded = replicated = 0
    with SafetensorsReader(hf_dir) as r:
        for name in r.names():
            t = r.read(name)
            n = t.numel() * t.element_size()
            if any(x in name for x in REPLICATED):
                replicated += n
            else:
                sharded += n
    return sharded, replicated


# ---------------------------------------------------------------------------- the TP=2 ranks

def _load_case(hf_dir: str) -> dict:
    import safetensors.torch

    from miles_core.models import safetensors_dir
    from miles_core.train.megatron_model import build_model

    spec = ModelSpec.from_hf_config(hf_convert.read_hf_config(hf_dir))
    policy, ref = (build_model(spec, tensor_model_parallel_size=TP) for _ in range(2))
    old = _counted(safetensors.torch,
                   lambda: hf_convert.load_into_megatron(policy, spec, hf_convert.load_hf_state(hf_dir)))
    want = {k: v.clone() for k, v in hf_convert.megatron_state(policy).items()}
    with torch.no_grad():  # anything the lazy path leaves out stays NaN
        for m in (policy, ref):
            for p in m.parameters():
                p.fill_(float("nan"))
    new = _counted(safetensors_dir, lambda: hf_shards.load_hf_checkpoint([policy, None, ref], spec, hf_dir))
    return {"want": want, "policy": hf_convert.megatron_state(policy), "ref": hf_convert.megatron_state(ref),
            "old_bytes": old, "new_bytes": new}


def _worker(rank: int, dirs: dict[str, str], tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=TP)
    out = {case: _load_case(d) for case, d in dirs.items()}
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(dirs: dict[str, str], tmp: str) -> None:
    """In a fresh (spawned) process: import Megatron once, single-threaded, then fork the TP ranks
    (no process group exists before the fork). Exits without interpreter teardown."""
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    import miles_core.train.megatron_model  # noqa: F401

    os.environ.update(strict.ENV)  # NCCL's device rule on the ranks' gloo groups
    try:
        fork_ranks(_worker, [(r, dirs, tmp) for r in range(TP)])
        code = 0
    except RuntimeError as e:
        print(e, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@pytest.fixture(scope="module")
def loaded(checkpoints, tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("ranks"))
    launcher = mp.get_context("spawn").Process(target=_launch, args=(checkpoints, tmp))
    launcher.start()
    launcher.join(240)
    if launcher.is_alive():
        launcher.kill()
    assert launcher.exitcode == 0, f"the TP=2 rank processes failed (exit code {launcher.exitcode}); see stderr"
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(TP)]


def test_sharded_checkpoint_has_an_index(checkpoints):
    d = checkpoints["llama_gqa_untied_sharded"]
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    assert len([n for n in os.listdir(d) if n.endswith(".safetensors")]) > 2


@pytest.mark.parametrize("case", CASES)
def test_each_rank_loads_exactly_the_full_load_shards(loaded, case):
    """Pins: policy and reference tensors of each rank == the full-load path's, bit for bit."""
    for rank, got in enumerate(r[case] for r in loaded):
        assert set(got["policy"]) == set(got["want"]) == set(got["ref"])
        for name, want in got["want"].items():
            assert torch.equal(got["policy"][name], want), f"rank {rank} {name}"
            assert torch.equal(got["ref"][name], want), f"rank {rank} {name} (reference model)"
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(loaded[0][case]["want"][qkv], loaded[1][case]["want"][qkv])  # real shards


@pytest.mark.parametrize("case", CASES)
def test_each_rank_reads_a_tp_fraction_of_the_sharded_tensors(checkpoints, loaded, case):
    """Pins: bytes a rank takes from the files <= sharded / TP (+1%) + replicated, once for both
    models; the whole-file path takes them all and is over that bound."""
    sharded, replicated = _checkpoint_bytes(checkpoints[case])
    bound = sharded * (1 / TP + SLACK) + replicated
    for rank, got in enumerate(r[case] for r in loaded):
        assert got["new_bytes"] <= bound, (rank, got["new_bytes"], sharded, replicated)
        assert got["new_bytes"] >= sharded / TP + replicated  # every tensor read: the count is live
        assert got["old_bytes"] == sharded + replicated > bound  # the old path fails this test


# ---------------------------------------------------------------------------- errors

def test_missing_tensor_is_named_and_bin_checkpoints_are_refused(checkpoints, tmp_path):
    """A tensor the checkpoint lacks is named; a `.bin`-only directory is refused as today
    (no pickle), before anything is read."""
    src = checkpoints["qwen2_bias_tied"]
    spec = ModelSpec.from_hf_config(hf_convert.read_hf_config(src))
    with SafetensorsReader(src) as r:
        state = {n: r.read(n).clone() for n in r.names() if n != "model.layers.1.self_attn.k_proj.bias"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with hf_shards.open_checkpoint(str(tmp_path)) as reader:
        reads = hf_shards.rank_tensors(spec, reader, 1, TP)
        with pytest.raises(hf_convert.ConversionError, match="model.layers.1.self_attn.k_proj.bias"):
            for read in reads.values():
                read()
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(hf_convert.ConversionError, match="only safetensors"):
        hf_shards.open_checkpoint(str(tmp_path))
    with pytest.raises(MissingWeights):
        SafetensorsReader(str(tmp_path))


def test_reader_reads_rows_and_columns(tmp_path):
    """`read(name, dim, start, stop)` gives exactly that range; `bytes_read` counts it."""
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    with SafetensorsReader(str(tmp_path)) as r:
        assert torch.equal(r.read("w", 0, 1, 3), full[1:3])
        assert torch.equal(r.read("w", 1, 2, 5), full[:, 2:5])
        assert r.bytes_read == (12 + 12) * 4
