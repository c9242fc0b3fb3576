"""The text-oracle study's description and lenient scorer (eval/studies/text_oracle.py, issue 28)."""

from eval.studies.text_oracle import chat, contains, describe, samples_with_descriptions
from eval.synth import generate


def test_contains_reads_number_words_and_needs_the_whole_answer():
    assert contains("There are three shapes.", "3")
    assert contains('The text says "bridge yellow candle"', "bridge yellow candle")
    assert contains("12.50", "12.50")
    assert not contains("bridge", "bridge yellow candle")
    assert not contains("The background is a shade of blue.", "beige")
    assert not contains("thirty", "3")


def test_scene_description_holds_every_object_and_can_sort_by_x():
    it = next(i for i in generate("scene", 8, 1000) if len(i.meta["objects"]) >= 3)
    text = describe("scene", it.meta, it.caption)
    assert it.meta["background"] in text
    for o in it.meta["objects"]:
        assert f"{o['size']} {o['colour']} {o['shape']}" in text and f"x={round(o['x'])}" in text
    by_x = describe("scene", it.meta, it.caption, by_x=True)
    xs = sorted(it.meta["objects"], key=lambda o: o["x"])
    where = [by_x.index(f"{o['colour']} {o['shape']}") for o in xs]
    assert where == sorted(where) and "left to right" in by_x


def test_chart_and_card_descriptions_hold_the_answers():
    chart = generate("chart", 1, 1000)[0]
    text = describe("chart", chart.meta, chart.caption)
    assert all(f"{lab} = {v}" in text for lab, v in zip(chart.meta["labels"], chart.meta["values"], strict=True))
    card = generate("text", 1, 1000)[0]
    assert f'"{card.meta["text"]}"' in describe("text", card.meta, card.caption)


def test_samples_carry_their_own_items_description_and_shots_come_first():
    samples = samples_with_descriptions(12, 1000, by_x=False)
    assert len(samples) >= 10
    for x in samples:
        kind, j, _ = x["id"].split("/")
        it = generate(kind, int(j) + 1, 1000)[int(j)]
        assert x["description"] == describe(kind, it.meta, it.caption)
    turns = chat(samples[0], "shots")
    assert [t["role"] for t in turns] == ["user", "assistant"] * 3 + ["user"]
    assert turns[-1]["content"].startswith(f"Image: {samples[0]['description']}")
    assert chat(samples[0], "plain") == [{"role": "user", "content":
                                         f"Image: {samples[0]['description']}\n\nQuestion: {samples[0]['question']}"}]
