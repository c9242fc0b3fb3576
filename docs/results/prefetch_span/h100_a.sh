# Session 20 (issue 26): one L2 prefetch request every N iterations (MMKV_TEXT_PREFETCH_SPAN,
# MMKV_SKVQ_PREFETCH_SPAN) and the text kernel's paired K code bytes (MMKV_TEXT_KPAIR). First call: the GPU tests,
# then the text kernel per call (InternVL / SmolLM2 heads, B16 n32768; KPAIR, BCOL, the plan's prefetch at spans 1/4/8,
# prefetch forced at span 4)
# and the SKVQ kernel per call at B1 (spans 1/2/4/8).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/test_prefetch_span.py tests/test_text_k_operand.py 2>&1 | tail -3
timeout 200 python3 -m eval.bench.text_attention --layouts internvl2.5-8b,smollm2 --contexts 32768 --batches 16 \
  --no-baselines --ab "MMKV_TEXT_KPAIR:MMKV_TEXT_BCOL:MMKV_TEXT_PREFETCH:MMKV_TEXT_PREFETCH_SPAN=0:0::,1:0::,1:1::,1:1::4,1:1:1:4,1:1::8" \
  --out $OUT/call_text.json 2>&1 | grep -v -i warn | tail -40
timeout 120 python3 -m eval.bench.skvq_attention --groups 64 --variants var --graphs --shapes internvl2.5-8b \
  --tokens 32768 --batches 1 --ab "s1:,s2:MMKV_SKVQ_PREFETCH_SPAN=2,s4:MMKV_SKVQ_PREFETCH_SPAN=4,s8:MMKV_SKVQ_PREFETCH_SPAN=8" \
  --out $OUT/call_skvq_b1.json 2>&1 | grep -E "^\| .*(sdpa|K2V1.5)|Error" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
# inside the decode step of random:internvl2.5-8b n32768, XQuant 1.375 B16 (variants interleaved round by round)
timeout 200 python3 -m eval.studies.step_kernels --context 32768 --base-variants --batch 16 \
  --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 3 \
  --variants "old:MMKV_TEXT_KPAIR=0,kp:,kp4:MMKV_TEXT_PREFETCH_SPAN=4,oldb:MMKV_TEXT_KPAIR=0,kp4b:MMKV_TEXT_PREFETCH_SPAN=4" \
  --out $OUT/step_xquant_b16.json 2>&1 | grep -E "^## |^\| _text_kernel|^\| _merge|Error|error" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
