"""The perfect-perception study's pieces (eval/studies/oracle_tokens.py, issue 28) on a tiny random Llama."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.studies import oracle_tokens as ot
from eval.synth import generate

END = 3


class CharTok:
    """Characters as ids (offset 4); id 3 is the turn end."""

    def apply_chat_template(self, chat, tokenize=False, add_generation_prompt=True):
        return "[sys][user]" + chat[0]["content"] + "[end][assistant]"

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [4 + min(ord(c), 120) for c in text]
        return type("Enc", (), {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids})()

    def convert_tokens_to_ids(self, token):
        return END

    def decode(self, ids):
        return "".join(chr(i - 4) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2)  # logits far from uniform, so the tokens can move them
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return model, ot.Prompt(CharTok(), model, torch.device("cpu"))


def test_features_hold_every_object_in_its_slot():
    metas = [it.meta for it in generate("scene", 6, 1000)]
    f = ot.features(metas)
    for i, m in enumerate(metas):
        assert int(f["present"][i].sum()) == len(m["objects"])
        for j, o in enumerate(m["objects"]):
            assert sorted(ot.COLOURS)[int(f["colour"][i, j])] == o["colour"]
            assert ot.SHAPES[int(f["shape"][i, j])] == o["shape"]
            assert int(f["xbin"][i, j]) == int(o["x"] / ot.SIZE * ot.BINS)
        assert sorted(ot.BACKGROUNDS)[int(f["background"][i])] == m["background"]


def test_labels_mark_the_answer_and_turn_end_one_position_early(tiny):
    model, prompt = tiny
    vis = torch.randn(2, 1 + ot.SLOTS * ot.PER_OBJECT, 64)
    x, y, lens = ot.embed_rows(model, prompt, vis, [("Is it red?", "no"), ("How many?", "12")], with_answer=True)
    for r, (q, a) in enumerate([("Is it red?", "no"), ("How many?", "12")]):
        tail = prompt.tail(q)
        first = vis.shape[1] + len(tail) - 1  # the position that predicts the answer's first token
        want = CharTok()(a).input_ids + [END]
        assert y[r, first:first + len(want)].tolist() == want
        assert (y[r, :first] == -100).all() and (y[r, first + len(want):] == -100).all()
        assert lens[r] == vis.shape[1] + len(tail) + len(want)
        emb = model.get_input_embeddings()
        assert torch.equal(x[r, vis.shape[1]:lens[r]], emb(torch.tensor(tail + want)))


def test_the_encoder_learns_a_fixed_batch_and_answers(tiny):
    model, prompt = tiny
    torch.manual_seed(1)
    enc = ot.OracleEncoder(64, scale=float(model.get_input_embeddings().weight.norm(dim=-1).median()))
    opt = torch.optim.AdamW(enc.parameters(), lr=3e-3)
    rows = ot.train_rows(3, 11)[:8]
    metas, qa = [m for m, _, _ in rows], [(q, a) for _, q, a in rows]
    first = None
    for _ in range(60):
        loss = ot.answer_loss(model, prompt, enc, metas, qa, torch.device("cpu"))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first  # gradients reach the encoder through the frozen model
    assert all(p.grad is None for p in model.parameters())
    out = ot.answer(model, prompt, enc, metas[0], qa[0][0], torch.device("cpu"), max_new=4)
    assert isinstance(out, str) and len(out) <= 4
