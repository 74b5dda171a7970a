"""`import_model` and `miles import-model` (docs/real-model.md): a source becomes an HF safetensors directory.

Pins: an HF directory is imported into file:// and into a real S3 server (SeaweedFS) with its
weights byte for byte, its config normalised, a `miles_import.json` record and the `.complete`
marker; a second import into a finished destination returns at once and rewrites nothing; an
unfinished one is redone. Bad sources are refused with a message naming the problem: a missing
path, a directory without safetensors, an architecture or RoPE scaling the readers cannot serve, a
file that is not GGUF, a GGUF of another architecture (also fetched from S3). The CLI prints the
URI and exits 0, or one line and exit 2. Slow: the SmolLM2 GGUF (`import:smollm2-135m-instruct`)
imports to a config without quantization_config, with tokenizer and chat template, whose
transformers logits equal those of the GGUF loaded by transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest
import torch

from miles_core.cli import main
from miles_core.models.builtin import materialize_checkpoint
from miles_core.models.source import MARKER
from miles_core.prepare.model_import import RECORD, ModelImportError, import_model
from miles_core.storage import Store

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-llama", 1, str(tmp_path_factory.mktemp("tiny-llama")))


def copy_with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def write_gguf(path, arch: str) -> str:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def check_imported(store: Store, src: str) -> dict:
    names = store.list()
    assert MARKER in names and RECORD in names
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(src, name), "rb") as f:
            assert store.get_bytes(name) == f.read(), name
    record = store.get_json(RECORD)
    assert record["kind"] == "hf-directory" and record["architecture"] == "llama"
    assert len(record["source_sha"]) == 16 and set(record["files"]) <= set(names)
    return record


def test_hf_dir_to_file_uri(tiny_llama, tmp_path):
    dest = f"file://{tmp_path}/imported"
    assert import_model(tiny_llama, dest) == dest
    record = check_imported(Store(dest), tiny_llama)
    assert record["source"] == tiny_llama and record["converted"] == []
    from miles_core.engines.model import read_spec

    assert read_spec(str(tmp_path / "imported")).family == "llama"


@pytest.mark.s3
def test_hf_dir_to_s3(tiny_llama, s3_bucket):
    dest = f"s3://{s3_bucket}/models/{uuid.uuid4().hex[:12]}"
    assert import_model(tiny_llama, dest) == dest
    check_imported(Store(dest), tiny_llama)


def test_idempotent_and_unfinished_redone(tiny_llama, tmp_path):
    dest = f"file://{tmp_path}/imported"
    import_model(tiny_llama, dest)
    weights = tmp_path / "imported" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    record = Store(dest).get_json(RECORD)
    assert import_model("/no/such/source", dest) == dest  # finished: the source is not even looked at
    assert weights.stat().st_mtime_ns == stamp and Store(dest).get_json(RECORD) == record
    (tmp_path / "imported" / MARKER).unlink()
    weights.write_bytes(b"partial")
    import_model(tiny_llama, dest)
    assert weights.read_bytes() == open(os.path.join(tiny_llama, "model.safetensors"), "rb").read()


def test_legacy_default_rope_scaling_is_rewritten(tiny_llama, tmp_path):
    src = copy_with_config(tiny_llama, tmp_path / "src", rope_scaling={"type": "default"},
                           quantization_config={"quant_method": "gguf"})
    dest = import_model(src, str(tmp_path / "out"))
    cfg = json.loads(Store(dest).get_bytes("config.json"))
    assert cfg["rope_scaling"] == {"rope_type": "default"} and "quantization_config" not in cfg
    assert Store(dest).get_json(RECORD)["converted"] == ["dropped quantization_config",
                                                         "rope_scaling.type -> rope_scaling.rope_type"]


@pytest.mark.parametrize("case,message", [
    ("missing", "no such file or directory"),
    ("no-safetensors", r"no model.safetensors .*found pytorch_model.bin: convert them to safetensors"),
    ("gpt2", "model_type='gpt2' is not supported; supported: llama, qwen2, qwen3, qwen3_moe, glm4_moe"),
    ("linear-rope", "rope_scaling.type='linear' is not supported"),
    ("not-gguf", "not a readable GGUF file"),
    ("gemma-gguf", "GGUF architecture 'gemma' is not supported"),
    ("no-config", "no config.json"),
])
def test_bad_sources_are_refused_by_name(case, message, tiny_llama, tmp_path):
    if case == "missing":
        src = str(tmp_path / "nope.gguf")
    elif case == "no-safetensors":
        src = copy_with_config(tiny_llama, tmp_path / "src")
        os.rename(os.path.join(src, "model.safetensors"), os.path.join(src, "pytorch_model.bin"))
    elif case == "gpt2":
        src = materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path / "gpt"))
    elif case == "linear-rope":
        src = copy_with_config(tiny_llama, tmp_path / "src", rope_scaling={"type": "linear", "factor": 2.0})
    elif case == "not-gguf":
        src = str(tmp_path / "x.gguf")
        open(src, "wb").write(b"not a gguf file at all" * 10)
    elif case == "gemma-gguf":
        src = write_gguf(tmp_path / "g.gguf", "gemma")
    else:
        src = copy_with_config(tiny_llama, tmp_path / "src")
        os.remove(os.path.join(src, "config.json"))
    dest = tmp_path / "out"
    with pytest.raises(ModelImportError, match=message):
        import_model(src, str(dest))
    assert not (dest / MARKER).exists()


@pytest.mark.s3
def test_remote_gguf_is_fetched_then_checked(tmp_path, s3_bucket):
    prefix = f"s3://{s3_bucket}/sources/{uuid.uuid4().hex[:12]}"
    with open(write_gguf(tmp_path / "g.gguf", "gemma"), "rb") as f:
        Store(prefix).put_bytes("g.gguf", f.read())
    with pytest.raises(ModelImportError, match="GGUF architecture 'gemma' is not supported"):
        import_model(f"{prefix}/g.gguf", str(tmp_path / "out"))
    with pytest.raises(ModelImportError, match="not found"):
        import_model(f"{prefix}/missing.gguf", str(tmp_path / "out"))


def test_cli_exit_codes(tiny_llama, tmp_path, capsys):
    dest = f"file://{tmp_path}/cli"
    assert main(["import-model", tiny_llama, dest]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == dest and "done in" in err
    for argv in (["import-model", str(tmp_path / "nope.gguf"), str(tmp_path / "x")],
                 ["import-model", "import:no-such-model", str(tmp_path / "x")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and err.startswith("miles import-model:")
    assert main(["import-model", tiny_llama]) == 2
    assert "usage: miles import-model" in capsys.readouterr().err


# ---- slow: the real model ---------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gguf_import(smollm2_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_core.models.source import import_source

    uri, path = smollm2_hf
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    record = Store(uri).get_json(RECORD)
    assert record["kind"] == "gguf" and record["chat_template"] and "dropped quantization_config" in record["converted"]
    print(f"\nsmollm2 import: {record['seconds']}s, converted: {record['converted']}")
    tok = AutoTokenizer.from_pretrained(path)
    assert os.path.exists(os.path.join(path, "chat_template.jinja")) and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    gguf = import_source("import:smollm2-135m-instruct")
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        ref_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                         dtype=torch.float32).eval()
        ref = ref_model(ids).logits
    diff = (ours - ref).abs().max().item()
    print(f"smollm2 imported vs GGUF logits: max |diff| = {diff:.3g} over {ids.shape[1]} positions")
    assert diff <= 1e-6
