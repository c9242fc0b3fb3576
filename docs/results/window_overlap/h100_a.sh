# Session 18 (issue 26), first H100 call: the window beside the text kernel (MMKV_WINDOW_OVERLAP) and the SKVQ
# kernel's unmasked copy of its loop (MMKV_SKVQ_FULL):
#  0. GPU tests: both bit-equal to their switch off, against the reference; session 17's strengthened text test;
#  1. inside the decode step at batch 1 (random:internvl2.5-8b n32768, graph replays, variants interleaved round by
#     round): KIVI-2 overlap on/off; SKVQ K2/V1.5 g64 new / masked loop / overlap off.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/test_window_split.py tests/test_text_gluon.py tests/test_skvq_gluon.py \
  -k "overlap or unmasked or test_gpu_skvq_kernel_matches_reference" 2>&1 | tail -4
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants --batch 1"
F="^## |^\| _text_kernel|^\| _skvq_kernel|^\| _segment_kernel|^\| _merge|Error|error"
timeout 110 $S --spec "text=kivi:bits=2" --rounds 10 --variants "on:,off:MMKV_WINDOW_OVERLAP=0,on2:,off2:MMKV_WINDOW_OVERLAP=0" \
  --out $OUT/step_kivi2_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 170 $S --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" --rounds 8 \
  --variants "new:,masked:MMKV_SKVQ_FULL=0,serial:MMKV_WINDOW_OVERLAP=0,new2:,masked2:MMKV_SKVQ_FULL=0,serial2:MMKV_WINDOW_OVERLAP=0" \
  --out $OUT/step_skvq_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
