"""`DecoderOnlyLLM.capabilities`: what a model runs batched, declared instead of tried."""

from __future__ import annotations

import pytest

from ferrum_mac.llm import Capabilities, DecoderOnlyLLM, LlmRuntimeConfig
from helpers import BACKENDS


class Plain(DecoderOnlyLLM):
    """A model of the required methods only: one sequence at a time."""

    config = LlmRuntimeConfig(8, 1, 1, 8, 16, 32)

    def prefill(self, cache_id, tokens):
        raise NotImplementedError

    def decode(self, cache_id, token, pos):
        raise NotImplementedError

    def release(self, cache_id):
        pass

    def kv_len(self, cache_id):
        return 0


class Batched(Plain):
    def decode_batch(self, items):
        raise NotImplementedError


def test_a_model_of_the_required_methods_runs_nothing_batched():
    assert Plain().capabilities == Capabilities(unified_forward=False, batched_decode=False, batched_verify=False)


def test_capabilities_follow_the_batched_methods_a_class_overrides():
    assert Batched().capabilities == Capabilities(unified_forward=False, batched_decode=True, batched_verify=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pooled_backends_run_everything_batched(zoo, backend):
    model = zoo.ferrum("llama", backend)
    assert model.capabilities == Capabilities(unified_forward=True, batched_decode=True, batched_verify=True)
