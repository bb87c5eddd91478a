"""Tests for lamina.sampling_params.SamplingParams."""

import math

import pytest

from lamina.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True
    assert not p.greedy


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy  # raised to 0.01, as vLLM
    assert not SamplingParams(temperature=0.1).greedy


def test_top_k_disabled_values():
    assert not SamplingParams(top_k=0).top_k_enabled
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled


def test_max_tokens_none_allowed():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_clone_is_independent():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3, temperature=0.5)
    q = p.clone()
    assert q == p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"n": 0}, "got 0"),
        ({"n": 2, "best_of": 1}, "best_of must be an int >= n = 2, got 1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": math.inf}, "inf"),
        ({"logit_bias": {5: float("inf")}}, "finite numbers, or -inf to ban a token, got inf for token 5"),
        ({"logit_bias": {5: float("nan")}}, "got nan for token 5"),
        ({"logit_bias": {"x": 1}}, "'x'"),
        ({"logit_bias": {-1: 1}}, "-1"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
        ({"allowed_token_ids": [1, -2]}, "-2"),
        ({"bad_words": ["ok", ""]}, "''"),
        ({"bad_words": [3]}, "3"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be an int >= 0, -1 (the whole vocabulary) or None, got -2"),
        ({"prompt_logprobs": 1.5}, "1.5"),
        ({"temperature": -0.5}, "-0.5"),
        ({"temperature": math.nan}, "nan"),
        ({"top_p": 0.0}, "(0, 1]"),
        ({"top_p": 1.5}, "1.5"),
        ({"top_p": -0.1}, "-0.1"),
        ({"top_k": -2}, "-2"),
        ({"top_k": 2.5}, "2.5"),
        ({"min_p": -0.1}, "-0.1"),
        ({"min_p": 1.1}, "1.1"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "-3"),
        ({"min_tokens": -1}, "-1"),
        ({"min_tokens": 20, "max_tokens": 10}, "20"),
        ({"logprobs": -2}, "logprobs must be an int >= 0, -1 (the whole vocabulary) or None, got -2"),
        ({"stop": ["ok", ""]}, "''"),
        ({"stop": ""}, "''"),
        ({"seed": 1.5}, "1.5"),
        ({"seed": "7"}, "'7'"),
    ],
)
def test_validation_errors_name_value(kwargs, needle):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert needle in str(excinfo.value)


def test_validation_messages_name_field_and_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 2"):
        SamplingParams(top_p=2)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=2.0)
    with pytest.raises(ValueError, match=r"n must be an int >= 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(in \[0, 10\]\)"):
        SamplingParams(min_tokens=11, max_tokens=10)


def test_valid_edge_values():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=-1, temperature=0.0, logprobs=0, min_tokens=16)
    SamplingParams(seed=-5, max_tokens=1)


def test_logprobs_spellings_and_low_temperatures(caplog):
    """vLLM's: -1 asks the whole vocabulary, True means 1; a temperature in (0, 0.01) is raised to
    0.01 with a warning (1e-6 too: only 0 is greedy)."""
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    both = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (both.logprobs, both.prompt_logprobs) == (1, 1)
    with caplog.at_level("WARNING", logger="lamina.sampling_params"):
        low = SamplingParams(temperature=0.003)
    assert low.temperature == 0.01 and not low.greedy
    assert "raised to 0.01" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lamina.sampling_params"):
        assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.01).temperature == 0.01
    assert not caplog.text
    tiny = SamplingParams(temperature=1e-6)
    assert tiny.temperature == 0.01 and not tiny.greedy


def test_parity_fields_normalised():
    assert SamplingParams(logit_bias={5: -1e9, 6: float("-inf"), 7: 250}).logit_bias[6] == float("-inf")  # as vLLM offline
    p = SamplingParams(n=2, logit_bias={"7": 1.5, 3: -100}, allowed_token_ids=(4, 5), bad_words="foo")
    assert p.best_of == 2
    assert p.logit_bias == {7: 1.5, 3: -100.0}
    assert p.allowed_token_ids == [4, 5]
    assert p.bad_words == ["foo"]
    assert not p.has_penalties and p.needs_output_tokens
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(n=2, best_of=5).best_of == 5
