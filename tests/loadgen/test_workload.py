"""The load generator's workload model: length specs, configuration, prompts, plans, arrivals."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tokentrace.agent import semconv
from tokentrace.loadgen import prompts
from tokentrace.loadgen.lengths import LengthDistribution, WorkloadError, parse_length
from tokentrace.loadgen.prompts import (
    PROMPT_WORDS,
    TokenizerPromptBuilder,
    WordPromptBuilder,
    read_dataset,
)
from tokentrace.loadgen.workload import (
    API_CHAT,
    API_COMPLETIONS,
    LoadConfig,
    RequestPlan,
    RequestPlanner,
    arrival_offsets_s,
)

_BASE_URL = "http://127.0.0.1:8000"
_MODEL = "test-model"


def _config(**overrides: object) -> LoadConfig:
    return LoadConfig(**{"base_url": _BASE_URL, **overrides})


def _body(plan: RequestPlan) -> dict[str, object]:
    body = json.loads(plan.body)
    assert isinstance(body, dict)
    return body


def _messages(plan: RequestPlan) -> list[dict[str, str]]:
    messages = _body(plan)["messages"]
    assert isinstance(messages, list)
    return messages


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# --- length specs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("128", LengthDistribution("fixed", 128)),
        (" fixed:128 ", LengthDistribution("fixed", 128)),
        ("uniform:64:256", LengthDistribution("uniform", 64, 256)),
        ("uniform:7:7", LengthDistribution("uniform", 7, 7)),
        ("normal:128:32", LengthDistribution("normal", 128, 32)),
        ("normal:100.5:0", LengthDistribution("normal", 100.5, 0)),
        ("Uniform:1:2", LengthDistribution("uniform", 1, 2)),
    ],
)
def test_parse_length_reads_every_form_and_round_trips(
    text: str, expected: LengthDistribution
) -> None:
    parsed = parse_length(text, option="--prompt-tokens")
    assert parsed == expected
    assert parse_length(parsed.to_spec(), option="--prompt-tokens") == parsed


def test_describe_is_readable() -> None:
    assert parse_length("128", option="-x").describe() == "fixed 128"
    assert parse_length("uniform:64:256", option="-x").describe() == "uniform 64-256"
    assert parse_length("normal:128:32", option="-x").describe() == "normal 128±32"
    assert parse_length("normal:128:2.5", option="-x").describe() == "normal 128±2.5"


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "-3",
        "fixed:-1",
        "uniform:300:200",
        "uniform:0:10",
        "uniform:64",
        "uniform:64:",
        "abc",
        "fixed:1.5",
        "poisson:3",
        "normal:0:5",
        "normal:-10:5",
        "normal:100:-1",
        "normal:100",
        "",
        "nan",
        "inf",
        "2000000",
        "fixed:1:2",
    ],
)
def test_parse_length_rejects_bad_specs_naming_the_option(text: str) -> None:
    with pytest.raises(WorkloadError, match=r"^--output-tokens: "):
        parse_length(text, option="--output-tokens")


def test_length_distribution_rejects_bad_parameters_when_built_directly() -> None:
    with pytest.raises(WorkloadError):
        LengthDistribution("fixed", 0)
    with pytest.raises(WorkloadError):
        LengthDistribution("uniform", 10, 5)
    with pytest.raises(WorkloadError):
        LengthDistribution("lognormal", 10, 5)


def test_fixed_always_samples_its_value() -> None:
    rng = random.Random(1)
    assert {LengthDistribution("fixed", 37).sample(rng) for _ in range(200)} == {37}


def test_uniform_covers_both_bounds_and_nothing_outside() -> None:
    rng = random.Random(2)
    samples = [LengthDistribution("uniform", 10, 20).sample(rng) for _ in range(5000)]
    assert min(samples) == 10
    assert max(samples) == 20
    assert set(samples) == set(range(10, 21))
    assert statistics.fmean(samples) == pytest.approx(15, abs=0.3)


def test_normal_has_its_mean_and_stddev_and_stays_positive() -> None:
    rng = random.Random(3)
    samples = [LengthDistribution("normal", 128, 32).sample(rng) for _ in range(20_000)]
    assert all(isinstance(sample, int) for sample in samples)
    # Standard error of the mean is 32/sqrt(20000) = 0.23.
    assert statistics.fmean(samples) == pytest.approx(128, abs=1.5)
    assert statistics.pstdev(samples) == pytest.approx(32, abs=1.5)
    wide = [LengthDistribution("normal", 2, 50).sample(rng) for _ in range(2000)]
    assert min(wide) == 1


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ({"base_url": "127.0.0.1:8000"}, "URL"),
        ({"base_url": "ftp://host"}, "URL"),
        ({"model": ""}, "--model"),
        ({"api": "embeddings"}, "--api"),
        ({"stream": "yes"}, "--no-stream"),
        ({"concurrency": 0}, "--concurrency"),
        ({"concurrency": True}, "--concurrency"),
        ({"concurrency": 2.5}, "--concurrency"),
        ({"rate": -1.0}, "--rate"),
        ({"rate": math.nan}, "--rate"),
        ({"rate": 0}, "--rate"),
        ({"requests": 0}, "--requests"),
        ({"duration_s": 0.0}, "--duration"),
        ({"duration_s": math.inf}, "--duration"),
        ({"prompt_tokens": "128"}, "--prompt-tokens"),
        ({"shared_prefix_fraction": 1.5}, "--shared-prefix-fraction"),
        ({"shared_prefix_fraction": -0.1}, "--shared-prefix-fraction"),
        ({"shared_prefix_tokens": 0}, "--shared-prefix-tokens"),
        ({"warmup_requests": -1}, "--warmup"),
        ({"seed": 1.5}, "--seed"),
        ({"timeout_s": 0.0}, "--timeout"),
        ({"tokenizer": " "}, "--tokenizer"),
        ({"dataset": "d.jsonl", "shared_prefix_fraction": 0.5}, "--shared-prefix-fraction"),
    ],
)
def test_validate_names_the_option_of_a_bad_value(
    overrides: dict[str, object], option: str
) -> None:
    with pytest.raises(WorkloadError, match=f"^{option}: "):
        _config(**overrides).validate()


def test_validate_accepts_defaults_and_full_settings() -> None:
    _config().validate()
    _config(
        model="m",
        api=API_COMPLETIONS,
        stream=False,
        concurrency=8,
        rate=2.5,
        requests=10,
        duration_s=30.0,
        shared_prefix_fraction=1.0,
        warmup_requests=0,
        seed=-5,
    ).validate()


def test_effective_concurrency_and_requests_fill_the_defaults() -> None:
    assert _config().effective_concurrency == 1
    assert _config(rate=5.0).effective_concurrency is None
    assert _config(rate=5.0, concurrency=3).effective_concurrency == 3
    assert _config().effective_requests == 100
    assert _config(duration_s=10.0).effective_requests is None
    assert _config(duration_s=10.0, requests=7).effective_requests == 7


def test_server_url_drops_a_trailing_v1_so_api_paths_are_not_doubled() -> None:
    assert _config().server_url + "/v1/models" == "http://127.0.0.1:8000/v1/models"
    assert LoadConfig(base_url="http://h:1/v1/").server_url + "/v1/completions" == (
        "http://h:1/v1/completions"
    )
    assert LoadConfig(base_url="http://h:1/proxy").server_url + _config(api=API_CHAT).path == (
        "http://h:1/proxy/v1/chat/completions"
    )


def _non_default_config() -> LoadConfig:
    return _config(
        model="m",
        api=API_COMPLETIONS,
        stream=False,
        concurrency=4,
        rate=3.5,
        requests=50,
        duration_s=12.0,
        prompt_tokens=LengthDistribution("normal", 100, 12.5),
        output_tokens=LengthDistribution("uniform", 8, 16),
        shared_prefix_fraction=0.25,
        shared_prefix_tokens=64,
        warmup_requests=3,
        seed=42,
        reuse_connections=False,
        ignore_eos=False,
        timeout_s=30.0,
        tokenizer="/models/tok",
    )


def test_to_dict_from_dict_round_trip_through_json() -> None:
    for config in (_config(), _non_default_config(), _config(dataset="/data/x.jsonl")):
        data = json.loads(json.dumps(config.to_dict()))
        assert LoadConfig.from_dict(data) == config
    assert _non_default_config().to_dict()["prompt_tokens"] == "normal:100:12.5"


def test_from_dict_takes_defaults_for_missing_fields() -> None:
    assert LoadConfig.from_dict({"base_url": _BASE_URL}) == _config()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({}, "base_url"),
        ({"base_url": _BASE_URL, "concurency": 4}, "concurency"),
        ({"base_url": _BASE_URL, "concurrency": "4"}, "concurrency"),
        ({"base_url": _BASE_URL, "stream": 1}, "stream"),
        ({"base_url": _BASE_URL, "seed": None}, "seed"),
        ({"base_url": _BASE_URL, "rate": "fast"}, "rate"),
        ({"base_url": _BASE_URL, "prompt_tokens": "uniform:9:1"}, "prompt_tokens"),
        ({"base_url": _BASE_URL, "prompt_tokens": 128}, "prompt_tokens"),
        ({"base_url": _BASE_URL, "concurrency": 0}, "--concurrency"),
    ],
)
def test_from_dict_rejects_bad_data(data: dict[str, object], match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        LoadConfig.from_dict(data)


def test_load_identity_ignores_where_and_how_patiently_but_not_what() -> None:
    base = _non_default_config()
    moved = dataclasses.replace(
        base,
        base_url="https://elsewhere:9000/v1",
        timeout_s=5.0,
        reuse_connections=True,
        tokenizer=None,
    )
    assert moved.load_identity() == base.load_identity()
    for change in (
        {"seed": 43},
        {"rate": 4.0},
        {"concurrency": 5},
        {"stream": True},
        {"api": API_CHAT},
        {"prompt_tokens": LengthDistribution("fixed", 100)},
        {"shared_prefix_fraction": 0.5},
        {"model": "other"},
        {"warmup_requests": 0},
    ):
        assert dataclasses.replace(base, **change).load_identity() != base.load_identity(), change
    json.dumps(base.load_identity())  # JSON-ready


def test_load_identity_treats_equivalent_settings_as_the_same_load() -> None:
    assert _config().load_identity() == _config(concurrency=1, requests=100).load_identity()
    # The prefix length does not matter when no request uses the prefix.
    assert (
        _config(shared_prefix_tokens=64).load_identity()
        == _config(shared_prefix_tokens=1024).load_identity()
    )
    assert (
        _config(shared_prefix_fraction=0.5, shared_prefix_tokens=64).load_identity()
        != _config(shared_prefix_fraction=0.5, shared_prefix_tokens=1024).load_identity()
    )


# --- prompts and plans ------------------------------------------------------------------------


def test_prompt_words_are_distinct_common_lowercase_words() -> None:
    assert len(PROMPT_WORDS) >= 300
    assert len(set(PROMPT_WORDS)) == len(PROMPT_WORDS)
    assert all(word.isascii() and word.isalpha() and word.islower() for word in PROMPT_WORDS)


def test_word_prompt_builder_gives_the_asked_number_of_words() -> None:
    builder = WordPromptBuilder()
    rng = random.Random(5)
    for tokens in (1, 7, 300):
        words = builder.text(tokens, rng).split(" ")
        assert len(words) == tokens
        assert set(words) <= set(PROMPT_WORDS)


def test_plan_is_the_same_whatever_the_order_and_the_planner() -> None:
    config = _config(
        prompt_tokens=LengthDistribution("uniform", 4, 40),
        output_tokens=LengthDistribution("normal", 30, 10),
        shared_prefix_fraction=0.5,
        shared_prefix_tokens=32,
        seed=7,
    )
    forward = [RequestPlanner(config, model=_MODEL).plan(i) for i in range(40)]
    shuffled_indices = list(range(40))
    random.Random(99).shuffle(shuffled_indices)
    other = RequestPlanner(config, model=_MODEL)
    by_index = {i: other.plan(i) for i in shuffled_indices}
    assert [by_index[i] for i in range(40)] == forward
    assert len({plan.body for plan in forward}) == 40
    assert [plan.index for plan in forward] == list(range(40))

    reseeded = RequestPlanner(dataclasses.replace(config, seed=8), model=_MODEL)
    differing = sum(reseeded.plan(i).body != forward[i].body for i in range(40))
    assert differing == 40


def test_lengths_follow_the_distributions() -> None:
    config = _config(
        prompt_tokens=LengthDistribution("uniform", 5, 9),
        output_tokens=LengthDistribution("uniform", 20, 22),
    )
    planner = RequestPlanner(config, model=_MODEL)
    plans = [planner.plan(i) for i in range(300)]
    assert {plan.prompt_tokens_planned for plan in plans} == set(range(5, 10))
    assert {plan.max_tokens for plan in plans} == {20, 21, 22}
    for plan in plans:
        assert _body(plan)["max_tokens"] == plan.max_tokens
        (message,) = _messages(plan)
        assert len(message["content"].split(" ")) == plan.prompt_tokens_planned


def test_shared_prefix_fraction_is_realised_and_only_the_prefix_is_shared() -> None:
    config = _config(
        prompt_tokens=LengthDistribution("fixed", 12),
        shared_prefix_fraction=0.3,
        shared_prefix_tokens=48,
        seed=11,
    )
    planner = RequestPlanner(config, model=_MODEL)
    plans = [planner.plan(i) for i in range(2000)]
    shared = [plan for plan in plans if plan.shared_prefix]
    # Binomial standard error: sqrt(0.3 * 0.7 / 2000) = 0.010.
    assert len(shared) / len(plans) == pytest.approx(0.3, abs=0.04)

    prefix = planner.shared_prefix
    assert len(prefix.split(" ")) == 48
    own_texts = []
    for plan in plans:
        messages = _messages(plan)
        if plan.shared_prefix:
            assert messages[0] == {"role": "system", "content": prefix}
            assert plan.prompt_tokens_planned == 48 + 12
        else:
            assert [message["role"] for message in messages] == ["user"]
            assert plan.prompt_tokens_planned == 12
        assert messages[-1]["role"] == "user"
        own_texts.append(messages[-1]["content"])
    assert len(set(own_texts)) == len(plans)

    # The prefix is built from the seed: the same for another planner, another for another seed.
    assert RequestPlanner(config, model=_MODEL).shared_prefix == prefix
    assert RequestPlanner(dataclasses.replace(config, seed=12), model=_MODEL).shared_prefix != (
        prefix
    )


def test_changing_the_prefix_fraction_keeps_each_requests_own_text() -> None:
    without = RequestPlanner(_config(seed=3), model=_MODEL)
    with_prefix = RequestPlanner(_config(seed=3, shared_prefix_fraction=0.5), model=_MODEL)
    for index in range(30):
        assert _messages(without.plan(index))[-1] == _messages(with_prefix.plan(index))[-1]


def test_completions_prompt_is_prefix_then_own_text() -> None:
    config = _config(
        api=API_COMPLETIONS,
        prompt_tokens=LengthDistribution("fixed", 10),
        shared_prefix_fraction=0.5,
        shared_prefix_tokens=20,
    )
    planner = RequestPlanner(config, model=_MODEL)
    plans = [planner.plan(i) for i in range(100)]
    assert {plan.shared_prefix for plan in plans} == {True, False}
    own_texts = set()
    for plan in plans:
        prompt = _body(plan)["prompt"]
        assert isinstance(prompt, str)
        if plan.shared_prefix:
            assert prompt.startswith(planner.shared_prefix + " ")
            own = prompt[len(planner.shared_prefix) + 1 :]
        else:
            own = prompt
            assert not prompt.startswith(planner.shared_prefix)
        assert len(own.split(" ")) == 10
        own_texts.add(own)
    assert len(own_texts) == len(plans)


def test_chat_and_completions_bodies() -> None:
    chat = RequestPlanner(_config(), model=_MODEL).plan(0)
    assert chat.path == "/v1/chat/completions"
    assert chat.operation == semconv.OPERATION_CHAT
    body = _body(chat)
    assert body["model"] == _MODEL
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert body["max_tokens"] == 64
    assert "prompt" not in body
    assert len(_messages(chat)) == 1

    completion = RequestPlanner(_config(api=API_COMPLETIONS), model=_MODEL).plan(0)
    assert completion.path == "/v1/completions"
    assert completion.operation == semconv.OPERATION_TEXT_COMPLETION
    body = _body(completion)
    assert isinstance(body["prompt"], str)
    assert "messages" not in body
    assert body["model"] == _MODEL
    # The same request index draws the same text whichever API carries it.
    assert body["prompt"] == _messages(chat)[0]["content"]


def test_stream_options_only_when_streaming_and_ignore_eos_only_when_set() -> None:
    body = _body(RequestPlanner(_config(stream=False, ignore_eos=False), model=_MODEL).plan(0))
    assert body["stream"] is False
    assert "stream_options" not in body
    assert "ignore_eos" not in body


def test_body_is_compact_json_in_a_stable_key_order() -> None:
    planner = RequestPlanner(_config(), model="modèle")
    plan = planner.plan(3)
    decoded = json.loads(plan.body)
    assert plan.body == json.dumps(decoded, separators=(",", ":"), ensure_ascii=False).encode()
    assert "modèle".encode() in plan.body
    assert list(decoded) == list(_body(RequestPlanner(_config(), model="m").plan(9)))


def test_warmup_plans_have_negative_indices_and_their_own_texts() -> None:
    planner = RequestPlanner(_config(warmup_requests=3), model=_MODEL)
    warmup = planner.warmup()
    assert [plan.index for plan in warmup] == [-1, -2, -3]
    measured = {planner.plan(i).body for i in range(10)}
    assert not measured & {plan.body for plan in warmup}
    assert RequestPlanner(_config(), model=_MODEL).warmup() == []


def test_planner_validates_its_inputs() -> None:
    with pytest.raises(WorkloadError, match=r"^--concurrency: "):
        RequestPlanner(_config(concurrency=0), model=_MODEL)
    with pytest.raises(WorkloadError, match=r"^--model: "):
        RequestPlanner(_config(), model="")


class _CountingBuilder:
    """A custom builder: the planner uses it for every text."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def text(self, tokens: int, rng: random.Random) -> str:
        self.calls.append(tokens)
        return "x" * tokens + str(rng.random())


def test_planner_uses_a_given_builder() -> None:
    builder = _CountingBuilder()
    planner = RequestPlanner(
        _config(shared_prefix_fraction=1.0, shared_prefix_tokens=9),
        model=_MODEL,
        builder=builder,
    )
    assert builder.calls == [9]
    plan = planner.plan(0)
    assert _messages(plan)[-1]["content"].startswith("x" * 128)
    assert builder.calls == [9, 128]


# --- arrivals ---------------------------------------------------------------------------------


def test_poisson_offsets_have_exponential_gaps() -> None:
    rate = 50.0
    offsets = arrival_offsets_s(rate, seed=1)
    times = [next(offsets) for _ in range(20_000)]
    assert times[0] > 0
    gaps = [later - earlier for earlier, later in zip([0.0, *times], times, strict=False)]
    assert all(gap > 0 for gap in gaps)
    mean_gap = statistics.fmean(gaps)
    # The relative standard error of the mean of 20000 exponential gaps is 0.7%.
    assert mean_gap == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pstdev(gaps) / mean_gap == pytest.approx(1.0, abs=0.05)


def test_poisson_offsets_are_deterministic_from_the_seed() -> None:
    def first(seed: int) -> list[float]:
        offsets = arrival_offsets_s(2.0, seed=seed)
        return [next(offsets) for _ in range(50)]

    assert first(4) == first(4)
    assert first(4) != first(5)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_poisson_offsets_reject_a_bad_rate_at_once(rate: float) -> None:
    with pytest.raises(WorkloadError, match=r"^--rate: "):
        arrival_offsets_s(rate, seed=0)


# --- datasets ---------------------------------------------------------------------------------


def test_read_dataset_reads_prompts_messages_and_output_lengths(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "hello there", "id": "extra keys are ignored"}),
            "",
            "   ",
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "what is two plus two"},
                    ],
                    "output_tokens": 5,
                }
            ),
            json.dumps({"prompt": "naïve café", "output_tokens": 1}),
        ],
    )
    entries = read_dataset(path)
    assert [entry.line for entry in entries] == [1, 4, 5]
    assert entries[0].prompt == "hello there"
    assert entries[0].output_tokens is None
    assert entries[1].prompt is None
    assert entries[1].messages is not None
    assert [(m.role, m.content) for m in entries[1].messages] == [
        ("system", "be brief"),
        ("user", "what is two plus two"),
    ]
    assert entries[1].output_tokens == 5
    assert entries[2].prompt == "naïve café"


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"text": "x"}', "exactly one of"),
        ('{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "exactly one of"),
        ('{"prompt": ""}', "prompt"),
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": "lone \\ud800 surrogate"}', "prompt"),
        ('{"messages": [{"role": "user", "content": "\\udc00"}]}', r"messages\[0\]"),
        ('{"messages": []}', "messages"),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\]"),
        ('{"messages": [{"role": "user", "content": "a"}, "hi"]}', r"messages\[1\]"),
        ('{"prompt": "x", "output_tokens": 0}', "output_tokens"),
        ('{"prompt": "x", "output_tokens": true}', "output_tokens"),
        ('{"prompt": "x", "output_tokens": 2.5}', "output_tokens"),
    ],
)
def test_read_dataset_names_the_file_and_line_of_a_bad_entry(
    tmp_path: Path, bad_line: str, match: str
) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", ['{"prompt": "fine"}', "", bad_line])
    with pytest.raises(WorkloadError, match=match) as raised:
        read_dataset(path)
    assert f"{path}:3: " in str(raised.value)


def test_read_dataset_rejects_unreadable_empty_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"^--dataset: cannot read"):
        read_dataset(str(tmp_path / "missing.jsonl"))
    empty = _write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(WorkloadError, match="no entries"):
        read_dataset(empty)
    binary = tmp_path / "latin1.jsonl"
    binary.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(WorkloadError, match=r":2: not UTF-8"):
        read_dataset(str(binary))


def test_read_dataset_refuses_more_than_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompts, "MAX_DATASET_ENTRIES", 3)
    path = _write_lines(tmp_path / "d.jsonl", ['{"prompt": "p"}'] * 3)
    assert len(read_dataset(path)) == 3
    longer = _write_lines(tmp_path / "e.jsonl", ['{"prompt": "p"}'] * 4)
    with pytest.raises(WorkloadError, match=r":4: more than 3 entries"):
        read_dataset(longer)


def _dataset(tmp_path: Path, count: int) -> str:
    lines = []
    for number in range(count):
        if number % 2:
            entry: dict[str, object] = {"prompt": f"prompt number {number}"}
        else:
            entry = {
                "messages": [
                    {"role": "system", "content": "sys"},
                    {"role": "user", "content": f"question number {number}"},
                ],
                "output_tokens": number + 1,
            }
        lines.append(json.dumps(entry))
    return _write_lines(tmp_path / "data.jsonl", lines)


def _entry_key(plan: RequestPlan) -> str:
    return _messages(plan)[-1]["content"]


def test_dataset_plans_cover_every_entry_once_per_pass(tmp_path: Path) -> None:
    path = _dataset(tmp_path, 6)
    config = _config(dataset=path, output_tokens=LengthDistribution("fixed", 777), seed=1)
    planner = RequestPlanner(config, model=_MODEL)
    assert planner.dataset_size == 6
    first_pass = [_entry_key(planner.plan(i)) for i in range(6)]
    assert len(set(first_pass)) == 6
    assert [_entry_key(planner.plan(i)) for i in range(6, 12)] == first_pass
    reseeded = RequestPlanner(dataclasses.replace(config, seed=2), model=_MODEL)
    other_pass = [_entry_key(reseeded.plan(i)) for i in range(6)]
    assert sorted(other_pass) == sorted(first_pass)

    for index in range(6):
        plan = planner.plan(index)
        messages = _messages(plan)
        assert plan.shared_prefix is False
        assert plan.prompt_tokens_planned >= 1
        if messages[-1]["content"].startswith("question"):
            number = int(messages[-1]["content"].split()[-1])
            assert messages == [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": f"question number {number}"},
            ]
            assert plan.max_tokens == number + 1
        else:
            assert [message["role"] for message in messages] == ["user"]
            assert plan.max_tokens == 777


def test_dataset_seeds_give_different_orders(tmp_path: Path) -> None:
    path = _dataset(tmp_path, 40)
    orders = {
        tuple(
            _entry_key(plan)
            for plan in map(
                RequestPlanner(_config(dataset=path, seed=seed), model=_MODEL).plan, range(40)
            )
        )
        for seed in range(3)
    }
    assert len(orders) == 3


def test_completions_with_dataset_prompts_and_refusal_of_messages(tmp_path: Path) -> None:
    prompt_only = _write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "just text"})])
    plan = RequestPlanner(_config(dataset=prompt_only, api=API_COMPLETIONS), model=_MODEL).plan(0)
    assert _body(plan)["prompt"] == "just text"

    mixed = _dataset(tmp_path, 3)
    with pytest.raises(WorkloadError, match=r"data\.jsonl:1: a 'messages' entry"):
        RequestPlanner(_config(dataset=mixed, api=API_COMPLETIONS), model=_MODEL)


# --- tokenizer --------------------------------------------------------------------------------


def _train_tiny_tokenizer(directory: Path, *, with_transformers: bool) -> None:
    """A byte-level BPE trained on a few KB of text, saved as ``tokenizer.json`` alone or, with
    transformers, as ``save_pretrained`` writes it for ``AutoTokenizer``."""
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is missing")
    corpus = [
        " ".join(random.Random(seed).choices(PROMPT_WORDS, k=60)) + " 12, 345. (x)! café"
        for seed in range(80)
    ]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    directory.mkdir()
    if with_transformers:
        transformers = pytest.importorskip("transformers", reason="transformers is missing")
        wrapped = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token="<|endoftext|>"
        )
        wrapped.save_pretrained(str(directory))
    else:
        tokenizer.save(str(directory / "tokenizer.json"))


def _check_exact_lengths(directory: Path) -> None:
    builder = TokenizerPromptBuilder(str(directory))
    rng = random.Random(0)
    for tokens in (1, 2, 17, 64, 200):
        text = builder.text(tokens, rng)
        assert builder.count_tokens(text) == tokens
        assert "<|endoftext|>" not in text
        assert "\ufffd" not in text

    config = _config(
        tokenizer=str(directory),
        prompt_tokens=LengthDistribution("uniform", 10, 30),
        shared_prefix_fraction=1.0,
        shared_prefix_tokens=25,
    )
    planner = RequestPlanner(config, model=_MODEL)
    assert builder.count_tokens(planner.shared_prefix) == 25
    for index in range(10):
        plan = planner.plan(index)
        own = _messages(plan)[-1]["content"]
        assert builder.count_tokens(own) + 25 == plan.prompt_tokens_planned


def test_tokenizer_prompt_builder_gives_exact_lengths_from_a_tokenizer_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without transformers (importing it takes seconds) a tokenizer.json is read by tokenizers.
    monkeypatch.setitem(sys.modules, "transformers", None)
    directory = tmp_path / "tiny-tokenizer"
    _train_tiny_tokenizer(directory, with_transformers=False)
    _check_exact_lengths(directory)


@pytest.mark.slow
def test_tokenizer_prompt_builder_gives_exact_lengths_through_transformers(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "tiny-tokenizer"
    _train_tiny_tokenizer(directory, with_transformers=True)
    _check_exact_lengths(directory)
    # What the planner loaded is transformers' tokenizer, not the tokenizer.json fallback.
    assert "transformers" in sys.modules


@pytest.mark.slow  # imports transformers: ~10 s
def test_tokenizer_prompt_builder_explains_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(WorkloadError, match=r"^--tokenizer: "):
        TokenizerPromptBuilder(str(tmp_path / "no-such-tokenizer"))
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(WorkloadError, match=r"^--tokenizer: needs the 'transformers' package"):
        TokenizerPromptBuilder(str(tmp_path))


def test_module_import_stays_light() -> None:
    code = (
        "import sys, tokentrace.loadgen.workload; "
        "print(sorted({'transformers', 'tokenizers'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert result.stdout.strip() == "[]"
