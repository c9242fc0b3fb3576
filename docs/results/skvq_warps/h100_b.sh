# Session 19 (issue 26), second H100 call: after the 2-warp rule (skvq_rules.skvq_warps) — the GPU tests, the L2
# prefetch (MMKV_SKVQ_PREFETCH 0/1/2) and 2 vs 4 warps at B64 per call, then inside the decode step: B1 prefetch
# 0/1/2, B16 2 vs 4 warps.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/test_skvq_warps.py tests/test_skvq_gluon.py tests/test_skvq_split.py 2>&1 | tail -4
B="python3 -m eval.bench.skvq_attention --groups 64 --variants var --graphs"
timeout 100 $B --shapes internvl2.5-8b,smollm2-135m --tokens 32768 --batches 1,16 \
  --ab "p0:MMKV_SKVQ_PREFETCH=0,p1:MMKV_SKVQ_PREFETCH=1,p2:MMKV_SKVQ_PREFETCH=2" --out $OUT/call_prefetch.json 2>&1 | grep -E "^\| .*(sdpa|K2V1.5)|Error" | grep -v -i warn
timeout 60 $B --shapes internvl2.5-8b --tokens 32768 --batches 64 \
  --ab "w4:MMKV_SKVQ_WARPS=4,w2:MMKV_SKVQ_WARPS=2" --out $OUT/call_b64.json 2>&1 | grep -E "^\| .*(sdpa|K2V1.5)|Error" | grep -v -i warn
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants --spec text=skvq:k_bits=2,v_bits=1.5,group=64"
F="^## |^\| _skvq_kernel|^\| _merge|Error|error"
timeout 150 $S --batch 1 --rounds 6 --variants "p0:,p1:MMKV_SKVQ_PREFETCH=1,p2:MMKV_SKVQ_PREFETCH=2,p0b:,p1b:MMKV_SKVQ_PREFETCH=1" \
  --out $OUT/step_b1_prefetch.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 200 $S --batch 16 --rounds 4 --variants "w2:,w4:MMKV_SKVQ_WARPS=4,w2b:,w4b:MMKV_SKVQ_WARPS=4" \
  --out $OUT/step_b16_warps.json 2>&1 | grep -E "$F" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
