"""The contract's host inputs on every installed backend: what is not a token id or a position
is refused with a one-line `FerrumError` before any cache changes (never a `TypeError`, a
truncated float or `True` read as 1), an empty batch is refused, and a device token outside
the vocabulary is clipped into it instead of read past the embedding (a segfault on MLX, a
device assert on CUDA)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import DecodeItem, ForwardItem
from helpers import BACKENDS, assert_close

NOT_IDS = [[1.5, 2], [True, 3], [4, False], "abc", None, 7.0, [None], [[1, 2]], [np.float32(3.0)], b"\x01\x02"]
NOT_A_TOKEN = ["5", None, 5.0, True, [1.5], np.float64(2.0)]


@pytest.fixture(params=BACKENDS)
def model(request, zoo):
    return zoo.ferrum("llama", request.param)


def refused(call) -> str:
    with pytest.raises(FerrumError) as err:
        call()
    message = str(err.value)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize("tokens", NOT_IDS, ids=repr)
def test_prompts_of_anything_but_ids_are_refused(model, tokens):
    cid = "inputs-prompt"
    for call in (
        lambda: model.prefill(cid, tokens),
        lambda: model.forward_verify(cid, tokens),
        lambda: model.unified_forward([ForwardItem(cid, tokens, 0)]),
    ):
        refused(call)
        assert model.state.length(cid) == 0
    model.release(cid)


@pytest.mark.parametrize("token", NOT_A_TOKEN, ids=repr)
def test_decode_of_anything_but_a_token_is_refused(model, token):
    cid = "inputs-decode"
    model.prefill(cid, [4, 5])
    refused(lambda: model.decode(cid, token, 2))
    refused(lambda: model.decode_batch([DecodeItem(cid, token, 2)]))
    assert model.state.length(cid) == 2
    model.release(cid)


@pytest.mark.parametrize("pos", ["2", None, 2.0, True], ids=repr)
def test_positions_must_be_whole_numbers(model, pos):
    cid = "inputs-pos"
    model.prefill(cid, [4] if pos is True else [4, 5])  # True must not pass for position 1
    refused(lambda: model.decode(cid, 6, pos))
    refused(lambda: model.unified_forward([ForwardItem(cid, [6], pos)]))
    model.release(cid)


def test_empty_batches_are_refused(model):
    assert "at least one" in refused(lambda: model.decode_batch([]))
    assert "at least one" in refused(lambda: model.unified_forward([]))


def test_numpy_ids_are_ids(model):
    a, b = "inputs-np-a", "inputs-np-b"
    assert_close(model.prefill(a, np.array([4, 5, 6])), model.prefill(b, [4, 5, 6]), 1e-6)
    assert_close(model.decode(a, np.int32(7), 3), model.decode(b, 7, 3), 1e-6)
    model.release(a)
    model.release(b)


DEVICE_TOKEN_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import ferrum_mac
from ferrum_mac.llm import DecodeItem
from helpers import device_array, to_np, argmax

model = ferrum_mac.open_model({path!r}, backend={backend!r}, dtype="float32")
vocab = model.config.vocab_size
logits = model.prefill("a", [4, 5])
model.prefill("last", [4, 5])
want = to_np(model.decode("last", vocab - 1, 2))
got = to_np(model.decode("a", device_array(logits, 10**6), 2))  # clipped to the last id
assert abs(got - want).max() <= 1e-5 * abs(want).max(), "not clipped to the last id"
model.prefill("b", [4, 5])
rows = to_np(model.decode_batch([DecodeItem("a", device_array(logits, vocab), 3), DecodeItem("b", device_array(logits, -1), 2)]))
assert rows.shape == (2, vocab) and abs(rows).max() < 1e30
print("ok", model.state.length("a"), model.state.length("b"))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_tokens_outside_the_vocabulary_are_clipped(zoo, backend, tmp_path):
    """In a process of its own: the failure this guards against ends the process."""
    from pathlib import Path

    tests = str(Path(__file__).parent)
    script = DEVICE_TOKEN_SCRIPT.format(tests=tests, path=str(zoo.path("llama")), backend=backend)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["ok", "4", "3"]
