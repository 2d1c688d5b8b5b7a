"""Synthetic copy pretraining (engines/pretrain.py): the corpus, the cache key, a short real run."""

from __future__ import annotations

import hashlib
import json
import random
import re

import attrs
import pytest

from gyre.engines.chat_template import ChatTemplate
from gyre.engines.pretrain import (
    DECAY_FLOOR,
    DEFAULT_KINDS,
    KINDS,
    QUOTE_LEAD_INS,
    CopyPretrainConfig,
    copy_examples,
    copy_pretrain_digest,
    run_copy_pretrain,
)

WORDS = ("pear", "plum", "kiwi", "lemon", "river")


def _check_copy(source: str, target: str) -> str:
    """Asserts that `target` is the right copy of `source`; returns the example's kind."""
    if source.startswith("{"):  # look: the value of the named key
        table, _, key = source.rpartition(" ")
        assert target == str(json.loads(table)[key])
        return "look"
    lead_in = next((lead for lead in QUOTE_LEAD_INS if source.startswith(lead + " ")), None)
    if lead_in is not None:  # quote: the items after the lead-in, in a quoted string
        assert target == f'"{source.removeprefix(lead_in + " ")}"'
        return "quote"
    if target.split() != source.split():  # not a span: a join, whose items come back with its separator
        assert target.replace("+", " ").replace(",", " ").split() == source.split()
    return "span or join"


def test_examples_carry_loss_only_on_the_copy_and_the_copy_matches_its_source(tiny_model_dir):
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    config = CopyPretrainConfig(words=WORDS, kinds=KINDS)
    examples = copy_examples(template, config, random.Random(3), 80)
    kinds = set()
    for example in examples:
        assert len(example.token_ids) == len(example.loss_mask)
        first_target = example.loss_mask.index(True)
        assert not any(example.loss_mask[:first_target]) and all(example.loss_mask[first_target:])
        source = template.decode(example.token_ids[:first_target]).rstrip("\n")
        target = template.decode(example.token_ids[first_target:]).rstrip("\n")
        kinds.add(_check_copy(source, target))
    assert kinds == {"look", "quote", "span or join"}
    assert copy_examples(template, config, random.Random(3), 80) == examples  # a function of the seed


def test_a_quote_copies_a_word_from_inside_a_line_into_its_other_token_form(tiny_model_dir):
    """The point of "quote": the first copied word is tokenised with its leading space in the source and without
    it after the quote, so the copy is not the same token sequence."""
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    config = CopyPretrainConfig(words=("stone", "eagle"), number_share=0.0, kinds=("quote",), max_items=2)
    example = copy_examples(template, config, random.Random(1), 1)[0]
    first_target = example.loss_mask.index(True)
    source_ids, target_ids = example.token_ids[:first_target], example.token_ids[first_target:]
    word = template.decode(target_ids).split()[0].strip('"')
    assert template.encode(" " + word) != template.encode(word)  # two token forms of one word
    assert _contains(source_ids, template.encode(" " + word)) and _contains(target_ids, template.encode(word))


def test_expression_items_are_copied_verbatim_with_operands_of_every_length(tiny_model_dir):
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    config = CopyPretrainConfig(words=WORDS, kinds=("span", "quote"), expression_share=1.0)
    operand_lengths, operators = set(), set()
    for example in copy_examples(template, config, random.Random(4), 40):
        first_target = example.loss_mask.index(True)
        source = template.decode(example.token_ids[:first_target]).rstrip("\n")
        target = template.decode(example.token_ids[first_target:]).rstrip("\n")
        _check_copy(source, target)
        for item in target.strip('"').split():
            match = re.fullmatch(r"(\d+)([+*-])(\d+)", item)
            assert match, item
            operand_lengths.update((len(match[1]), len(match[3])))
            operators.add(match[2])
    assert operand_lengths == {1, 2, 3} and operators == {"+", "-", "*"}
    plain = CopyPretrainConfig(words=WORDS)
    assert copy_pretrain_digest(tiny_model_dir, plain) != copy_pretrain_digest(
        tiny_model_dir, attrs.evolve(plain, expression_share=0.2))
    with pytest.raises(ValueError, match="expression_share"):
        CopyPretrainConfig(expression_share=1.5)


def _contains(haystack, needle) -> bool:
    return any(tuple(haystack[i:i + len(needle)]) == tuple(needle) for i in range(len(haystack) - len(needle) + 1))


def test_the_default_kinds_leave_out_quote_so_earlier_caches_keep_their_key(tiny_model_dir):
    assert CopyPretrainConfig().kinds == DEFAULT_KINDS and "quote" not in DEFAULT_KINDS
    assert copy_pretrain_digest(tiny_model_dir, CopyPretrainConfig(words=WORDS)) != copy_pretrain_digest(
        tiny_model_dir, CopyPretrainConfig(words=WORDS, kinds=KINDS))
    with pytest.raises(ValueError, match="kinds"):
        CopyPretrainConfig(kinds=("span", "poem"))
    with pytest.raises(ValueError, match="kinds"):
        CopyPretrainConfig(kinds=())


def test_a_gap_puts_unrelated_items_between_the_source_and_its_copy(tiny_model_dir):
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    config = CopyPretrainConfig(words=WORDS, max_gap_items=30, kinds=KINDS)
    gaps = []
    for example in copy_examples(template, config, random.Random(5), 60):
        first_target = example.loss_mask.index(True)
        source_line, gap_line = template.decode(example.token_ids[:first_target]).removesuffix("\n").split("\n")
        target = template.decode(example.token_ids[first_target:]).rstrip("\n")
        _check_copy(source_line, target)
        gaps.append(len(gap_line.split()))
    assert max(gaps) <= 30 and max(gaps) > 10 and min(gaps) < max(gaps)
    with pytest.raises(ValueError):
        CopyPretrainConfig(max_gap_items=-1)


def test_the_cache_key_follows_the_config_and_bad_configs_are_refused(tiny_model_dir):
    one = copy_pretrain_digest(tiny_model_dir, CopyPretrainConfig(words=WORDS))
    assert one == copy_pretrain_digest(tiny_model_dir, CopyPretrainConfig(words=WORDS))
    assert one != copy_pretrain_digest(tiny_model_dir, CopyPretrainConfig(words=WORDS, steps=601))
    with pytest.raises(ValueError, match="two entries"):
        CopyPretrainConfig(words=("one",))
    with pytest.raises(ValueError, match="number_share"):
        CopyPretrainConfig(number_share=1.5)


def test_a_short_run_lowers_the_loss_and_saves_a_model_the_engine_loads(tiny_model_dir, tmp_path):
    config = CopyPretrainConfig(steps=12, batch_size=4, lr=3e-3, warmup_steps=1, max_items=3, words=WORDS,
                                num_threads=1)
    seen = []
    result = run_copy_pretrain(tiny_model_dir, tmp_path / "out", config, lambda *args: seen.append(args))
    assert [s[0] for s in seen] == list(range(1, 13)) and result.steps == 12
    assert result.last_loss < result.first_loss
    saved = json.loads((tmp_path / "out" / "copy_pretrain.json").read_text())
    assert saved["steps"] == 12 and saved == json.loads(json.dumps(attrs.asdict(result)))
    from safetensors.torch import load_file

    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys() and any(not before[k].equal(after[k]) for k in before)
    EmbeddedEngine(str(tmp_path / "out"), EngineConfig(num_threads=1))  # raises if the directory is not a model


def test_the_learning_rate_warms_up_holds_then_decays_to_its_floor_over_the_last_steps():
    config = CopyPretrainConfig(steps=100, lr=1e-3, warmup_steps=10, decay_steps=40)
    assert config.lr_at(5) == pytest.approx(5e-4)  # half way up the warm-up
    assert config.lr_at(10) == config.lr_at(60) == pytest.approx(1e-3)  # the peak, held until the decay starts
    assert config.lr_at(80) == pytest.approx(5e-4)  # half way down
    assert config.lr_at(100) == pytest.approx(1e-3 * DECAY_FLOOR)  # the last step: the floor, not zero
    rates = [config.lr_at(step) for step in range(60, 101)]
    assert rates == sorted(rates, reverse=True)
    constant = CopyPretrainConfig(steps=100, lr=1e-3, warmup_steps=10)
    assert constant.lr_at(100) == constant.lr_at(11) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="decay_steps"):
        CopyPretrainConfig(steps=10, decay_steps=11)
    with pytest.raises(ValueError):
        CopyPretrainConfig(decay_steps=-1)


def test_a_decay_changes_the_cache_key_and_no_decay_keeps_the_key_of_caches_made_before_it(tiny_model_dir):
    plain = CopyPretrainConfig(words=WORDS)
    decayed = attrs.evolve(plain, decay_steps=100)
    assert copy_pretrain_digest(tiny_model_dir, decayed) != copy_pretrain_digest(tiny_model_dir, plain)
    # The key as it was computed before the field existed: the model's bytes, then the fields that differ from
    # the defaults of the fields added later.
    fields = attrs.asdict(plain)
    for later in ("max_gap_items", "kinds", "expression_share", "decay_steps"):
        del fields[later]
    before = hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes())
    before.update(json.dumps(fields, sort_keys=True).encode())
    assert copy_pretrain_digest(tiny_model_dir, plain) == before.hexdigest()[:16]


def test_a_run_with_a_decay_steps_at_the_rates_its_config_gives(tiny_model_dir, tmp_path, monkeypatch):
    from gyre.engines.trainer import MegatronTrainer

    rates = []
    original = MegatronTrainer.optimizer_step
    monkeypatch.setattr(MegatronTrainer, "optimizer_step",
                        lambda self, lr=None: rates.append(lr) or original(self, lr=lr))
    config = CopyPretrainConfig(steps=6, batch_size=2, lr=2e-3, warmup_steps=2, decay_steps=3, max_items=2,
                                words=WORDS, num_threads=1)
    run_copy_pretrain(tiny_model_dir, tmp_path / "out", config)
    assert rates == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3 * 2 / 3, 2e-3 / 3, 2e-3 * DECAY_FLOOR])
