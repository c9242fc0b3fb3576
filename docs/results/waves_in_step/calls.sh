# Session 16 (issue 26): the attention calls replayed alone (the per-call targets), the plan's rule against
# one wave, after long rows left one wave for the step's sake (kernels/decode/waves.py). One H100, one call.
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 240 python3 -m eval.bench.text_attention --contexts 32768 --batches 16 --layouts smollm2,internvl2.5-8b \
  --no-baselines --ab MMKV_TEXT_WAVES=,1 --out $OUT/h100_text_attention_b16_waves.json 2>&1 | grep -v -i warn | tail -30
timeout 200 python3 -m eval.bench.skvq_attention --shapes internvl2.5-8b,smollm2-135m --tokens 32768 --batches 16 \
  --groups 64 --variants var --kernels gluon --graphs --timer unrolled --iters 20 --ab "rule:,one:MMKV_SKVQ_WAVES=1" --out $OUT/h100_skvq_attention_b16_waves.json \
  2>&1 | grep -v -i warn | tail -30
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
