# Session 16's in-step checks of the wave plans (issue 26), one H100, one process per model:
#  0. the GPU tests of the whole-wave plan (long rows at 3 waves against the reference);
#  1. SKVQ K2/V1.5 B16 32k: its one-wave plan (MMKV_SKVQ_WAVES=1, the default) against the byte rule (0) and 3 waves;
#  2. KIVI-2 B1 32k: the `long2` one-wave split against no split (MMKV_TEXT_SPLIT=0);
#  3. SmolLM2 heads (random:smollm2-135m) KIVI-2 B16 32k: one wave (the plan) against 3 waves, and fp16's step.
# Each line: config, median step (graph replays) and the text kernels' us per call inside the step
# (docs/results/bisect_b16/step_kernels.py).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
S=docs/results/bisect_b16/step_kernels.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/test_text_gluon.py -k "waves or long_context" 2>&1 | tail -3
K="text=skvq:k_bits=2,v_bits=1.5,group=64|16|32768"
B="text=kivi:bits=2|1|32768"
timeout 260 python3 $S "$K|MMKV_SKVQ_WAVES=1" "$K|MMKV_SKVQ_WAVES=0" "$K|MMKV_SKVQ_WAVES=3" "$K|MMKV_SKVQ_WAVES=1" \
  "$K|MMKV_SKVQ_WAVES=3" "$B|" "$B|MMKV_TEXT_SPLIT=0" "$B|" "$B|MMKV_TEXT_SPLIT=0" 2>&1 | grep -v Warning
M="text=kivi:bits=2|16|32768"
MODEL=random:smollm2-135m timeout 150 python3 $S "$M|MMKV_TEXT_WAVES=1" "$M|MMKV_TEXT_WAVES=3" "$M|" \
  "$M|MMKV_TEXT_WAVES=3" "fp16|16|32768|" 2>&1 | grep -v Warning
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
