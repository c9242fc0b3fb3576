# Session 20 (issue 26): three more calls on the same warm H100 after h100_a.sh (logs in h100.txt).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
# 1. batch 1 inside the decode step of random:internvl2.5-8b n32768: SKVQ and text prefetch spans 1 / 4 (/ 2)
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants"
F="^## |^\| _text_kernel|^\| _skvq_kernel|^\| _merge|Error|error"
timeout 200 $S --batch 1 --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" --rounds 6 \
  --variants "s1:,s4:MMKV_SKVQ_PREFETCH_SPAN=4,s2:MMKV_SKVQ_PREFETCH_SPAN=2,s1b:,s4b:MMKV_SKVQ_PREFETCH_SPAN=4" \
  --out $OUT/step_skvq_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 170 $S --batch 1 --spec "text=kivi:bits=2" --rounds 6 \
  --variants "s1:,s4:MMKV_TEXT_PREFETCH_SPAN=4,s1b:,s4b:MMKV_TEXT_PREFETCH_SPAN=4" \
  --out $OUT/step_kivi2_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
# 2. the text budget (session 18's command) with span 4 (the rule this session then set from 32 (row, KV head) pairs)
MMKV_TEXT_PREFETCH_SPAN=4 timeout 420 python3 -m eval.bench budget --model random:internvl2.5-8b --visual 0 \
  --text 32768 --budgets 20,40 --spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 2 \
  --out $OUT/h100_budget_text.json 2>&1 | grep -v -i warn | tail -30
# 3. the text kernel's GPU tests with the new defaults (KPAIR, BCOL)
timeout 190 python3 -m pytest -q -m gpu -n 4 tests/test_text_gluon.py tests/test_window_split.py \
  -k "matches_reference or unmasked or overlap or whole_waves" 2>&1 | tail -4
