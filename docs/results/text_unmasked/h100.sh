# Session 17 (issue 26): the Gluon text kernel's full iterations through an unmasked copy of its loop body
# (MMKV_TEXT_FULL=1, default) against every iteration masked (0), one H100:
#  0. GPU tests: the unmasked body bit-equal to the masked one, the kernel against the reference;
#  1. inside the decode step (graph replays, torch's profiler, variants interleaved): XQuant 1.375 and KIVI-2 B16
#     n32768, KIVI-2 B1 n32768 (random:internvl2.5-8b), KIVI-2 B16 n32768 at SmolLM2's heads;
#  2. the attention calls replayed alone (the per-call targets), InternVL and SmolLM2 heads, B1 and B16 n32768.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 240 python3 -m pytest -q -m gpu tests/test_text_gluon.py -k "unmasked or matches_reference or whole_waves" 2>&1 | tail -3
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants"
V="full:,masked:MMKV_TEXT_FULL=0,full2:,masked2:MMKV_TEXT_FULL=0"
F="^## |^\| _text_kernel|Error|error"
timeout 150 $S --batch 16 --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 6 --variants "$V" --out $OUT/step_xquant_b16.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 100 $S --batch 1 --spec "text=kivi:bits=2" --rounds 10 --variants "$V" --out $OUT/step_kivi2_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 80 $S --model random:smollm2-135m --batch 16 --spec "text=kivi:bits=2" --rounds 10 --variants "$V" --out $OUT/step_smollm2_b16.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 150 python3 -m eval.bench.text_attention --contexts 32768 --batches 1,16 --layouts smollm2,internvl2.5-8b \
  --ab MMKV_TEXT_FULL=1,0 --out $OUT/text_attention.json 2>&1 | grep -v -i warn | tail -40
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
