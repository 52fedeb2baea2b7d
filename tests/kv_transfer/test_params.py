"""kv_transfer_params: parsed into a typed value, checked, and written back as vLLM's JSON."""

from __future__ import annotations

import pytest

from pdserve.config import ConfigError, KVTransferConfig
from pdserve.kv_transfer.params import FirstToken, KVParams, ParamsValidator, PromptLogprob

GOOD = {"do_remote_prefill": True, "remote_engine_id": "prefill-a",
        "remote_block_ids": [7, 8, 9], "remote_request_id": "p1", "remote_host": "127.0.0.1",
        "remote_port": 5600, "first_token_id": 42, "first_token_logprob": -0.5,
        "first_token_top_logprobs": [[42, -0.5], [7, -1.5]]}


def validator(role: str = "kv_both") -> ParamsValidator:
    kv = KVTransferConfig.from_dict({"kv_role": role, "kv_connector_extra_config": {
        "allowed_remote_hosts": ["10.0.0.5"]}})
    return ParamsValidator.of(kv, block_size=4, vocab_size=1000, side_channel_host="127.0.0.1")


def test_a_prefills_answer_round_trips_through_json():
    p = KVParams.from_dict({**GOOD, "tp_size": 2, "remote_dp_rank": 0})  # unknown keys pass
    assert p.pulls and p.first_token == FirstToken(42, -0.5, [(42, -0.5), (7, -1.5)])
    assert p.to_dict() == {**GOOD, "tp_size": 2, "do_remote_decode": False}
    answer = KVParams.for_decode("e", "h", 1, "r", [3, 4], 1, FirstToken(5, -1.0))
    assert KVParams.from_dict(answer.to_dict()) == answer
    assert "first_token_top_logprobs" not in answer.to_dict()


def test_prompt_logprobs_travel_with_the_first_token():
    prompt = [PromptLogprob(-2.5, 3, [(9, -0.5), (4, -1.0)]), PromptLogprob(-0.1, 1)]
    answer = KVParams.for_decode("e", "h", 1, "r", [3], 1, FirstToken(5, -1.0, [], prompt))
    raw = answer.to_dict()
    assert raw["prompt_logprobs"] == [[-2.5, 3, [[9, -0.5], [4, -1.0]]], [-0.1, 1, []]]
    assert KVParams.from_dict(raw).first_token.prompt_logprobs == prompt
    validator()(KVParams.from_dict({**GOOD, "prompt_logprobs": raw["prompt_logprobs"]}), 3)


def test_incomplete_params_are_accepted_and_recomputed():
    p = KVParams.from_dict({"do_remote_prefill": True, "remote_host": "127.0.0.1"})
    validator()(p, 10)
    assert not p.complete and not p.pulls


@pytest.mark.parametrize(("bad", "word"), [
    ({"do_remote_decode": "yes"}, "boolean"),
    ({"remote_port": "5600"}, "remote_port"),
    ({"remote_block_ids": [1, -2, 3]}, "non-negative"),
    ({"remote_block_ids": "1,2"}, "non-negative"),
    ({"remote_engine_id": 5}, "remote_engine_id"),
    ({"first_token_id": True}, "first_token_id"),
    ({"first_token_logprob": "x"}, "first_token_logprob"),
    ({"first_token_top_logprobs": [[5]]}, "pairs"),
    ({"prompt_logprobs": [[-1.0, 1]]}, "prompt_logprobs"),
    ({"prompt_logprobs": [[-1.0, 1.5, []]]}, "prompt_logprobs"),
    ({"prompt_logprobs": [[-1.0, 1, [[5]]]]}, "prompt_logprobs"),
])
def test_malformed_values_are_refused_by_name(bad, word):
    with pytest.raises(ValueError, match=word):
        KVParams.from_dict({**GOOD, **bad})


@pytest.mark.parametrize(("bad", "word"), [
    ({"remote_host": "192.168.0.1"}, "not allowed"),
    ({"remote_block_ids": [1]}, "must be a multiple of the prefill's"),
    ({"remote_block_ids": list(range(7))}, "fills 3"),
    ({"remote_port": 70000}, "remote_port"),
    ({"first_token_id": 10**6}, "first_token_id"),
    ({"first_token_top_logprobs": [[10**6, -1.0]]}, "first_token_top_logprobs"),
    ({"do_remote_decode": True}, "exclusive"),
    ({"prompt_logprobs": [[-1.0, 1, []]]}, "1 entries for a 10-token prompt"),
    ({"prompt_logprobs": [[-1.0, 1, [[10**6, -1.0]]]] * 9}, "token ids of this model"),
])
def test_params_this_server_must_not_follow_are_refused(bad, word):
    with pytest.raises(ValueError, match=word):
        validator()(KVParams.from_dict({**GOOD, **bad}), 10)


def test_allowed_hosts_and_roles():
    validator()(KVParams.from_dict({**GOOD, "remote_host": "10.0.0.5"}), 10)
    validator()(KVParams.from_dict({**GOOD, "remote_host": "::1"}), 10)
    with pytest.raises(ValueError, match="KV producer"):
        validator("kv_producer")(KVParams.from_dict(GOOD), 10)
    validator("kv_producer")(KVParams(do_remote_decode=True), 10)


def test_allowed_remote_hosts_may_name_a_network():
    """A pod network: Kubernetes gives pods addresses nobody knows in advance."""
    kv = KVTransferConfig.from_dict({"kv_connector_extra_config": {
        "allowed_remote_hosts": ["10.244.0.0/16", "fd00:10::/64", "prefill-0"]}})
    check = ParamsValidator.of(kv, block_size=4, vocab_size=1000, side_channel_host="x")
    for host in ("10.244.3.7", "fd00:10::5", "prefill-0"):
        check(KVParams.from_dict({**GOOD, "remote_host": host}), 10)
    for host in ("10.245.0.1", "fd00:11::5", "prefill-1"):
        with pytest.raises(ValueError, match="not allowed"):
            check(KVParams.from_dict({**GOOD, "remote_host": host}), 10)
    for bad in (["10.244.0.0/33"], "10.0.0.0/8", [7]):
        with pytest.raises(ConfigError, match="allowed_remote_hosts"):
            KVTransferConfig.from_dict({"kv_connector_extra_config": {
                "allowed_remote_hosts": bad}})
