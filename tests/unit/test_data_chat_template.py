"""Text prompts through the run's tokenizer: --apply-chat-template and --max-seq-len (miles_core.prepare.dataset).

Pins: a string prompt becomes one user message and a message list is used as it is, both rendered
by the tokenizer's chat template with the generation prompt last; a message list without the flag
and a tokenizer without a template fail clearly; --max-seq-len drops (and counts) prompts that
leave no room for a response; every setting that changes the output changes the content hash.
The tokenizer is a tiny word-level one saved with a Jinja chat template (no download needed).
"""

from __future__ import annotations

import json
import logging

import pytest

from miles_core.config import embedded_default
from miles_core.config.sections import DataSection
from miles_core.prepare.dataset import dataset_fingerprint, prepare_dataset
from miles_core.rollout.prompts import DatasetError, load_prompts, stored_dataset_info
from miles_core.storage import Store

WORDS = ["<pad>", "<eos>", "<system>", "<user>", "<assistant>", "+", "what", "is"] + [str(d) for d in range(10)]
ID = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


def save_tokenizer(path, chat_template: str | None = TEMPLATE) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=ID, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"chat_template": chat_template} if chat_template else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<pad>",
                            **extra).save_pretrained(str(path))
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def chat_tok(tmp_path):
    return save_tokenizer(tmp_path / "chat_tok")


@pytest.fixture
def store(tmp_path):
    return Store(f"file://{tmp_path}/run")


def section(src: str, **kw) -> DataSection:
    return DataSection(prompt_data=src, **{"input_key": "prompt", "label_key": "label", **kw})


def test_string_and_message_prompts_render_with_the_template(tmp_path, store, chat_tok):
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "what is 1 + 2", "label": "3"},
        {"prompt": [{"role": "user", "content": "what is 1 + 2"}], "label": "3"},
        {"prompt": [{"role": "system", "content": "9"}, {"role": "user", "content": "4 + 4"}], "label": "8"},
        {"prompt": [7, 8], "label": "x"},  # token ids: used as they are
    ])
    prepare_dataset(section(src, apply_chat_template=True), store, tokenizer_source=chat_tok)
    rows = load_prompts(store)
    assert rows[0]["prompt"] == ids("<user> what is 1 + 2 <eos> <assistant>")
    assert rows[1]["prompt"] == rows[0]["prompt"]
    assert rows[2]["prompt"] == ids("<system> 9 <eos> <user> 4 + 4 <eos> <assistant>")
    assert rows[3]["prompt"] == [7, 8]
    assert store.get_json("data/prompts.hash.json")["apply_chat_template"] is True


def test_without_the_flag_text_has_no_special_tokens_and_messages_are_a_row_error(tmp_path, store, chat_tok):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is 1", "label": "1"}])
    prepare_dataset(section(src), store, tokenizer_source=chat_tok)
    assert load_prompts(store)[0]["prompt"] == ids("what is 1")

    bad = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1", "label": "1"},
                                              {"prompt": [{"role": "user", "content": "1"}], "label": "1"}])
    with pytest.raises(DatasetError, match=r"line 2: field 'prompt':.*--apply-chat-template"):
        prepare_dataset(section(bad), Store(f"file://{tmp_path}/run2"), tokenizer_source=chat_tok)


def test_malformed_messages_name_the_message(tmp_path, store, chat_tok):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user"}], "label": "1"}])
    with pytest.raises(DatasetError, match=r"line 1: field 'prompt': message 0 needs string 'role' and 'content'"):
        prepare_dataset(section(src, apply_chat_template=True), store, tokenizer_source=chat_tok)


def test_a_tokenizer_without_a_template_names_the_model_and_the_flag(tmp_path, store):
    plain = save_tokenizer(tmp_path / "plain_tok", chat_template=None)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is 1", "label": "1"}])
    with pytest.raises(DatasetError, match=r"--apply-chat-template.*plain_tok.*no chat template"):
        prepare_dataset(section(src, apply_chat_template=True), store, tokenizer_source=plain)
    with pytest.raises(DatasetError, match=r"--apply-chat-template.*builtin:tiny-gpt"):  # the digit tokenizer
        prepare_dataset(section(src, apply_chat_template=True), store, tokenizer_source="builtin:tiny-gpt")


def test_an_explicit_transformers_tokenizer_is_wrapped_like_a_loaded_one(tmp_path, store, chat_tok):
    from transformers import AutoTokenizer

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 + 2", "label": "3"}])
    prepare_dataset(section(src, apply_chat_template=True), store, tokenizer=AutoTokenizer.from_pretrained(chat_tok))
    assert load_prompts(store)[0]["prompt"] == ids("<user> 1 + 2 <eos> <assistant>")


def test_max_seq_len_drops_and_counts_prompts_without_room_for_a_response(tmp_path, store, chat_tok, caplog):
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": [1, 2, 3], "label": "a"},      # 3 tokens: kept at max_seq_len 4
        {"prompt": [1, 2, 3, 4], "label": "b"},   # 4: no room for one response token
        {"prompt": "1 + 2", "label": "c"},        # templated: 6 tokens
    ])
    with caplog.at_level(logging.WARNING, logger="miles_core.prepare.dataset"):
        info = prepare_dataset(section(src, apply_chat_template=True, max_seq_len=4), store, tokenizer_source=chat_tok)
    assert info.num_rows == 1 and [r["label"] for r in load_prompts(store)] == ["a"]
    meta = store.get_json("data/prompts.hash.json")
    assert meta["dropped_too_long"] == 2 and meta["max_seq_len"] == 4
    assert any("dropped 2 of 3" in r.message and "--max-seq-len=4" in r.message for r in caplog.records)

    with pytest.raises(DatasetError, match=r"all 3 prompts have >= --max-seq-len=3 tokens"):
        prepare_dataset(section(src, apply_chat_template=True, max_seq_len=3), Store(f"file://{tmp_path}/r2"),
                        tokenizer_source=chat_tok)


def test_the_content_hash_covers_template_max_seq_len_and_tokenizer(tmp_path, chat_tok):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1", "label": "1"}])
    base = dataset_fingerprint(section(src), tokenizer_source=chat_tok)
    assert base == dataset_fingerprint(src, tokenizer_source=chat_tok)  # defaults: the old hash
    variants = [dataset_fingerprint(section(src, apply_chat_template=True), tokenizer_source=chat_tok),
                dataset_fingerprint(section(src, max_seq_len=64), tokenizer_source=chat_tok),
                dataset_fingerprint(section(src), tokenizer_source="builtin:tiny-gpt")]
    assert len({base, *variants}) == 4


def test_the_flag_reaches_an_existing_run_root_as_a_different_dataset(tmp_path, store, chat_tok):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 + 2", "label": "3"}])
    first = prepare_dataset(section(src), store, tokenizer_source=chat_tok)
    second = prepare_dataset(section(src, apply_chat_template=True), store, tokenizer_source=chat_tok)
    assert first.content_hash != second.content_hash
    assert stored_dataset_info(store).content_hash == second.content_hash
    assert load_prompts(store)[0]["prompt"] == ids("<user> 1 + 2 <eos> <assistant>")


def test_digit_builtins_keep_their_token_ids_and_never_load_a_tokenizer(store):
    info = prepare_dataset(section("builtin:reverse4", apply_chat_template=True), store,
                           tokenizer_source="/nonexistent/model")
    assert info.num_rows == 9500 and load_prompts(store)[0]["prompt"][-1] == 10


def test_builtin_arith_is_tokenized_as_text(store):
    seen = []
    prepare_dataset(section("builtin:arith"), store, tokenizer=lambda text: seen.append(text) or [1, 2])
    rows = load_prompts(store)
    assert len(rows) == len(seen) == 7600 and rows[0]["prompt"] == [1, 2]
    assert seen[0].endswith("Reply with only the number.") and rows[0]["task"] == "arith"
    meta = json.loads(rows[0]["metadata"])
    assert rows[0]["label"] == str(meta["a"] + meta["b"]) and f"{meta['a']}" in seen[0]


def test_builtin_arith_refuses_the_digit_tokenizer(store):
    with pytest.raises(DatasetError, match=r"--prompt-data='builtin:arith'.*--hf-checkpoint='builtin:tiny-gpt'"):
        prepare_dataset(section("builtin:arith"), store, tokenizer_source="builtin:tiny-gpt")


def test_eval_datasets_use_the_training_template_settings(tmp_path, chat_tok):
    """--eval-prompt-data held=builtin:arith-heldout goes through the same tokenizer, template and
    --max-seq-len as the training prompts (cached as data/eval-held.arrow)."""
    from miles_core.config import parse_flags
    from miles_core.eval.datasets import load_eval_datasets

    cfg = parse_flags(["--preset", "tiny-reverse4", "--hf-checkpoint", chat_tok, "--apply-chat-template", "--max-seq-len", "64",
                       "--eval-prompt-data", "held=builtin:arith-heldout", "--storage-root", f"file://{tmp_path}"])
    (held,) = load_eval_datasets(cfg, run_uri=f"file://{tmp_path}/run")
    assert len(held.rows) == 500 and {r.task for r in held.rows} == {"arith"}
    assert all(r.prompt_ids[0] == ID["<user>"] and r.prompt_ids[-1] == ID["<assistant>"] for r in held.rows)
    meta = Store(f"file://{tmp_path}/run").get_json("data/eval-held.hash.json")
    assert meta["apply_chat_template"] is True and meta["max_seq_len"] == 64


def test_eval_builtin_reward_reads_arith_answers_through_the_run_tokenizer(chat_tok):
    """The eval's builtin reward decodes text tasks with the run's tokenizer (not space-joined ids)."""
    import asyncio

    from miles_core.config import RunConfig, replace_fields
    from miles_core.eval.datasets import builtin_reward
    from miles_core.samples import Sample, SampleStatus

    score = builtin_reward(replace_fields(embedded_default(), hf_checkpoint=chat_tok))
    meta = json.dumps({"task": "arith"})
    samples = [Sample("g", 0, i, ids("what is"), ids(text), status=SampleStatus.COMPLETED, label="7", metadata=meta)
               for i, text in enumerate(["7 <eos>", "3", "what is 7"])]
    assert asyncio.run(score(samples)) == [1.0, 0.0, 1.0]
