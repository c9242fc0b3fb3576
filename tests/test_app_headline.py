"""The stats headline compares like with like (issue 32, item 2): bytes in use against a plain cache of the same
tokens in the same dtype, named; reserved bytes apart. Expected strings are worked out by hand from the numbers."""

from __future__ import annotations

import pytest

from mmkv.ui import examples, stats

# Measured on SmolLM2 (CPU, fp32) for the first example with the default spec: 224 tokens in 2-bit KIVI, 163 in the
# sinks and window. Held bytes include the window's spare capacity; the fp32 baseline holds none.
LONG = {"cache_bytes": {"visual": 0, "text": 1_244_280, "fp16": 14_930_040},
        "cache_bytes_used": {"visual": 0, "text": 967_680, "fp16": 7_511_040},
        "cache_tokens": {"visual": 0, "text": 224, "fp16": 163}, "prompt_tokens": {"visual": 0, "text": 324},
        "fp16_equivalent_bytes": 17_832_960, "cache_dtype": "fp32", "effective_bits": {"total": 15.21}}
# A one-line question: every token in the window, held 4_239_480 bytes against 3_548_160 in use.
SHORT = {"cache_bytes": {"visual": 0, "text": 0, "fp16": 4_239_480},
         "cache_bytes_used": {"visual": 0, "text": 0, "fp16": 3_548_160},
         "cache_tokens": {"visual": 0, "text": 0, "fp16": 77}, "prompt_tokens": {"visual": 0, "text": 46},
         "fp16_equivalent_bytes": 3_548_160, "cache_dtype": "fp32"}


def test_headline_compares_bytes_in_use_in_the_same_dtype():
    # 967_680 + 7_511_040 = 8_478_720 B = 8.09 MiB; 17_832_960 / 8_478_720 = 2.10; 16_174_320 B = 15.43 MiB held
    assert stats.headline(LONG) == ("KV cache 8.09 MiB in use · 2.1× smaller than a plain fp32 cache of the same "
                                    "tokens (17.01 MiB) · 15.43 MiB reserved")


def test_headline_says_when_nothing_is_quantized_yet():
    assert stats.headline(SHORT) == ("KV cache 3.38 MiB in use · about the size of a plain fp32 cache of the same "
                                     "tokens (3.38 MiB) · 4.04 MiB reserved · every token is still in the fp32 sinks "
                                     "and window: nothing is quantized yet")


def test_panel_names_the_window_dtype_and_bars_compare_bytes_in_use():
    html = stats.stats_html(LONG)
    assert 'data-bytes="8478720" data-reserved="16174320"' in html
    assert "sinks + window (fp32)" in html
    mem, _ = stats.compare_frames(LONG, None)
    assert list(mem["run"]) == ["fp32 cache", "quantized"]
    assert list(mem["KV cache MiB"].round(2)) == [17.01, 8.09]


@pytest.mark.slow
def test_first_example_leaves_the_fp16_window(smollm2):
    """Default spec: window=128, sinks=4; the chat template adds a system turn, so count the templated prompt."""
    lm = smollm2
    ids = lm.prepare([{"role": "user", "content": examples.collect()[0]["text"]}]).input_ids
    assert ids.shape[1] > 128 + 4 + 64  # leaves the window even after the app's 64 default new tokens
