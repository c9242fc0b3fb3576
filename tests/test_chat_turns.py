"""Multi-turn chat over a stored cache (issue 33): with an fp16 cache nothing is lost, so a second turn prefilled
over the stored history must answer exactly what a fresh one-turn run of the same conversation answers.

The position the second turn starts at is pinned by definition: RoPE position ids count every token the model has
seen (no padding in a one-row chat), so the next token's position equals the number of ids fed so far.
"""

import pytest
import torch

from mmkv.engine import Engine

SPEC = "fp16 window=16 sinks=4"
TURN1 = [{"role": "user", "content": "Name three colours of the rainbow, then count from one to ten."}]


@pytest.fixture(scope="module")
def eng(smollm2):
    return Engine(smollm2)


@pytest.mark.slow
def test_second_turn_equals_a_fresh_run_of_the_same_history(eng):
    a = eng.generate(TURN1, spec=SPEC, max_new_tokens=10)
    assert a.next_position.tolist() == [a.fed_ids.shape[1]]  # position of the token not yet fed
    turn2 = TURN1 + [{"role": "assistant", "content": a.text[0]},
                     {"role": "user", "content": "Now list them backwards, one per line."}]
    seen = a.cache.get_seq_length()
    b = eng.generate(turn2, spec=SPEC, max_new_tokens=12, past=a)
    fresh = eng.generate(turn2, spec=SPEC, max_new_tokens=12)
    assert b.cache is a.cache and b.cache.get_seq_length() > seen
    # the history the second turn ran over is exactly the fresh run's prompt
    n = fresh.fed_ids.shape[1] - fresh.tokens.shape[1] + 1
    assert torch.equal(b.fed_ids[:, :n], fresh.fed_ids[:, :n])
    # positions count every id fed (the next one is at len(fed_ids)), in both runs
    assert b.next_position.tolist() == [b.fed_ids.shape[1]]
    assert fresh.next_position.tolist() == [fresh.fed_ids.shape[1]]
    assert b.cache.get_seq_length() == b.fed_ids.shape[1]
    assert torch.equal(b.tokens, fresh.tokens), (b.text, fresh.text)
    assert b.tokens.shape[1] >= 4  # enough tokens for a shifted position to show


@pytest.mark.slow
def test_third_turn_keeps_positions_counting(eng):
    """Two continuations in a row: positions keep counting the history, never restart or drift."""
    a = eng.generate(TURN1, spec=SPEC, max_new_tokens=4)
    msgs = TURN1 + [{"role": "assistant", "content": a.text[0]}, {"role": "user", "content": "Shorter."}]
    b = eng.generate(msgs, spec=SPEC, max_new_tokens=4, past=a)
    msgs = msgs + [{"role": "assistant", "content": b.text[0]}, {"role": "user", "content": "Thanks. Bye."}]
    c = eng.generate(msgs, spec=SPEC, max_new_tokens=6, past=b)
    fresh = eng.generate(msgs, spec=SPEC, max_new_tokens=6)
    assert c.next_position.tolist() == [c.fed_ids.shape[1]]
    assert torch.equal(c.tokens, fresh.tokens), (c.text, fresh.text)
