"""Option validation: one place, clear messages naming the value and the forms."""

from __future__ import annotations

import pytest

import barrierguard
from barrierguard.session.options import parse_allow


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"policy": "loud"},
            "watch(policy='loud') is not a valid policy: expected one of 'record', 'warn', 'error'",
        ),
        (
            {"engine": "gpu"},
            "watch(engine='gpu') is not a valid engine: expected one of 'auto', 'cuda', 'audit'",
        ),
        ({"warmup_steps": -1}, "watch(warmup_steps=-1) is not valid: expected a non-negative int"),
        ({"warmup_steps": True}, "watch(warmup_steps=True) is not valid"),
        (
            {"max_syncs_per_step": "2"},
            "watch(max_syncs_per_step='2') is not valid: expected a non-negative int or None",
        ),
        ({"allow": ["itme"]}, "allow rule 'itme' is malformed (did you mean 'item'?)"),
        ({"allow": ["train.py:x"]}, "allow rule 'train.py:x' is malformed"),
        ({"allow": ["train.py:9-3"]}, "allow rule 'train.py:9-3' is malformed"),
        ({"allow": [":12"]}, "allow rule ':12' is malformed"),
        ({"allow": [3]}, "allow rule 3 is not a string"),
    ],
)
def test_bad_options_name_the_value_and_the_forms(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(barrierguard.BarrierGuardError) as info:
        barrierguard.watch(**kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value)


def test_malformed_allow_lists_accepted_forms() -> None:
    with pytest.raises(barrierguard.BarrierGuardError) as info:
        barrierguard.watch(allow=["nonsense"])
    message = str(info.value)
    # What a valid rule looks like comes first, the list of kinds last.
    assert message.startswith(
        "allow rule 'nonsense' is malformed: expected a line rule 'path/to/file.py:LINE'"
    )
    assert message.index("'train.py:40-50'") < message.index("framework:<name>")
    assert message.index("framework:<name>") < message.index("the kinds are")


def test_unknown_keyword_names_it_and_the_accepted_ones() -> None:
    with pytest.raises(TypeError) as info:
        barrierguard.watch(polcy="warn")
    message = str(info.value)
    assert "'polcy' (did you mean 'policy'?)" in message
    assert (
        "accepted: allow, capture_probe, engine, max_growth_per_step, max_syncs_per_step,"
        in message
    )


def test_positional_non_callable_is_refused() -> None:
    with pytest.raises(barrierguard.BarrierGuardError, match="pass options by keyword"):
        barrierguard.watch("error")


@pytest.mark.parametrize(
    ("env", "expected"), [(None, "warn"), ("error", "error"), (" Record ", "record"), ("", "warn")]
)
def test_policy_from_environment(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: str
) -> None:
    if env is None:
        monkeypatch.delenv("BARRIERGUARD_POLICY", raising=False)
    else:
        monkeypatch.setenv("BARRIERGUARD_POLICY", env)
    assert barrierguard.watch().options.policy == expected
    assert barrierguard.watch(policy="record").options.policy == "record"


def test_bad_policy_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BARRIERGUARD_POLICY", "strict")
    with pytest.raises(
        barrierguard.BarrierGuardError, match="BARRIERGUARD_POLICY='strict' is not a valid policy"
    ):
        barrierguard.watch()


def test_cuda_engine_without_cuda_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from barrierguard import _env

    monkeypatch.setattr(_env, "cuda_available", lambda: False)
    guard = barrierguard.watch(engine="cuda")
    with pytest.raises(
        barrierguard.BarrierGuardError, match=r"engine='cuda'.* needs a CUDA device"
    ):
        guard.start()
    assert not guard.is_running


@pytest.mark.parametrize(
    ("rule", "site", "allowed"),
    [
        ("item", ("/w/train.py", 3, "item", "user"), True),
        ("item", ("/w/train.py", 3, "tolist", "user"), False),
        ("user", ("/w/train.py", 3, "item", "user"), True),
        ("framework:lightning", ("/w/t.py", 1, "copy", "framework:lightning"), True),
        ("framework:torch", ("/w/t.py", 1, "item", "framework:torch.amp"), True),
        ("framework:torch", ("/w/t.py", 1, "item", "framework:torchmetrics"), False),
        ("framework:*", ("/w/t.py", 1, "item", "framework:torchmetrics"), True),
        ("framework:*", ("/w/t.py", 1, "item", "user"), False),
        ("mypkg/metrics.py:*", ("/src/mypkg/metrics.py", 7, "item", "user"), True),
        ("mypkg/metrics.py:*", ("/src/otherpkg/metrics.py", 7, "item", "user"), False),
        ("train.py:42", ("/w/train.py", 42, "item", "user"), True),
        ("train.py:42", ("/w/train.py", 43, "item", "user"), False),
        ("train.py:40-50", ("/w/train.py", 45, "bool", "user"), True),
        ("train.py:40-50", ("/w/train.py", 51, "bool", "user"), False),
        ("*/loops/*.py:*", ("/w/loops/fit.py", 1, "item", "user"), True),
    ],
)
def test_allow_rule_matching(rule: str, site: tuple[str, int, str, str], allowed: bool) -> None:
    assert parse_allow(rule).matches(*site) is allowed


def test_single_string_allow_is_one_rule() -> None:
    assert [r.kind for r in barrierguard.watch(allow="item").options.allow] == ["item"]
